"""Activation functions, including the fused gated ones that read a ``gate_up`` projection.

A gated MLP computes ``act(gate) * up``; we keep gate and up in ONE weight so the layer does a
single matmul, and the activation splits the result in half:

    gate_up: [T, 2 * I] = [ gate (I) | up (I) ]  ->  act(gate) * up : [T, I]
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kvforge.kernels import ops as kernel_ops

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


def get_act_fn(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in _ACTIVATIONS:
        raise ValueError(f"unsupported activation {name!r}; supported: {sorted(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]


class GatedActivation(nn.Module):
    """``act(x[..., :I]) * x[..., I:]`` for a fused ``[gate | up]`` input of width ``2 * I``."""

    def __init__(self, act_name: str = "silu") -> None:
        super().__init__()
        self.act_name = act_name
        self.act_fn = get_act_fn(act_name)

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.act_fn is F.silu:
            return kernel_ops.silu_and_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act_fn(gate).mul_(up)

    def extra_repr(self) -> str:
        return self.act_name


class SiluAndMul(GatedActivation):
    """SwiGLU: ``silu(gate) * up``."""

    def __init__(self) -> None:
        super().__init__("silu")
