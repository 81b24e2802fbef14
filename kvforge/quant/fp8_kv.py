"""FP8 KV cache: paged K/V stored in 8 bits (``--kv-cache-dtype fp8_e4m3|fp8_e5m2``), for the
full-attention layers (``paged_fp8_*``) and the sliding-window ones (``windowed_fp8_*``: Gemma 3's
local layers, model windows, StreamingLLM).

Scale choice: ONE static scale per tensor (K and V of every layer), ``k_scale = v_scale = 1.0``
by default, as vLLM does without calibrated scales. Stored value = fp8(clamp(x / scale)). Why
not per-token/per-head scales: they would need extra bytes per token beside each block (breaking
the "exactly 4x the tokens of fp32" budget and every code path that copies or gathers whole
blocks as one tensor), and with 1.0 the formats already cover K/V ranges of Llama-family models:

    format    max      relative step   smallest normal
    e4m3      448      2^-3 (12.5%)    2^-6        more precision: the default choice
    e5m2      57344    2^-2 (25%)      2^-14       more range, less precision

Values beyond the format's max saturate (clamped) instead of becoming inf/NaN.

The scales cost nothing at attention time: q . (k8 * ks) = (q * ks) . k8, so ``k_scale`` is
folded into the softmax scale, and softmax @ (v8 * vs) = (softmax @ v8) * vs multiplies the
output once. Newly computed K/V are rounded to fp8 BEFORE attention too, so a prefill that
attends over its own fresh K/V sees exactly what a later chunk or decode reads back from the
cache: greedy output stays independent of chunking and batching with the fp8 cache on.
"""
from __future__ import annotations

import torch

from kvforge.attention.base import register_backend
from kvforge.attention.metadata import AttentionMetadata
from kvforge.attention.paged import PagedAttentionBackend
from kvforge.attention.windowed import WindowedAttentionBackend

KV_CACHE_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def fp8_backend_name(base_backend: str, kv_cache_dtype: str) -> str:
    """The attention backend that stores ``kv_cache_dtype``; ValueError if none exists."""
    if kv_cache_dtype == "auto":
        return base_backend
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {['auto', *KV_CACHE_DTYPES]}, "
                         f"got {kv_cache_dtype!r}")
    if base_backend == f"paged_{kv_cache_dtype}":
        return base_backend
    if base_backend != "paged":
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} is only implemented for the 'paged' "
                         f"attention backend, got attention_backend={base_backend!r}")
    return f"paged_{kv_cache_dtype}"


def quantize_fp8(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """x / scale rounded to fp8 ``dtype``, saturating at the format's max."""
    limit = float(torch.finfo(dtype).max)
    return (x.float() / scale).clamp_(-limit, limit).to(dtype)


class FP8KVCache:
    """What makes a paged-layout backend store fp8 K/V: mixed in before ``PagedAttentionBackend``
    or ``WindowedAttentionBackend`` (their gathers read the cache back with ``.to(q.dtype)``;
    the compiled decode attention and decode stack read the fp8 blocks themselves,
    ``kernels/csrc/kv_fp8.cpp``); subclasses fix ``cache_torch_dtype``."""

    cache_torch_dtype: torch.dtype
    k_scale: float = 1.0
    v_scale: float = 1.0

    def __init__(self, num_heads: int, num_kv_heads: int, head_size: int, scale: float,
                 head_size_v: int | None = None) -> None:
        # the softmax scale absorbs k_scale (see module docstring)
        super().__init__(num_heads, num_kv_heads, head_size, scale * self.k_scale, head_size_v)

    def cache_dtype(self, compute_dtype: torch.dtype) -> torch.dtype:
        return self.cache_torch_dtype

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        if kv_cache.dtype != self.cache_torch_dtype:
            raise ValueError(f"{self.name} needs a {self.cache_torch_dtype} kv_cache, got "
                             f"{kv_cache.dtype}")
        # values already on the fp8 grid: the parent's cast on write is exact
        k8 = quantize_fp8(k, self.k_scale, self.cache_torch_dtype).to(q.dtype)
        v8 = quantize_fp8(v, self.v_scale, self.cache_torch_dtype).to(q.dtype)
        out = super().forward(q, k8, v8, kv_cache, meta)
        return out.mul_(self.v_scale) if self.v_scale != 1.0 else out


class _E4M3:
    cache_torch_dtype = torch.float8_e4m3fn


class _E5M2:
    cache_torch_dtype = torch.float8_e5m2


@register_backend("paged_fp8_e4m3")
class PagedFP8E4M3Backend(_E4M3, FP8KVCache, PagedAttentionBackend):
    pass


@register_backend("paged_fp8_e5m2")
class PagedFP8E5M2Backend(_E5M2, FP8KVCache, PagedAttentionBackend):
    pass


# the sliding-window backend over the same storage (Gemma 3's local layers, Mistral-style
# model windows, StreamingLLM): the window's gathers and masks are the parent's
@register_backend("windowed_fp8_e4m3")
class WindowedFP8E4M3Backend(_E4M3, FP8KVCache, WindowedAttentionBackend):
    pass


@register_backend("windowed_fp8_e5m2")
class WindowedFP8E5M2Backend(_E5M2, FP8KVCache, WindowedAttentionBackend):
    pass

