"""RMSNorm: ``y = weight * x / sqrt(mean(x^2) + eps)`` (Llama family), computed in fp32, and
Gemma's variant ``OffsetRMSNorm`` that scales by ``1 + weight``."""
from __future__ import annotations

import torch
from torch import nn

from kvforge.kernels import ops as kernel_ops


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        super().__init__()
        if hidden_size <= 0:
            raise ValueError(f"RMSNorm hidden_size must be > 0, got {hidden_size}")
        if eps <= 0:
            raise ValueError(f"RMSNorm eps must be > 0, got {eps}")
        self.hidden_size = hidden_size
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device),
                                   requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without ``residual``: the normed ``x``. With it: ``(norm(x + residual), x + residual)``,
        the pre-norm decoder pattern in one call, so each layer does the residual add once."""
        # one fused pass: the compiled kernel for fp32 on CPU, otherwise the same math in
        # PyTorch with fp32 statistics even for half-precision activations (kernels/ops.py)
        y, total = kernel_ops.add_rms_norm(x, residual, self.weight, self.eps)
        return y if residual is None else (y, total)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}"


class OffsetRMSNorm(RMSNorm):
    """Gemma's RMSNorm: ``y = (1 + weight) * x / sqrt(mean(x^2) + eps)``, with ``weight``
    stored zero-centred as in HF checkpoints (a fresh layer is the identity scale).

    Computed like HF's ``Gemma3RMSNorm``: normalise and scale in fp32, then cast back, so an
    fp32 model agrees with it to the last bit. Works over the last dim of any shape (the
    per-head q/k norms take ``[T, heads, head_dim]``)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        super().__init__(hidden_size, eps, dtype, device)
        with torch.no_grad():
            self.weight.zero_()              # zero-centred: a fresh layer scales by 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}, scale=1+weight"
