"""Engine flags as a user types them, turned into the EngineConfig the CLI would build."""
from __future__ import annotations

import argparse

from kvforge.cli import add_engine_args, engine_kwargs
from kvforge.config import EngineConfig


def engine_config_from_flags(flags: list[str]) -> EngineConfig:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return EngineConfig.from_kwargs(**engine_kwargs(parser.parse_args(flags)))
