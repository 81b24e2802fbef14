"""Weight-only INT8 per output channel (``--quantization int8``, the WINT8 scheme).

Storage per layer: ``qweight`` [N, K] int8 and ``scales`` [N] bf16, ``W ~= qweight * scales``.
Forward: ``torch._weight_int8pack_mm`` on bf16 activations (the fp32-input path of that kernel is a
scalar loop, many times slower); the matrix is never dequantized. Rows are independent, so each shard
(q|k|v, gate|up) is quantized the moment it is loaded, straight into the final buffers.
``load_weight`` also accepts ``Int8Rows`` (codes already chosen: a reload of a saved model).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kvforge.layers.linear import LinearMethod
from kvforge.quant import packing
from kvforge.quant.base import (QuantizationConfig, is_lm_head, register_quantization,
                                weight_shard_rows)


@dataclass
class Int8Rows:
    """Rows of an INT8 weight whose codes are already chosen: q [n, K] int8, scale [n]."""
    q: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)


class Int8LinearMethod(LinearMethod):
    def create_weights(self, layer, dtype, device):
        if torch.device(device).type not in ("cpu", "meta"):
            raise ValueError(f"int8 weights run on PyTorch's CPU kernel; device {device!r} "
                             f"is not supported")
        n, k = layer.output_size, layer.input_size
        layer.qweight = nn.Parameter(torch.zeros(n, k, dtype=torch.int8, device=device),
                                     requires_grad=False)
        layer.scales = nn.Parameter(torch.zeros(n, dtype=packing.SCALE_DTYPE, device=device),
                                    requires_grad=False)
        if layer.has_bias:
            layer.bias = nn.Parameter(torch.zeros(n, dtype=dtype, device=device), requires_grad=False)

    def load_weight(self, layer, kind, loaded, output_offset):
        rows = weight_shard_rows(layer, kind, loaded, output_offset)
        if rows is None:
            return
        if isinstance(loaded, Int8Rows):
            q, scale = loaded.q, loaded.scale
        else:
            q, scale = packing.quantize_int8_per_channel(loaded)
        layer.qweight[rows] = q
        layer.scales[rows] = scale.to(packing.SCALE_DTYPE)

    def apply(self, layer, x):
        x2d = x.reshape(-1, layer.input_size).to(torch.bfloat16)
        y = torch._weight_int8pack_mm(x2d, layer.qweight, layer.scales).to(x.dtype)
        if layer.has_bias:
            y += layer.bias
        return y.view(*x.shape[:-1], layer.output_size)

    def export_rows(self, layer) -> Int8Rows:
        return Int8Rows(layer.qweight.detach(), layer.scales.detach())

    def dequantize(self, layer) -> torch.Tensor:
        return packing.dequantize_int8(layer.qweight, layer.scales)


LM_HEAD_CHOICES = ("int8", "int4", "none")
LM_HEAD_INT4_GROUP = 32     # the head feeds the logits directly: its finest group


def lm_head_method(choice: str, prefix: str) -> LinearMethod | None:
    """The LM head's method for weight-only configs: int8 per channel, int4 group 32, or float
    (None). At batch 1 the int4 kernel reads the 49152 x 576 head of SmolLM2 ~3x faster than the
    int8 one (benchmarks/quant_kernels.py), for a small perplexity cost (README table)."""
    if choice not in LM_HEAD_CHOICES:
        raise ValueError(f"lm_head must be one of {LM_HEAD_CHOICES}, got {choice!r}")
    if choice == "int4":
        from kvforge.quant.int4 import Int4LinearMethod     # int4 imports this module
        return Int4LinearMethod(LM_HEAD_INT4_GROUP)
    return Int8LinearMethod() if choice == "int8" else None


def _lorc_mixin():
    from kvforge.quant.lowrank import LoRCConfigMixin     # lowrank imports int8 lazily
    return LoRCConfigMixin


@register_quantization("int8")
class Int8Config(_lorc_mixin(), QuantizationConfig):
    """Every linear layer, the LM head included unless ``lm_head="none"``, and MoE experts
    (per expert, per output channel; quant/moe_experts.py). MoE routers stay float.
    ``lorc_rank``: LoRC low-rank compensation of the linear layers (lowrank.py; 0 = off),
    ``lorc_act``: 1 weighs its factors by calibration activations."""

    def __init__(self, lm_head: str = "int8", lorc_rank: int = 0, lorc_act: int = 0) -> None:
        lm_head_method(lm_head, "lm_head")
        self.lm_head = lm_head
        self.init_lorc(lorc_rank, lorc_act)

    def get_linear_method(self, prefix: str) -> LinearMethod | None:
        if is_lm_head(prefix):
            return self.lorc(lm_head_method(self.lm_head, prefix), prefix)
        return self.lorc(Int8LinearMethod(), prefix)

    def get_experts_method(self, prefix: str):
        from kvforge.quant.moe_experts import Int8ExpertsMethod
        return Int8ExpertsMethod()

    def describe(self) -> dict:
        out = {"lm_head": self.lm_head}
        return {**out, **self.lorc_args()}
