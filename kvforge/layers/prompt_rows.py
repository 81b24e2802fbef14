"""Whether the forward running now computes prompt rows: a mode the ModelRunner sets around the
forward of the sequences that prefill their prompt (``engine/model_runner._path_groups``).

Why: kernels whose rounding depends on how many rows a call has would give a prompt's rows other
bits when the prompt arrives in other pieces. GGUF projections quantize activations to 8 bits
and leave the dot kernels for int8 panels (another activation step) from a measured row count
on, so a prefix-cache hit's few tail rows, or a chunked prefill's short last chunk, would round
unlike the same rows in the whole prompt, and greedy output could differ at near-ties. In this
mode a GGUF projection takes its many-row kernel at any row count (``quant/gguf.py``) and the
compiled decode stack stands aside (``models/compiled_decode.py``): every prompt row is computed
one way, whatever the split and whatever shares the step.

A context variable, so each thread (the engine's, a test's) has its own.
"""
from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

_PROMPT_ROWS = contextvars.ContextVar("kvforge_prompt_rows", default=False)


def computing_prompt_rows() -> bool:
    return _PROMPT_ROWS.get()


@contextlib.contextmanager
def prompt_rows(enabled: bool = True) -> Iterator[None]:
    """Run the enclosed forward as prompt rows (``enabled``) or as it would run anyway."""
    token = _PROMPT_ROWS.set(enabled)
    try:
        yield
    finally:
        _PROMPT_ROWS.reset(token)
