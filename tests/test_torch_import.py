"""kvforge's entry points import torch with the collector paused and then frozen
(kvforge/torch_import.py); a process that imported torch itself is left alone."""
from __future__ import annotations

import subprocess
import sys

import pytest


def _run(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip()


@pytest.mark.parametrize("entry", ["from kvforge import LLM",
                                   "from kvforge import EngineConfig"])
def test_entry_points_freeze_torch_and_restore_the_collector(entry):
    out = _run(f"import gc, sys\n{entry}\n"
               "print('torch' in sys.modules, gc.isenabled(), gc.get_freeze_count())")
    loaded, enabled, frozen = out.split()
    assert loaded == "True" and enabled == "True"
    assert int(frozen) > 100_000          # torch's objects left the generations


def test_collector_left_off_when_it_was_off():
    out = _run("import gc\ngc.disable()\nfrom kvforge.torch_import import import_torch_frozen\n"
               "import_torch_frozen()\nprint(gc.isenabled(), gc.get_freeze_count() > 0)")
    assert out.split() == ["False", "True"]


def test_a_process_that_imported_torch_is_left_alone():
    out = _run("import torch, gc\nfrom kvforge import LLM\n"
               "print(gc.isenabled(), gc.get_freeze_count())")
    assert out.split() == ["True", "0"]
