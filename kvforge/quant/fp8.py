"""FP8 weight storage: E4M3 (``torch.float8_e4m3fn``, max 448) with per-output-channel scales.

    W [out, in] -> W8_t [in, out] fp8 = W^T / scale,   scale [out] = max_i |W[o, i]| / 448
    y = (x @ upcast(W8_t)) * scale        (the scale factors out of the sum over i)

CPUs have no FP8 GEMM, so ``apply`` upcasts the weight to the activation dtype one tile of
``tile_cols`` output channels at a time (bounded temporary memory, never a full fp32 copy held
between calls). This halves (vs bf16) or quarters (vs fp32) weight memory but is SLOWER than fp32
on CPU: every call converts every weight. It is a storage format here, not a speed-up.
"""
from __future__ import annotations

import torch
from torch import nn

from kvforge.layers.linear import UnquantizedLinearMethod
from kvforge.quant.base import is_lm_head, QuantizationConfig, register_quantization
from kvforge.quant.w8a8_ops import take_float_weight

FP8_E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)   # 448


def quantize_fp8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W [out, in] -> (W8_t [in, out] float8_e4m3fn contiguous, scale [out] float32)."""
    w = weight.float()
    scale = w.abs().amax(dim=1).clamp_min(1e-12) / FP8_E4M3_MAX
    w8 = (w / scale[:, None]).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return w8.t().contiguous(), scale


class FP8LinearMethod(UnquantizedLinearMethod):
    def __init__(self, tile_cols: int) -> None:
        self.tile_cols = tile_cols

    def process_weights_after_loading(self, layer):
        weight = take_float_weight(layer)
        if weight is None:
            return                                   # already quantized (idempotent)
        w8_t, scale = quantize_fp8_per_channel(weight)
        layer.weight_fp8_t = nn.Parameter(w8_t, requires_grad=False)
        layer.weight_scale = nn.Parameter(scale, requires_grad=False)

    def apply(self, layer, x):
        if not hasattr(layer, "weight_fp8_t"):
            raise RuntimeError("fp8 layer used before process_weights_after_loading()")
        x2d = x.reshape(-1, layer.input_size)
        dtype = x2d.dtype
        y = x2d.new_empty(x2d.shape[0], layer.output_size)
        for c0 in range(0, layer.output_size, self.tile_cols):
            c1 = min(c0 + self.tile_cols, layer.output_size)
            y[:, c0:c1] = torch.mm(x2d, layer.weight_fp8_t[:, c0:c1].to(dtype))
        y.mul_(layer.weight_scale.to(dtype))
        if layer.has_bias:
            y.add_(layer.bias.to(dtype))
        return y.view(*x.shape[:-1], layer.output_size)


@register_quantization("fp8")
class FP8Config(QuantizationConfig):
    """``tile_cols``: output channels upcast per step of ``apply``. LM head stays in float."""

    def __init__(self, tile_cols: int = 2048) -> None:
        if tile_cols <= 0:
            raise ValueError(f"fp8 tile_cols must be > 0, got {tile_cols!r}")
        self.tile_cols = tile_cols

    def get_linear_method(self, prefix: str):
        if is_lm_head(prefix):
            return None
        return FP8LinearMethod(self.tile_cols)
