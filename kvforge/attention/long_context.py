"""Engine glue for long-context attention options (``EngineConfig.sparse_attention`` ...).

Two hooks keep the shared engine files to one line each:

- ``apply_sparse_attention(config)`` (EngineConfig.__post_init__): validates the options and
  turns ``sparse_attention="quest"`` into ``attention_backend="quest"``.
- ``configure_long_context(model, config)`` (ModelRunner, after loading): the attention
  backends are built by the model without knowing their layer index or the budget, so the
  runner hands both to every QUEST backend afterwards; attention windows (StreamingLLM flags
  or the model's own sliding window) replace the paged backends here too.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from kvforge.config import EngineConfig

SPARSE_ATTENTION_METHODS = ("none", "quest")


def apply_sparse_attention(config: "EngineConfig") -> None:
    method = config.sparse_attention or "none"
    if method not in SPARSE_ATTENTION_METHODS:
        raise ValueError(f"sparse_attention must be one of {SPARSE_ATTENTION_METHODS}, "
                         f"got {config.sparse_attention!r}")
    if not isinstance(config.sparse_token_budget, int) or config.sparse_token_budget <= 0:
        raise ValueError(f"sparse_token_budget must be a positive integer, "
                         f"got {config.sparse_token_budget!r}")
    if not isinstance(config.quest_dense_layers, int) or config.quest_dense_layers < 0:
        raise ValueError(f"quest_dense_layers must be an integer >= 0, "
                         f"got {config.quest_dense_layers!r}")
    if method == "quest":
        if config.attention_backend not in ("paged", "quest"):
            raise ValueError(f"sparse_attention='quest' runs on the paged layout; it cannot be "
                             f"combined with attention_backend={config.attention_backend!r} "
                             f"(an fp8 KV cache selects its own backend)")
        if config.sparse_token_budget < config.block_size:
            raise ValueError(f"sparse_token_budget {config.sparse_token_budget} is smaller than "
                             f"one block ({config.block_size} tokens)")
        config.attention_backend = "quest"


def configure_long_context(model: "torch.nn.Module", config: "EngineConfig") -> None:
    # sinks + sliding window (attention/window_setup.py): swaps in windowed backends, if any
    from kvforge.attention.window_setup import configure_attention_window
    configure_attention_window(model, config)
    if config.attention_backend == "quest":
        from kvforge.attention.quest import configure_quest
        if configure_quest(model, config.sparse_token_budget, config.quest_dense_layers) == 0:
            raise ValueError(f"sparse_attention='quest': model {type(model).__name__} builds no "
                             f"QUEST attention backend (its attention does not use "
                             f"attention_backend)")
