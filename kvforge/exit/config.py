"""What early exit and early-exit speculation need of the rest of the engine configuration."""
from __future__ import annotations


def validate_early_exit_args(config) -> None:
    from kvforge.exit.model import validate_threshold
    if config.early_exit_threshold is not None:
        validate_threshold(config.early_exit_threshold)
    on = config.early_exit_threshold is not None or config.speculative_method == "early-exit"
    if not on:
        return
    what = ("early_exit_threshold" if config.early_exit_threshold is not None
            else "speculative_method early-exit")
    if config.early_exit_threshold is not None and config.speculative_method not in (None, "none"):
        raise ValueError(f"early_exit_threshold (lossy) and speculative_method "
                         f"{config.speculative_method!r} do not combine; for lossless early exit "
                         f"use speculative_method 'early-exit' alone")
    if config.speculative_method == "early-exit" and config.speculative_draft_model:
        raise ValueError("speculative_method 'early-exit' drafts with the target's own layers; "
                         "drop speculative_draft_model")
    # the exit forward writes K/V into the plain paged cache of one in-memory model
    if config.attention_backend != "paged":
        raise ValueError(f"{what} needs attention_backend 'paged' (an fp32/bf16 KV cache), got "
                         f"{config.attention_backend!r}")
    if config.tensor_parallel_size > 1 or config.offload_memory_budget is not None:
        raise ValueError(f"{what} runs in a single in-memory model: no tensor parallelism or "
                         f"offloading")
    if config.activation_sparsity > 0:
        raise ValueError(f"{what} and activation_sparsity do not combine")
