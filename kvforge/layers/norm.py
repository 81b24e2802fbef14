"""RMSNorm (Llama family): ``y = weight * x / sqrt(mean(x^2) + eps)``, computed in fp32."""
from __future__ import annotations

import torch
import torch.nn.functional as F
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
        if x.dtype is torch.float32:
            # one fused pass (compiled kernel on CPU; same math in PyTorch otherwise)
            y, total = kernel_ops.add_rms_norm(x, residual, self.weight, self.eps)
            return y if residual is None else (y, total)
        if residual is not None:
            x = x + residual
            residual = x
        orig_dtype = x.dtype
        # fp32 statistics even for half-precision activations, like the reference models
        y = F.rms_norm(x.float(), (self.hidden_size,), None, self.eps).to(orig_dtype) * self.weight
        return y if residual is None else (y, residual)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}"
