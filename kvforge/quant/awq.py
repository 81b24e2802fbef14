"""AWQ (Lin et al. 2024): activation-aware per-input-channel scaling and clipping, then INT4
group RTN.

Input channels that see large activations matter more to the output than their weights'
magnitude says. Scaling those weight columns up by s (and the activation down by s) gives them
finer INT4 steps in their group at the expense of quiet channels:

    y = x W^T = (x / s) (W * s)^T,    s_j = mean_t |x[t, j]| ^ ratio, normalised so that
                                      sqrt(max(s) * min(s)) = 1

Search, per linear layer, on a uniform sample of its calibration inputs x (Q = INT4 group RTN of
packing.py, the exact quantizer of the ``int4`` method; err = mean ((x/s) Q(W s)^T - x W^T)^2):

  1. scales: ``grid`` ratios in [0, 1); ratio 0 is s = 1, i.e. plain RTN.
  2. clipping (the paper's second step, AutoAWQ's ``auto_clip``): for ratio 0 and the
     ``clip_candidates`` best ratios, each group (row n, input group g) of W s gets its range
     clamped to [-a, a], a = max|w_group| * (1 - i / clip_grid), i < max_shrink * clip_grid;
     the i that minimises that group's own output error d^T H_g d is kept, where
     d = Q(w) - w on the group and H_g = X_g^T X_g (Gram matrix of the group's input columns
     of x / s, so every row of x is weighed without a matmul per row).
  3. the candidate (ratio, clipped or not) with the lowest err wins.

(ratio 0, not clipped) is plain RTN and always a candidate, so on the sampled calibration rows
AWQ's output error is never above RTN's at the same group size.

Storage and kernel: ``Int4LinearMethod`` (packed ``torch._weight_int4pack_mm_for_cpu``) holds
Q(W * s) with the chosen ranges. The division by s stays in the layer at run time
(``awq_inv_scale``, skipped when the search chose s = 1), for the same reasons as SmoothQuant's
(see smoothquant.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kvforge.quant import packing
from kvforge.quant.base import is_lm_head, register_quantization
from kvforge.quant.calibration import CalibratedLinearMethod, CalibratedQuantConfig
from kvforge.quant.int4 import Int4Blocks, Int4LinearMethod
from kvforge.quant.int8 import lm_head_method
from kvforge.quant.w8a8_ops import float_weight


def int4_fake_quantize(weight: torch.Tensor, group_size: int,
                       group_range: tuple[torch.Tensor, torch.Tensor] | None = None
                       ) -> torch.Tensor:
    """W [out, in] -> what INT4 group RTN (packing.py, the kernel's number format) turns it
    into, as float32; ``group_range`` = per-group (lo, hi) to quantize instead of (min, max)."""
    codes, scale, zero = packing.quantize_int4_groupwise(weight, group_size, group_range)
    return packing.dequantize_int4(codes, scale, zero, weight.shape[1])


def awq_scales(act_abs_mean: torch.Tensor, ratio: float) -> torch.Tensor:
    s = act_abs_mean.float().clamp_min(1e-4).pow(ratio)
    return s / (s.max() * s.min()).sqrt()


def search_clip(weight: torch.Tensor, x: torch.Tensor, group_size: int, grid: int = 20,
                max_shrink: float = 0.5) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group quantization ranges (lo, hi) [out, Kp/G] for W [out, in] on inputs x [T, in].

    Groups of one row never share an output error term with other rows, and the cross terms
    between groups of a row are ignored (as in AutoAWQ), so each (row, group) picks its range
    alone: error(d) = d^T H_g d with H_g = X_g^T X_g, d the group's rounding error."""
    g = packing.int4_groups(weight, group_size)                       # [N, ng, G]
    n, ng, gs = g.shape
    # padded input columns are zero: the weights padded there add no error
    xg = F.pad(x.float(), (0, ng * gs - x.shape[1])).view(-1, ng, gs).transpose(0, 1)
    gram = xg.transpose(1, 2) @ xg                                    # [ng, G, G]
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    amax = torch.maximum(lo.abs(), hi.abs())
    best_lo, best_hi = lo, hi
    best_err = torch.full_like(lo, float("inf"))
    for i in range(max(1, int(max_shrink * grid))):                   # i = 0: range unchanged
        a = amax * (1 - i / grid)
        c_lo = torch.minimum(torch.maximum(lo, -a), a)                # clamp(w, -a, a)'s range
        c_hi = torch.minimum(torch.maximum(hi, -a), a)
        codes, scale, zero = packing.quantize_int4_groupwise(weight, group_size, (c_lo, c_hi))
        d = (packing.dequantize_int4(codes, scale, zero).view(n, ng, gs) - g).transpose(0, 1)
        err = ((d @ gram) * d).sum(dim=-1).t().contiguous()           # [N, ng]
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_lo, best_hi = torch.where(better, c_lo, best_lo), torch.where(better, c_hi, best_hi)
    return best_lo, best_hi


@dataclass
class AWQSearch:
    scales: torch.Tensor          # s [in]
    clip_lo: torch.Tensor         # quantization range of W * s per (row, group) [out, Kp/G]
    clip_hi: torch.Tensor
    ratio: float
    clipped: bool
    mse: float                    # output MSE of the choice on the sampled inputs
    rtn_mse: float                # ... and of plain RTN (ratio 0, unclipped)


def search_awq(weight: torch.Tensor, x: torch.Tensor, act_abs_mean: torch.Tensor,
               group_size: int, grid: int = 20, max_shrink: float = 0.5, clip_grid: int = 20,
               clip_candidates: int = 3) -> AWQSearch:
    """Scales then clipping for W [out, in] on inputs x [T, in] (see the module docstring)."""
    w, x = weight.float(), x.float()
    reference = x @ w.t()

    def mse(s, group_range=None) -> float:
        out = (x / s) @ int4_fake_quantize(w * s, group_size, group_range).t()
        return float((out - reference).pow(2).mean())

    by_ratio = sorted((mse(awq_scales(act_abs_mean, i / grid)), i / grid) for i in range(grid))
    rtn_mse = next(e for e, r in by_ratio if r == 0.0)
    best = (rtn_mse, 0.0, None)                                       # (err, ratio, range)
    if max_shrink > 0:
        for ratio in sorted({0.0} | {r for _, r in by_ratio[:clip_candidates]}):
            s = awq_scales(act_abs_mean, ratio)
            group_range = search_clip(w * s, x / s, group_size, clip_grid, max_shrink)
            best = min(best, (mse(s, group_range), ratio, group_range), key=lambda c: c[0])
    best = min(best, (by_ratio[0][0], by_ratio[0][1], None), key=lambda c: c[0])
    err, ratio, group_range = best
    s = awq_scales(act_abs_mean, ratio)
    clipped = group_range is not None
    if not clipped:
        group_range = packing.int4_group_range(w * s, group_size)
    return AWQSearch(s, group_range[0], group_range[1], ratio, clipped, err, rtn_mse)


class AWQLinearMethod(CalibratedLinearMethod):
    """State: ``scales`` s [in], ``clip_lo`` / ``clip_hi`` [out, Kp/G]; storage: the inner
    ``Int4LinearMethod``'s packed Q(W * s) plus ``awq_inv_scale`` [in] = 1 / s."""

    inner: Int4LinearMethod | None = None
    search: AWQSearch | None = None

    def compute_state(self, layer):
        c = self.config
        self.search = search_awq(float_weight(layer), self.samples, self.abs_sum / self.num_rows,
                                 c.group_size, c.grid, c.max_shrink, c.clip_grid,
                                 c.clip_candidates)
        return {"scales": self.search.scales, "clip_lo": self.search.clip_lo,
                "clip_hi": self.search.clip_hi}

    def quantized_rows(self, weight, state):
        scaled = weight.float() * state["scales"][None, :]                 # W * s, [out, in]
        group_range = (state["clip_lo"], state["clip_hi"]) if "clip_lo" in state else None
        codes, scale, zero = packing.quantize_int4_groupwise(scaled, self.config.group_size,
                                                             group_range)
        return Int4Blocks(codes, scale, zero, weight.shape[1])

    def install(self, layer, scales, dtype):
        self.inner = Int4LinearMethod(self.config.group_size)
        self.inner.create_weights(layer, dtype, scales.device)
        layer.awq_inv_scale = nn.Parameter(1.0 / scales, requires_grad=False)
        self.identity_scale = bool((scales == 1).all())

    def load_rows(self, layer, rows, output_offset):
        if not isinstance(rows, Int4Blocks):
            raise ValueError(f"awq layer {self.prefix!r} takes Int4Blocks, got "
                             f"{type(rows).__name__}")
        self.inner.load_weight(layer, "weight", rows, output_offset)

    def export_rows(self, layer):
        return self.inner.export_blocks(layer)

    def process_weights_after_loading(self, layer):
        super().process_weights_after_loading(layer)
        if self.inner is not None:
            self.inner.process_weights_after_loading(layer)     # raises if rows are missing

    def apply_quantized(self, layer, x):
        x2d = x.reshape(-1, layer.input_size)
        if not self.identity_scale:
            x2d = x2d * layer.awq_inv_scale.to(x.dtype)
        return self.inner.apply(layer, x2d).view(*x.shape[:-1], layer.output_size)


@register_quantization("awq")
class AWQConfig(CalibratedQuantConfig):
    """``group_size``: input channels per INT4 scale/zero (32, 64, 128; K is padded to whole
    groups); ``grid``: scale ratios tried in [0, 1); ``max_shrink`` (0 disables clipping),
    ``clip_grid``, ``clip_candidates``: the clipping search; ``max_samples``: calibration input
    rows kept per layer (uniform sample); ``lm_head``: "int8" (default, as ``int4``) or "none"."""

    def __init__(self, group_size: int = 64, grid: int = 20, max_samples: int = 256,
                 max_shrink: float = 0.5, clip_grid: int = 20, clip_candidates: int = 3,
                 lm_head: str = "int8") -> None:
        super().__init__()
        if group_size not in packing.INT4_GROUP_SIZES:
            raise ValueError(f"awq group_size must be one of {packing.INT4_GROUP_SIZES}, "
                             f"got {group_size!r}")
        if grid < 1 or max_samples < 1 or clip_grid < 1 or clip_candidates < 0:
            raise ValueError(f"awq needs grid, max_samples, clip_grid >= 1 and clip_candidates "
                             f">= 0, got {grid}, {max_samples}, {clip_grid}, {clip_candidates}")
        if not 0.0 <= max_shrink < 1.0:
            raise ValueError(f"awq max_shrink must be in [0, 1), got {max_shrink!r}")
        lm_head_method(lm_head, "lm_head")                      # validates the choice
        self.group_size, self.grid, self.max_samples = group_size, grid, max_samples
        self.max_shrink, self.clip_grid = max_shrink, clip_grid
        self.clip_candidates = clip_candidates
        self.lm_head = lm_head

    def get_linear_method(self, prefix: str):
        if is_lm_head(prefix):
            return lm_head_method(self.lm_head, prefix)
        return self.register_method(AWQLinearMethod(self, prefix, self.max_samples))

    def describe(self) -> dict:
        return {"group_size": self.group_size, "grid": self.grid, "max_samples": self.max_samples,
                "max_shrink": self.max_shrink, "clip_grid": self.clip_grid,
                "clip_candidates": self.clip_candidates, "lm_head": self.lm_head}
