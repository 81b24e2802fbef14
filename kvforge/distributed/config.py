"""Validation of the parallel options of ``EngineConfig`` (one hook in config.py)."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvforge.config import EngineConfig

EXECUTOR_BACKENDS = ("mp", "ray")


def validate_parallel_args(config: "EngineConfig") -> None:
    n = config.tensor_parallel_size
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {n!r}")
    if config.distributed_executor_backend not in EXECUTOR_BACKENDS:
        raise ValueError(f"distributed_executor_backend must be one of {EXECUTOR_BACKENDS}, "
                         f"got {config.distributed_executor_backend!r}")
    if n == 1:
        return
    # what the slices do not run yet: each refused by name rather than run wrongly ("auto",
    # the default, takes what runs: float slices, a GGUF file in its own blocks)
    if config.quantization not in (None, "", "none", "auto", "gguf"):
        raise ValueError(f"tensor parallel runs float weights and GGUF blocks only: quantization "
                         f"{config.quantization!r} is not supported with tensor_parallel_size "
                         f"{n}")
    if config.speculative_method not in (None, "none"):
        raise ValueError(f"speculative decoding ({config.speculative_method!r}) is not supported "
                         f"with tensor_parallel_size {n}")
    if config.preemption_mode != "recompute":
        raise ValueError(f"preemption_mode {config.preemption_mode!r} is not supported with "
                         f"tensor_parallel_size {n} (KV swapping copies one process's cache); "
                         f"use recompute")
    if config.attention_backend not in ("paged", "tiled"):
        raise ValueError(f"attention backend {config.attention_backend!r} (fp8 KV cache, QUEST) "
                         f"is not supported with tensor_parallel_size {n}")
    if config.attention_sinks or config.sliding_window is not None:
        raise ValueError(f"attention sinks / sliding window are not supported with "
                         f"tensor_parallel_size {n}")
