"""``import torch`` with the cyclic garbage collector paused, then frozen.

Importing torch creates ~280,000 long-lived objects (modules, functions, types, operator
tables). With the collector on, every time the objects it tracks grow by a quarter it runs a
full collection over all of them: ~0.1 s of a ~1 s import on a 2-core VM, and the engine's
start-up then walks them again (its ``gc.collect()`` before ``gc.freeze()``: ~70 ms). Those
walks find next to nothing: the import's cyclic garbage is ~7,000 objects, ~0.7 MB (typing
aliases, closures). So the entry points that build an engine (the CLI, ``kvforge.LLM`` /
``LLMEngine`` / ``EngineConfig``) import torch through here: collector off, the import, then
``gc.freeze()`` moves everything alive (and that garbage) into the permanent generation, which
no collection walks again; the collector is back on after. A process that imported torch
itself is left as it is.
"""
from __future__ import annotations

import gc
import importlib
import sys


def import_torch_frozen() -> None:
    if "torch" in sys.modules:
        return
    enabled = gc.isenabled()
    gc.disable()
    try:
        importlib.import_module("torch")
    finally:
        gc.freeze()
        if enabled:
            gc.enable()
