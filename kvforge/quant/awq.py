"""AWQ (Lin et al. 2024): activation-aware per-input-channel scaling before INT4 group RTN.

Input channels that see large activations matter more to the output than their weights'
magnitude says. Scaling those weight columns up by s (and the activation down by s) gives them
finer INT4 steps in their group at the expense of quiet channels:

    y = x W^T = (x / s) (W * s)^T,    s_j = mean_t |x[t, j]| ^ ratio, normalised so that
                                      sqrt(max(s) * min(s)) = 1

For each linear, ``ratio`` is grid-searched in [0, 1) (``grid`` points) to minimise the mean
squared output error of Q(W * s) on the layer's calibration inputs, Q = asymmetric INT4 group
RTN. ratio = 0 is s = 1, plain RTN, so the search can only match or beat RTN on those inputs.

Q is exactly the ``int4`` method's quantizer (packing.py), and that method stores and multiplies
Q(W * s) with the packed ``torch._weight_int4pack_mm_for_cpu`` kernel. The division by s stays in the layer at run time
(``awq_inv_scale``), for the same reasons as SmoothQuant's (see smoothquant.py).
"""
from __future__ import annotations

import torch
from torch import nn

from kvforge.quant import packing
from kvforge.quant.base import is_lm_head, register_quantization
from kvforge.quant.calibration import CalibratedLinearMethod, CalibratedQuantConfig
from kvforge.quant.int4 import Int4LinearMethod
from kvforge.quant.w8a8_ops import float_weight, take_float_weight


def int4_fake_quantize(weight: torch.Tensor, group_size: int) -> torch.Tensor:
    """W [out, in] -> what part A's INT4 group RTN (packing.py, the kernel's number format)
    turns it into, as float32."""
    codes, scale, zero = packing.quantize_int4_groupwise(weight, group_size)
    return packing.dequantize_int4(codes, scale, zero, weight.shape[1])


def search_awq_scales(weight: torch.Tensor, x: torch.Tensor, act_abs_mean: torch.Tensor,
                      group_size: int, grid: int = 20) -> tuple[torch.Tensor, float, float]:
    """Best s for W [out, in] on inputs x [N, in] -> (s [in], best ratio, its output MSE)."""
    w, x = weight.float(), x.float()
    reference = x @ w.t()
    mean = act_abs_mean.float().clamp_min(1e-4)
    best = (torch.ones_like(mean), 0.0, float("inf"))
    for i in range(grid):
        ratio = i / grid
        s = mean.pow(ratio)
        s = s / (s.max() * s.min()).sqrt()
        err = ((x / s) @ int4_fake_quantize(w * s, group_size).t() - reference).pow(2).mean()
        if float(err) < best[2]:
            best = (s, ratio, float(err))
    return best


class AWQLinearMethod(CalibratedLinearMethod):
    def compute_scales(self, layer):
        x = torch.cat(self.samples)
        s, self.ratio, self.search_mse = search_awq_scales(
            float_weight(layer), x, self.abs_sum / self.num_rows, self.config.group_size,
            self.config.grid)
        return s

    def quantize(self, layer, scales):
        bias = layer.bias.detach().clone() if layer.has_bias else None
        weight = take_float_weight(layer)
        dtype = weight.dtype
        scaled = weight.float() * scales[None, :]                       # W * s, [out, in]
        # part A's INT4 method stores and multiplies Q(W * s) (packed kernel, never dequantized)
        self.inner = Int4LinearMethod(self.config.group_size)
        self.inner.create_weights(layer, dtype, scaled.device)
        if bias is not None:
            self.inner.load_weight(layer, "bias", bias, 0)
        self.inner.load_weight(layer, "weight", scaled, 0)
        self.inner.process_weights_after_loading(layer)
        layer.awq_inv_scale = nn.Parameter(1.0 / scales, requires_grad=False)

    def apply_quantized(self, layer, x):
        x2d = x.reshape(-1, layer.input_size) * layer.awq_inv_scale.to(x.dtype)
        return self.inner.apply(layer, x2d).view(*x.shape[:-1], layer.output_size)


@register_quantization("awq")
class AWQConfig(CalibratedQuantConfig):
    """``group_size``: input channels per INT4 scale/zero; ``grid``: ratios tried in [0, 1);
    ``max_samples``: calibration input rows kept per layer for the search. LM head stays float."""

    def __init__(self, group_size: int = 64, grid: int = 20, max_samples: int = 256) -> None:
        super().__init__()
        if group_size not in packing.INT4_GROUP_SIZES:
            raise ValueError(f"awq group_size must be 32, 64 or 128, got {group_size!r}")
        if grid < 1 or max_samples < 1:
            raise ValueError(f"awq grid and max_samples must be >= 1, got {grid}, {max_samples}")
        self.group_size, self.grid, self.max_samples = group_size, grid, max_samples

    def get_linear_method(self, prefix: str):
        if is_lm_head(prefix):
            return None
        return self.register_method(AWQLinearMethod(self, prefix, self.max_samples))
