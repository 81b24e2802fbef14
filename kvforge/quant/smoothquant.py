"""SmoothQuant W8A8 (Xiao et al. 2023): move activation outliers into the weights, then
int8 x int8.

Per input channel j, from calibration: a_j = max_t |x[t, j]|, w_j = max_o |W[o, j]|,

    s_j = a_j^alpha / w_j^(1 - alpha)          (alpha = 0.5 splits the difficulty evenly)
    y = x W^T = (x / s) (W * s)^T               exact in real arithmetic

x / s has its outlier channels shrunk (easy per-token int8), W * s has them grown (per-output-
channel int8 copes: the growth is spread over every output row). Then W * s is quantized per
output channel and x / s per token at run time ("dynamic"), multiplied by ``torch._int_mm``.

Where the division by s happens: the paper folds 1/s into the preceding RMSNorm's weight. Here it
stays in the layer (``smooth_inv_scale`` [in], one multiply on the activation per call), because
o_proj and down_proj have no norm before them, a fused qkv/gate_up would need every consumer of
the norm to agree on one s, and keeping it in the layer makes each layer self-contained (swap,
save and test one linear at a time). Cost: one [T, in] elementwise multiply per linear.
"""
from __future__ import annotations

import torch
from torch import nn

from kvforge.quant.base import is_lm_head, register_quantization
from kvforge.quant.calibration import CalibratedLinearMethod, CalibratedQuantConfig
from kvforge.quant.int8 import Int8Rows
from kvforge.quant.w8a8_ops import (float_weight, int8_matmul, quantize_per_token,
                                    quantize_weight_per_channel)


def smoothing_scales(act_abs_max: torch.Tensor, weight_abs_max: torch.Tensor,
                     alpha: float) -> torch.Tensor:
    """s = a^alpha / w^(1 - alpha), 1 for channels with no activation or no weight."""
    a, w = act_abs_max.float(), weight_abs_max.float()
    s = a.clamp_min(1e-5).pow(alpha) / w.clamp_min(1e-5).pow(1 - alpha)
    s = torch.where((a > 0) & (w > 0), s, torch.ones_like(s))
    return s.clamp(1e-4, 1e4)


class SmoothQuantLinearMethod(CalibratedLinearMethod):
    """Storage: ``qweight_t`` [in, out] int8 and ``weight_scale`` [out] fp32 (W * s per output
    channel, w8a8_ops' layout) and ``smooth_inv_scale`` [in] = 1 / s."""

    def compute_state(self, layer):
        weight_abs_max = float_weight(layer).abs().amax(dim=0)      # W [out, in] -> [in]
        return {"scales": smoothing_scales(self.abs_max, weight_abs_max, self.config.alpha)}

    def quantized_rows(self, weight, state):
        qweight_t, w_scale = quantize_weight_per_channel(weight.float() * state["scales"][None, :])
        return Int8Rows(qweight_t.t(), w_scale)

    def install(self, layer, scales, dtype):
        n, k = layer.output_size, layer.input_size
        layer.qweight_t = nn.Parameter(torch.zeros(k, n, dtype=torch.int8, device=scales.device),
                                       requires_grad=False)
        layer.weight_scale = nn.Parameter(torch.zeros(n, device=scales.device),
                                          requires_grad=False)
        layer.smooth_inv_scale = nn.Parameter(1.0 / scales, requires_grad=False)

    def load_rows(self, layer, rows, output_offset):
        if not isinstance(rows, Int8Rows) or rows.shape[1] != layer.input_size:
            raise ValueError(f"smoothquant layer {self.prefix!r} takes int8 rows with "
                             f"{layer.input_size} columns, got {type(rows).__name__} "
                             f"{tuple(rows.shape)}")
        r = slice(output_offset, output_offset + rows.shape[0])
        layer.qweight_t[:, r] = rows.q.t()
        layer.weight_scale[r] = rows.scale.float()

    def export_rows(self, layer):
        return Int8Rows(layer.qweight_t.detach().t(), layer.weight_scale.detach())

    def apply_quantized(self, layer, x):
        x2d = x.reshape(-1, layer.input_size).float() * layer.smooth_inv_scale
        xq, x_scale = quantize_per_token(x2d)
        y = int8_matmul(xq, x_scale, layer.qweight_t, layer.weight_scale)
        if layer.has_bias:
            y.add_(layer.bias.float())
        return y.to(x.dtype).view(*x.shape[:-1], layer.output_size)


@register_quantization("smoothquant")
class SmoothQuantConfig(CalibratedQuantConfig):
    """``alpha`` in [0, 1]: how much of the activation range moves into the weights. The LM head
    stays in float."""

    def __init__(self, alpha: float = 0.5) -> None:
        super().__init__()
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"smoothquant alpha must be in [0, 1], got {alpha!r}")
        self.alpha = float(alpha)

    def get_linear_method(self, prefix: str):
        if is_lm_head(prefix):
            return None
        return self.register_method(SmoothQuantLinearMethod(self, prefix))

    def describe(self) -> dict:
        return {"alpha": self.alpha}
