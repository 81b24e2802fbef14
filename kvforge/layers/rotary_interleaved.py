"""Rotary embeddings in the interleaved ("GPT-J" / complex-number) layout, as DeepSeek-V2 uses.

Consecutive features form a pair; position p turns pair i by the angle ``p * inv_freq[i]``::

    x = [a0 b0 a1 b1 ...]          (a_i + j b_i) * (cos + j sin)
    out = [a0 cos0 - b0 sin0, b0 cos0 + a0 sin0, a1 cos1 - b1 sin1, ...]

HF's DeepSeek-V2 computes exactly this with ``torch.view_as_complex``; here it is two real
multiply-adds on a ``[..., R/2, 2]`` view. ``inv_freq`` comes from the shared
``compute_inv_freq`` (default / linear / llama3 scaling; other types raise a ValueError).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kvforge.layers.rotary import compute_inv_freq


class InterleavedRotaryEmbedding(nn.Module):
    """``cos_sin(positions)`` once per step (``[T, 1, R/2]`` each), ``apply`` per layer."""

    def __init__(self, rotary_dim: int, max_position: int = 2048, base: float = 10000.0,
                 rope_scaling: dict[str, Any] | None = None, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        super().__init__()
        if max_position <= 0:
            raise ValueError(f"max_position must be > 0, got {max_position}")
        inv_freq, attention_scaling = compute_inv_freq(rotary_dim, base, rope_scaling, max_position)
        self.rotary_dim = rotary_dim
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        table = torch.stack([freqs.cos(), freqs.sin()], dim=1) * attention_scaling  # [P, 2, R/2]
        self.register_buffer("cos_sin_table", table.to(device=device, dtype=dtype), persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cs = self.cos_sin_table.index_select(0, positions)
        return cs[:, 0].unsqueeze(1), cs[:, 1].unsqueeze(1)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` [T, heads, rotary_dim] (any strides); returns a new contiguous tensor."""
        pairs = x.unflatten(-1, (-1, 2))
        a, b = pairs[..., 0], pairs[..., 1]
        return torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2)
