"""Validation of the engine's offload arguments (EngineConfig.offload_*)."""
from __future__ import annotations

import os

DEFAULT_OFFLOAD_DIR = os.path.expanduser("~/.cache/kvforge/offload")


def validate_offload_args(config) -> None:
    """Checks the offload fields of an EngineConfig and sets ``offload_memory_budget_bytes``
    (None when offload is off) and ``offload_dir_path``."""
    from kvforge.config import parse_bytes
    from kvforge.offload.policy import parse_policy
    config.offload_memory_budget_bytes = None
    config.offload_dir_path = os.path.expanduser(config.offload_dir or DEFAULT_OFFLOAD_DIR)
    if config.offload_memory_budget is None:
        given = {name: getattr(config, name) for name, default in
                 (("offload_dir", None), ("offload_policy", "lp"), ("offload_batch_size", 8),
                  ("offload_block_batches", None), ("offload_trace", None))
                 if getattr(config, name) != default}
        if given:
            raise ValueError(f"offload arguments {sorted(given)} need offload_memory_budget "
                             f"(the memory budget that turns offloading on)")
        return
    config.offload_memory_budget_bytes = parse_bytes(config.offload_memory_budget)
    spec = parse_policy(config.offload_policy)
    if not isinstance(config.offload_batch_size, int) or config.offload_batch_size < 1:
        raise ValueError(f"offload_batch_size must be an integer >= 1, got "
                         f"{config.offload_batch_size!r}")
    nb = config.offload_block_batches
    if nb is not None and (not isinstance(nb, int) or nb < 1):
        raise ValueError(f"offload_block_batches must be an integer >= 1 or None, got {nb!r}")
    if spec.kind == "naive" and nb not in (None, 1):
        raise ValueError(f"offload_policy='naive' runs one batch at a time; "
                         f"offload_block_batches={nb} contradicts it")
    if config.offload_dir is not None and os.path.exists(config.offload_dir) \
            and not os.path.isdir(config.offload_dir):
        raise ValueError(f"offload_dir {config.offload_dir!r} is not a directory")
    if config.device != "cpu":
        raise ValueError(f"offloading runs on device 'cpu' (RAM + disk tiers), got "
                         f"{config.device!r}")
    if config.tensor_parallel_size != 1:
        raise ValueError("offloading runs in one process; tensor_parallel_size must be 1, got "
                         f"{config.tensor_parallel_size}")
    if config.speculative_method not in (None, "none"):
        raise ValueError(f"offloading does not combine with speculative decoding "
                         f"({config.speculative_method!r})")
    if config.sparse_attention not in (None, "none"):
        # QUEST keeps its own cache layout and per-block key bounds, which the disk tier's
        # staged blocks do not carry
        raise ValueError(f"offloading attends densely over staged KV blocks; it does not combine "
                         f"with sparse_attention={config.sparse_attention!r}")
    if config.preemption_mode != "recompute":
        # swapping copies the RAM pools; a disk-KV layer's blocks live in its disk file
        raise ValueError(f"offloading preempts by recompute (its disk-KV layers' blocks are "
                         f"not in the RAM pools a swap copies); got preemption_mode="
                         f"{config.preemption_mode!r}")
    if config.quantization not in ("auto", "none", "gguf", None, ""):
        raise ValueError(f"offloading streams fp32 weights (quantization 'none') or a GGUF "
                         f"file's own blocks ('auto' / 'gguf'); got "
                         f"quantization={config.quantization!r}")
    if not config.quantization:
        config.quantization = "none"
