"""Attention backend contract.

A backend owns how K/V live in the paged cache and how a mixed batch attends over it. The
scheduler never sees a backend; the model's attention layers call ``forward`` with the step's
``AttentionMetadata``. Later backends (tiled/flash, QUEST with per-block key min/max, sinks +
sliding window, MLA latent cache) subclass this and register themselves.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from kvforge.attention.metadata import AttentionMetadata

_BACKENDS: dict[str, type["AttentionBackend"]] = {}

# attend(q [T, H, D], k [T, KVH, D], v [T, KVH, D]) -> the rows' attention output [T, H, D]: a
# layer's attention call left to its caller (a backend over the paged cache, or kvforge/offload
# per batch over staged KV)
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def register_backend(name: str):
    def deco(cls):
        _BACKENDS[name] = cls
        cls.name = name
        return cls
    return deco


def get_backend_cls(name: str) -> type["AttentionBackend"]:
    if name not in _BACKENDS:
        # lazy import of the built-in backends
        import kvforge.attention.paged  # noqa: F401
        import kvforge.attention.tiled  # noqa: F401
        import kvforge.attention.mla  # noqa: F401
        import kvforge.attention.quest  # noqa: F401  (QUEST sparse decode)
        import kvforge.quant.fp8_kv  # noqa: F401  (paged_fp8_e4m3, paged_fp8_e5m2)
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; known: {sorted(_BACKENDS)}")
    return _BACKENDS[name]


class AttentionBackend(ABC):
    """Contract:

    - ``kv_cache_shape(num_blocks, block_size)`` gives the shape of ONE layer's cache tensor;
      the runner allocates it (zeros) per layer and passes it back in every ``forward``.
    - ``forward(q, k, v, kv_cache, meta)`` first writes the new tokens' K/V at
      ``meta.slot_mapping``, then returns attention output ``[T, num_heads, head_size_v]`` where
      each query attends causally to its own sequence's cache (positions < its position + 1).
    - Shapes: q ``[T, num_heads, head_size]``, k ``[T, num_kv_heads, head_size]``,
      v ``[T, num_kv_heads, head_size_v]``. GQA/MQA: query head h reads KV head
      ``h // (num_heads // num_kv_heads)``; K/V are never copied per query head.
    """

    name: str = "base"

    def __init__(self, num_heads: int, num_kv_heads: int, head_size: int, scale: float,
                 head_size_v: int | None = None) -> None:
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} not divisible by num_kv_heads {num_kv_heads}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.head_size_v = head_size_v or head_size
        self.scale = scale

    def cache_dtype(self, compute_dtype: torch.dtype) -> torch.dtype:
        """dtype of the cache tensor the runner allocates (fp8 backends store 8-bit K/V)."""
        return compute_dtype

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        # [2 (K, V), num_blocks, block_size, num_kv_heads, head_size]
        if self.head_size_v != self.head_size:
            raise NotImplementedError("override kv_cache_shape for differing K/V head sizes")
        return (2, num_blocks, block_size, self.num_kv_heads, self.head_size)

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor: ...
