"""Rotary position embeddings (RoPE), "rotate_half" / GPT-NeoX layout as in HF Llama.

The rotated part of a head (``rotary_dim`` features) is split into halves [x1 | x2]; position p
turns each pair (x1[i], x2[i]) by the angle ``p * inv_freq[i]``:

    out = [x1 * cos - x2 * sin | x2 * cos + x1 * sin]
        = x * [cos | cos] + roll(x, half) * [-sin | sin]      (roll(x, half) = [x2 | x1])

cos/sin are precomputed for every position < ``max_position`` (one table row per position) and
gathered with the step's ``positions`` tensor, so a step costs one index plus three elementwise ops.

``inv_freq`` follows HF's ``ROPE_INIT_FUNCTIONS`` for the types we support:
  default  inv_freq[i] = base ** (-2i / dim)
  linear   inv_freq / factor                       (positions effectively divided by factor)
  llama3   long wavelengths (> original_ctx / low_freq_factor) divided by factor, short ones
           (< original_ctx / high_freq_factor) kept, the band between interpolated smoothly
  dynamic  (NTK) HF rescales the base only once a sequence outgrows max_position_embeddings; inside
           that range it equals default, which is all the table covers, so we build default.
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from kvforge.kernels import ops as kernel_ops

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "dynamic")


def rope_type_of(rope_scaling: dict[str, Any] | None) -> str:
    if not rope_scaling:
        return "default"
    # HF configs spell it "rope_type" (new) or "type" (old checkpoints)
    return rope_scaling.get("rope_type", rope_scaling.get("type", "default"))


def compute_inv_freq(rotary_dim: int, base: float, rope_scaling: dict[str, Any] | None = None,
                     max_position_embeddings: int = 2048) -> tuple[torch.Tensor, float]:
    """Returns (inv_freq [rotary_dim // 2] fp32, attention_scaling applied to cos and sin)."""
    if rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(f"rotary_dim must be a positive even number, got {rotary_dim}")
    rope_type = rope_type_of(rope_scaling)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope type {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}")
    # same fp32 arithmetic as HF, so the tables agree bit for bit
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
    if rope_type == "linear":
        inv_freq = inv_freq / float(rope_scaling["factor"])
    elif rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, rope_scaling, max_position_embeddings)
    return inv_freq, 1.0


def _llama3_inv_freq(inv_freq: torch.Tensor, rs: dict[str, Any], max_pos: int) -> torch.Tensor:
    factor = float(rs["factor"])
    low_freq_factor = float(rs.get("low_freq_factor", 1.0))
    high_freq_factor = float(rs.get("high_freq_factor", 4.0))
    original_ctx = rs.get("original_max_position_embeddings", max_pos)
    if high_freq_factor <= low_freq_factor:
        raise ValueError(f"llama3 rope needs high_freq_factor > low_freq_factor, got "
                         f"{high_freq_factor} <= {low_freq_factor}")
    low_freq_wavelen = original_ctx / low_freq_factor     # longer than this: scale fully
    high_freq_wavelen = original_ctx / high_freq_factor   # shorter than this: keep
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    # in the band between, blend linearly in (original_ctx / wavelen)
    smooth = (original_ctx / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    in_band = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(in_band, blended, scaled)


def cos_sin_rows(rotary: nn.Module, first: int, last: int,
                 device: torch.device | None = None,
                 dtype: torch.dtype | None = None) -> torch.Tensor:
    """``rotary.cos_sin`` of positions ``first .. last`` (in ``dtype``, for a module that takes
    one) as one table ``[last - first + 1, 2, rotary_dim]``, row i = (cos, signed sin) of
    position first + i: the layout of the compiled decode stack's RoPE tables."""
    positions = torch.arange(first, last + 1, device=device)
    cos, sin = rotary.cos_sin(positions) if dtype is None else rotary.cos_sin(positions, dtype)
    return torch.cat([cos, sin], dim=1).contiguous()


class RotaryEmbedding(nn.Module):
    """Precomputed RoPE table. ``cos_sin(positions)`` once per step, ``apply`` per layer."""

    def __init__(self, head_dim: int, rotary_dim: int | None = None, max_position: int = 2048,
                 base: float = 10000.0, rope_scaling: dict[str, Any] | None = None,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        super().__init__()
        rotary_dim = head_dim if rotary_dim is None else rotary_dim
        if not 0 < rotary_dim <= head_dim:
            raise ValueError(f"rotary_dim {rotary_dim} must be in (0, head_dim={head_dim}]")
        if max_position <= 0:
            raise ValueError(f"max_position must be > 0, got {max_position}")
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim
        self.max_position = max_position
        inv_freq, attention_scaling = compute_inv_freq(rotary_dim, base, rope_scaling, max_position)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        cos, sin = freqs.cos(), freqs.sin()
        if attention_scaling != 1.0:
            cos.mul_(attention_scaling)
            sin.mul_(attention_scaling)
        # table[p, 0] = [cos | cos], table[p, 1] = [-sin | sin]  (see the module docstring),
        # written in place: 32k positions x 128 dims (Qwen2.5) took ~110 ms through cat + stack
        half = inv_freq.numel()
        table = torch.empty(max_position, 2, 2 * half)
        table[:, 0, :half] = cos
        table[:, 0, half:] = cos
        torch.neg(sin, out=table[:, 1, :half])
        table[:, 1, half:] = sin
        self.register_buffer("cos_sin_table", table.to(device=device, dtype=dtype), persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[T] positions -> (cos, signed sin), each [T, 1, rotary_dim], broadcast over heads.
        Positions must be < max_position (no check here: it would cost a host sync per step)."""
        cs = self.cos_sin_table.index_select(0, positions)
        return cs[:, 0].unsqueeze(1), cs[:, 1].unsqueeze(1)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` [T, num_heads, head_dim] (any strides); returns a new contiguous tensor."""
        if self.rotary_dim == self.head_dim:
            return kernel_ops.rotary_neox(x, cos, sin)
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim:]
        rotated = torch.addcmul(rot * cos, rot.roll(self.rotary_dim // 2, dims=-1), sin)
        return torch.cat([rotated, rest], dim=-1)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        cos, sin = self.cos_sin(positions)
        return self.apply(x, cos, sin)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, rotary_dim={self.rotary_dim}, max_position={self.max_position}"


class ComputedRotaryEmbedding(nn.Module):
    """RoPE without a table: ``cos_sin`` computes the step's angles from ``inv_freq`` (the same
    fp32 ``position * inv_freq`` as HF, so the values agree with it bit for bit). For models
    with long contexts, wide heads and several RoPE bases (Gemma 3: 2 bases x 32k-128k
    positions x 256 dims would be 128-512 MiB of tables), where one step's T x D/2 cos/sin is
    cheap next to the attention it feeds. Same ``cos_sin`` / ``apply`` interface as
    ``RotaryEmbedding`` (full-width rotation)."""

    def __init__(self, head_dim: int, base: float = 10000.0,
                 rope_scaling: dict[str, Any] | None = None, max_position: int = 2048,
                 device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.head_dim = self.rotary_dim = head_dim
        self.max_position = max_position
        self.base = base
        inv_freq, self.attention_scaling = compute_inv_freq(head_dim, base, rope_scaling,
                                                            max_position)
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)

    def cos_sin(self, positions: torch.Tensor,
                dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """[T] positions -> ([cos | cos], [-sin | sin]), each [T, 1, head_dim] in ``dtype``."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        cos, sin = freqs.cos() * self.attention_scaling, freqs.sin() * self.attention_scaling
        return (torch.cat([cos, cos], -1).to(dtype).unsqueeze(1),
                torch.cat([-sin, sin], -1).to(dtype).unsqueeze(1))

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` [T, num_heads, head_dim]; returns a new contiguous tensor."""
        return kernel_ops.rotary_neox(x, cos, sin)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, base={self.base}"
