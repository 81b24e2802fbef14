"""RoPE for positions past the precomputed table (StreamingLLM runs past the trained context).

``RotaryEmbedding`` keeps one cos/sin row per position < ``max_position``. Under StreamingLLM
a sequence grows without bound while every query-key distance stays below S + W, so only the
absolute angle grows: keys are stored rotated at their true positions and RoPE scores depend
only on differences. This wrapper serves positions inside the table from the table (the exact
rows dense attention uses) and computes rows past it from float64 angles ``p * inv_freq``
(float32 angles would be off by ~p * 6e-8 rad, 0.06 rad at a million), then casts them to the
table's dtype. It never grows the table, so its memory stays fixed however long the sequence.
"""
from __future__ import annotations

import torch
from torch import nn

from kvforge.layers.rotary import RotaryEmbedding


class UnboundedRotaryEmbedding(nn.Module):
    """Drop-in for ``model.rotary_emb``: ``cos_sin`` accepts any position >= 0; ``apply`` is the
    wrapped module's. Raises at construction if the wrapped table's row layout is not the one
    rebuilt here ([cos | cos], [-sin | sin] for the rotated dims)."""

    def __init__(self, inner: RotaryEmbedding, inv_freq: torch.Tensor) -> None:
        super().__init__()
        if 2 * inv_freq.numel() != inner.rotary_dim:
            raise ValueError(f"inv_freq has {inv_freq.numel()} frequencies for rotary_dim "
                             f"{inner.rotary_dim}")
        self.inner = inner
        self.max_position = inner.max_position
        self.inv_freq = inv_freq.to(torch.float64)
        # a layout check, not a precision one: the table's float32 angles are off by up to
        # ~position * 6e-8 rad, a permuted or negated half by O(1)
        probe = torch.tensor([0, 1, inner.max_position - 1], device=inner.cos_sin_table.device)
        for ours, table in zip(self._rows(probe), inner.cos_sin(probe)):
            if not torch.allclose(ours.float(), table.float(), atol=1e-2):
                raise ValueError("RotaryEmbedding table layout is not [cos|cos], [-sin|sin]: "
                                 "UnboundedRotaryEmbedding must follow layers/rotary.py")

    # the wrapped module's facts, for code that inspects a rotary module (kernels/decode_stack.py)
    @property
    def head_dim(self) -> int:
        return self.inner.head_dim

    @property
    def rotary_dim(self) -> int:
        return self.inner.rotary_dim

    @property
    def cos_sin_table(self) -> torch.Tensor:
        return self.inner.cos_sin_table

    def _rows(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions.to(torch.float64)[:, None] * self.inv_freq.to(positions.device)
        cos, sin = angles.cos(), angles.sin()
        dtype = self.inner.cos_sin_table.dtype
        return (torch.cat([cos, cos], -1).to(dtype).unsqueeze(1),
                torch.cat([-sin, sin], -1).to(dtype).unsqueeze(1))

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # one host sync per step (positions.max): only models running past their context pay it
        if positions.numel() == 0 or int(positions.max()) < self.max_position:
            return self.inner.cos_sin(positions)
        inside = positions < self.max_position
        table_cos, table_sin = self.inner.cos_sin(torch.where(inside, positions, 0))
        far_cos, far_sin = self._rows(positions)
        keep = inside[:, None, None]
        return torch.where(keep, table_cos, far_cos), torch.where(keep, table_sin, far_sin)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return self.inner.apply(x, cos, sin)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        cos, sin = self.cos_sin(positions)
        return self.apply(x, cos, sin)
