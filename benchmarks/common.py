"""Command-line pieces shared by throughput.py and latency.py: flags, threads, the systems."""
from __future__ import annotations

import argparse
import ast

import torch

from benchmarks.hardware import physical_cores
from benchmarks.systems import HFSystem, KvforgeSystem


def add_common_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="GGUF file or HF model dir (default: the SmolLM2-135M GGUF)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads for every system (default: physical cores)")
    parser.add_argument("--skip-hf", action="store_true", help="do not run the HF baseline")
    parser.add_argument("--skip-kvforge", action="store_true",
                        help="do not run kvforge (HF tokenizer then makes the workload)")
    parser.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                        help="extra kvforge LLM kwarg, repeatable, e.g. max_num_seqs=128")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write results as JSON")


def parse_engine_args(items: list[str]) -> dict:
    """``["max_num_seqs=128", "kv_cache_memory=2GiB"]`` -> ``{"max_num_seqs": 128, ...}``;
    values are Python literals when they parse as one, strings otherwise."""
    out = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"engine arg {item!r} is not KEY=VALUE")
        try:
            value = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            value = raw
        out[key.strip()] = value
    return out


def setup_threads(requested: int | None) -> int:
    threads = requested or physical_cores()
    if threads < 1:
        raise ValueError(f"--threads must be >= 1, got {threads}")
    torch.set_num_threads(threads)
    return threads


def build_systems(args, hf_batch_size: int = 16):
    """(kvforge or None, HF or None, encode) with encode from kvforge when it runs, so every
    system receives the token ids kvforge's own tokenizer makes."""
    if args.skip_kvforge and args.skip_hf:
        raise SystemExit("nothing to run: both --skip-kvforge and --skip-hf given")
    threads = torch.get_num_threads()
    engine_kwargs = parse_engine_args(args.engine_arg)
    engine_kwargs.setdefault("num_threads", threads)       # same threads for both systems
    kv = None if args.skip_kvforge else KvforgeSystem(args.model, **engine_kwargs)
    hf = None if args.skip_hf else HFSystem(args.model, batch_size=hf_batch_size)
    torch.set_num_threads(threads)                         # in case a loader changed it
    encode = kv.encode if kv is not None else hf.encode
    return kv, hf, encode


def model_config_of(kv, hf):
    return kv.model_config if kv is not None else hf.model_config
