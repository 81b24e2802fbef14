"""ZeroQuant W8A8 (Yao et al. 2022; fine-grained activations as in ZeroQuant-V2):
``--quantization zeroquant``.

Weights: INT8, symmetric, one scale per row per group of G input channels (``group_size``; 0 =
one group spanning the row, i.e. per output channel):

    W[o, k] ~= Wq[o, k] * w_scale[o, k // G]

Activations: INT8, symmetric, quantized at run time ("dynamic") per token -- per token and per
group of G channels with ``act_groups`` (the default): an outlier channel then coarsens only its
own group's steps, not the whole token's. Integer matmul per group, exact int32 sums, rescaled
and summed in fp32 -- on CPU in one call of the compiled kernel (kernels/csrc/w8a8_gemm.cpp,
``KVFORGE_INT8_DOT`` picks VNNI or AVX2's maddubs), else per group in PyTorch
(``group_int_matmul``: ``torch._int_mm`` where it is fast, else an exact fp32 GEMM of the int8
values); the same int32 sums either way:

    y[t, o] = sum_g x_scale[t, g] * w_scale[o, g] * sum_{k in g} xq[t, k] Wq[o, k]

(without ``act_groups`` x_scale[t] factors out of the sum). K is padded with zero columns to
whole groups. The LM head stays float (its logits decide every token), as in smoothquant.

LKD (``lkd_steps`` > 0): layer-wise knowledge distillation (lkd.py) of every quantized linear to
its own float output on calibration text (quant/data/calibration.txt), before its codes are
chosen; the distilled codes are what a save writes, so a reload does not distil again.
LoRC (``lorc_rank``) adds a low-rank correction (lowrank.py); it is computed from the float
weight at load, so it does not combine with LKD (which chooses the codes later).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kvforge.kernels import ops
from kvforge.layers.linear import LinearMethod
from kvforge.quant import packing
from kvforge.quant.base import is_lm_head, register_quantization, weight_shard_rows
from kvforge.quant.calibration import CalibratedLinearMethod, CalibratedQuantConfig
from kvforge.quant.lowrank import LoRCConfigMixin
from kvforge.quant.row_formats import register_row_format
from kvforge.quant.w8a8_ops import INT8_MAX, exact_float_matmul, int_mm, int_mm_pays

ZEROQUANT_GROUP_SIZES = (0, 32, 64, 128, 256)


def group_int_matmul(xq: torch.Tensor, wq: torch.Tensor) -> torch.Tensor:
    """Per-group integer products: xq [ng, T, G] int8, wq [ng, G, n] int8 -> [ng, T, n] fp32
    holding the exact int32 sums. ``torch._int_mm`` where it is exact and faster than fp32 on
    this CPU (``int_mm_pays``), else an fp32 batched GEMM of the int8 values in exact slabs
    (``exact_float_matmul``): the same numbers either way. Off the CPU: the fp32 GEMM (the
    one-off CPU timing says nothing about that device)."""
    if xq.is_cpu and int_mm_pays():
        return torch.stack([int_mm(xq[g], wq[g]) for g in range(xq.shape[0])]).float()
    return exact_float_matmul(xq, wq).float()


def group_width(group_size: int, in_features: int) -> int:
    """Input channels per group: ``group_size``, or the whole row for 0."""
    return in_features if group_size == 0 else group_size


def _grouped(x: torch.Tensor, width: int) -> torch.Tensor:
    """[..., K] -> [..., Kp/G, G] float32, K padded with zeros to whole groups."""
    k = x.shape[-1]
    kp = packing.padded_in_features(k, width)
    return F.pad(x.float(), (0, kp - k)).view(*x.shape[:-1], kp // width, width)


def quantize_int8_groups(x: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [m, K] -> (q [m, Kp/G, G] int8, scale [m, Kp/G] fp32): symmetric, max|x| -> 127 per
    (row, group); an all-zero group gets scale 1e-12 and codes 0."""
    g = _grouped(x, width)
    scale = g.abs().amax(dim=-1).clamp_min(1e-12) / INT8_MAX
    q = torch.round(g / scale[..., None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def fake_quantize_activations(x: torch.Tensor, width: int, act_groups: bool) -> torch.Tensor:
    """What the kernel's activation rounding turns x [T, K] into, float [T, K] (LKD's input)."""
    if act_groups:
        q, s = quantize_int8_groups(x, width)
        return (q.float() * s[..., None]).flatten(-2)[..., :x.shape[-1]]
    s = x.float().abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / INT8_MAX
    return torch.round(x.float() / s).clamp_(-INT8_MAX, INT8_MAX) * s


@dataclass
class Int8GroupRows:
    """Rows of a ZeroQuant weight: q [n, Kp] int8, scale [n, Kp/G] fp32, logical K."""
    q: torch.Tensor
    scale: torch.Tensor
    in_features: int

    @property
    def shape(self) -> tuple[int, int]:
        return (self.q.shape[0], self.in_features)

    def dequantize(self) -> torch.Tensor:
        n, kp = self.q.shape
        groups = self.scale.shape[1]
        w = self.q.float().view(n, groups, kp // groups) * self.scale.float()[..., None]
        return w.view(n, kp)[:, :self.in_features]

    def saved_tensors(self, name: str, rows: slice) -> dict[str, torch.Tensor]:
        return {f"{name}.zq_qweight": self.q[rows], f"{name}.zq_scales": self.scale[rows],
                f"{name}.zq_in_features": torch.tensor([self.in_features], dtype=torch.int64)}


register_row_format("zq_qweight", ("zq_scales", "zq_in_features"),
                    lambda get, stem: Int8GroupRows(get(f"{stem}.zq_qweight"),
                                                    get(f"{stem}.zq_scales"),
                                                    int(get(f"{stem}.zq_in_features")[0])))


class ZeroQuantLinearMethod(LinearMethod):
    """Storage, in one of two layouts (one copy of the codes either way):

    groups (as loaded; the PyTorch path): ``qweight_g`` [Kp/G, G, n] int8 (each group's [G, n]
        slab contiguous: the right operand of ``torch._int_mm``), ``weight_scale_g`` [Kp/G, n]
        fp32;
    panels (the compiled kernel's, kernels/csrc/w8a8_gemm.cpp): ``w8a8_codes`` [panels, Kp/4,
        8, 4] int8, ``w8a8_scales`` [panels, Kp/G, 8] fp32, ``w8a8_code_sums`` alike int32
        (kernels/ops.py pack_w8a8_panels).

    A CPU layer moves to panels at its first forward where the kernel applies
    (``ops.w8a8_kernel_applies``) and back to groups when it is loaded again. ``use_kernel =
    False`` keeps the PyTorch path (the reference tests and benchmarks compare with)."""

    use_kernel = True

    def __init__(self, group_size: int = 128, act_groups: bool = True) -> None:
        self.group_size, self.act_groups = group_size, act_groups
        self._kernel = None             # (compiled projection, int8 dot) while in panels

    def create_weights(self, layer, dtype, device):
        self._group_parameters(layer, device)
        if layer.has_bias:
            layer.bias = nn.Parameter(torch.zeros(layer.output_size, dtype=dtype, device=device),
                                      requires_grad=False)

    def _group_parameters(self, layer, device):
        n, k = layer.output_size, layer.input_size
        width = group_width(self.group_size, k)
        groups = packing.padded_in_features(k, width) // width
        layer.qweight_g = nn.Parameter(torch.zeros(groups, width, n, dtype=torch.int8,
                                                   device=device), requires_grad=False)
        layer.weight_scale_g = nn.Parameter(torch.zeros(groups, n, device=device),
                                            requires_grad=False)

    def to_rows(self, weight: torch.Tensor) -> Int8GroupRows:
        q, scale = quantize_int8_groups(weight, group_width(self.group_size, weight.shape[1]))
        return Int8GroupRows(q.flatten(-2), scale, weight.shape[1])

    def load_weight(self, layer, kind, loaded, output_offset):
        if self._kernel is not None:            # weights or bias change: back to groups
            self._to_groups(layer)
        rows = weight_shard_rows(layer, kind, loaded, output_offset)
        if rows is None:
            return
        saved = loaded if isinstance(loaded, Int8GroupRows) else self.to_rows(loaded)
        self._write_rows(layer, saved, rows)

    def _write_rows(self, layer, saved: Int8GroupRows, rows: slice) -> None:
        groups, width, _ = layer.qweight_g.shape
        if tuple(saved.scale.shape) != (saved.shape[0], groups):
            raise ValueError(f"zeroquant rows with {saved.scale.shape[1]} groups do not fit a "
                             f"layer of {groups} groups (group_size {self.group_size})")
        layer.qweight_g[:, :, rows] = saved.q.view(-1, groups, width).permute(1, 2, 0)
        layer.weight_scale_g[:, rows] = saved.scale.float().t()

    def _to_panels(self, layer) -> None:
        dot = ops.int8_dot()                    # first: a bad KVFORGE_INT8_DOT changes nothing
        rows = self.export_rows(layer)
        codes, scales, sums = ops.pack_w8a8_panels(rows.q, rows.scale)
        projection = ops.w8a8_projection(codes, scales, sums, layer.output_size,
                                         layer.input_size, layer.bias if layer.has_bias else None)
        del layer.qweight_g, layer.weight_scale_g
        layer.w8a8_codes = nn.Parameter(codes, requires_grad=False)
        layer.w8a8_scales = nn.Parameter(scales, requires_grad=False)
        layer.w8a8_code_sums = nn.Parameter(sums, requires_grad=False)
        self._kernel = (projection, dot)

    def _to_groups(self, layer) -> None:
        rows = self.export_rows(layer)
        device = layer.w8a8_codes.device
        del layer.w8a8_codes, layer.w8a8_scales, layer.w8a8_code_sums
        self._kernel = None
        self._group_parameters(layer, device)
        self._write_rows(layer, rows, slice(0, layer.output_size))

    def apply(self, layer, x):
        x2d = x.reshape(-1, layer.input_size)
        if self._kernel is None and self.use_kernel and x.is_cpu and ops.w8a8_kernel_applies(
                layer.qweight_g.device, layer.qweight_g.shape[1]):
            self._to_panels(layer)
        if self._kernel is not None:
            projection, dot = self._kernel
            y = projection.forward(x2d.float(), self.act_groups, dot)
            return y.to(x.dtype).view(*x.shape[:-1], layer.output_size)
        groups, width, n = layer.qweight_g.shape
        if self.act_groups:
            xq, x_scale = quantize_int8_groups(x2d, width)            # [T, ng, G], [T, ng]
        else:
            x_scale = x2d.float().abs().amax(dim=1).clamp_min(1e-12) / INT8_MAX
            xq = torch.round(_grouped(x2d, width) / x_scale[:, None, None]).clamp_(
                -INT8_MAX, INT8_MAX).to(torch.int8)
        acc = group_int_matmul(xq.transpose(0, 1).contiguous(), layer.qweight_g)   # [ng, T, n]
        acc.mul_(layer.weight_scale_g[:, None, :])
        if self.act_groups:
            acc.mul_(x_scale.t()[:, :, None])
        y = acc.sum(dim=0)
        if not self.act_groups:
            y.mul_(x_scale[:, None])
        if layer.has_bias:
            y += layer.bias.float()
        return y.to(x.dtype).view(*x.shape[:-1], n)

    def export_rows(self, layer) -> Int8GroupRows:
        if self._kernel is not None:
            q, scale = ops.unpack_w8a8_panels(layer.w8a8_codes, layer.w8a8_scales,
                                              layer.output_size)
            return Int8GroupRows(q, scale, layer.input_size)
        groups, width, n = layer.qweight_g.shape
        q = layer.qweight_g.permute(2, 0, 1).reshape(n, groups * width)
        return Int8GroupRows(q.contiguous(), layer.weight_scale_g.t().contiguous(),
                             layer.input_size)

    def dequantize(self, layer) -> torch.Tensor:
        return self.export_rows(layer).dequantize()


class ZeroQuantLKDMethod(CalibratedLinearMethod):
    """Float until calibrated: records a sample of its inputs, then distils (lkd.py) and
    quantizes. The calibrated-method state is s = 1 (no input scaling)."""

    inner: ZeroQuantLinearMethod | None = None

    def compute_state(self, layer):
        return {"scales": torch.ones(layer.input_size)}

    def quantized_rows(self, weight, state):
        from kvforge.quant.lkd import distil_weight
        c = self.config
        width = group_width(c.group_size, weight.shape[1])
        quantizer = ZeroQuantLinearMethod(c.group_size, c.act_groups)
        if self.samples is not None:
            weight = distil_weight(
                weight, self.samples,
                fake_quant_weight=lambda w: quantizer.to_rows(w).dequantize(),
                fake_quant_input=lambda x: fake_quantize_activations(x, width, c.act_groups),
                steps=c.lkd_steps, lr=c.lkd_lr).weight
        return quantizer.to_rows(weight)

    def install(self, layer, scales, dtype):
        if not bool((scales == 1).all()):
            raise ValueError(f"zeroquant layer {self.prefix!r} got input scales other than 1")
        self.inner = ZeroQuantLinearMethod(self.config.group_size, self.config.act_groups)
        self.inner.create_weights(layer, dtype, scales.device)

    def load_rows(self, layer, rows, output_offset):
        if not isinstance(rows, Int8GroupRows):
            raise ValueError(f"zeroquant layer {self.prefix!r} takes Int8GroupRows, got "
                             f"{type(rows).__name__}")
        self.inner.load_weight(layer, "weight", rows, output_offset)

    def export_rows(self, layer):
        return self.inner.export_rows(layer)

    def dequantize(self, layer) -> torch.Tensor:
        return self.inner.dequantize(layer)

    def apply_quantized(self, layer, x):
        return self.inner.apply(layer, x)


@register_quantization("zeroquant")
class ZeroQuantConfig(LoRCConfigMixin, CalibratedQuantConfig):
    """``group_size``: input channels per weight scale (32, 64, 128, 256; 0 = per output
    channel); ``act_groups``: 1 quantizes activations per token and group, 0 per token;
    ``lkd_steps`` (0 = no distillation, no calibration), ``lkd_samples`` (input rows kept per
    layer), ``lkd_lr`` (Adam step, in units of the layer's mean quantization step);
    ``lorc_rank`` (0 = off; not with LKD), ``lorc_act`` (1: activation-aware factors)."""

    def __init__(self, group_size: int = 128, act_groups: int = 1, lkd_steps: int = 0,
                 lkd_samples: int = 256, lkd_lr: float = 0.2, lorc_rank: int = 0,
                 lorc_act: int = 0) -> None:
        super().__init__()
        if group_size not in ZEROQUANT_GROUP_SIZES:
            raise ValueError(f"zeroquant group_size must be one of {ZEROQUANT_GROUP_SIZES}, "
                             f"got {group_size!r}")
        if act_groups not in (0, 1, True, False):
            raise ValueError(f"zeroquant act_groups must be 0 or 1, got {act_groups!r}")
        for name, value in (("lkd_steps", lkd_steps), ("lkd_samples", lkd_samples)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"zeroquant {name} must be an integer >= 0, got {value!r}")
        if lkd_steps and lkd_samples < 1:
            raise ValueError(f"zeroquant lkd_samples must be >= 1 with LKD, got {lkd_samples!r}")
        if not lkd_lr > 0:
            raise ValueError(f"zeroquant lkd_lr must be > 0, got {lkd_lr!r}")
        self.init_lorc(lorc_rank, lorc_act)
        if lkd_steps and self.lorc_rank:
            raise ValueError(f"zeroquant lorc_rank={lorc_rank} cannot be combined with "
                             f"lkd_steps={lkd_steps} (LoRC factors the float weight's error at "
                             f"load; LKD chooses the codes later)")
        ops.int8_dot_setting()               # a bad KVFORGE_INT8_DOT fails here, not mid-step
        self.group_size, self.act_groups = group_size, bool(act_groups)
        self.lkd_steps, self.lkd_samples, self.lkd_lr = lkd_steps, lkd_samples, float(lkd_lr)
        self.needs_calibration = lkd_steps > 0 or self.lorc_act

    def calibrate(self, model, batches) -> None:
        if self.lorc_act:
            LoRCConfigMixin.calibrate(self, model, batches)
        else:
            CalibratedQuantConfig.calibrate(self, model, batches)

    def pending_layers(self) -> list[str]:
        return LoRCConfigMixin.pending_layers(self) + CalibratedQuantConfig.pending_layers(self)

    def get_linear_method(self, prefix: str):
        if is_lm_head(prefix):
            return None
        if self.lkd_steps:
            return self.register_method(ZeroQuantLKDMethod(self, prefix, self.lkd_samples))
        return self.lorc(ZeroQuantLinearMethod(self.group_size, self.act_groups), prefix)

    def describe(self) -> dict:
        return {"group_size": self.group_size, "act_groups": int(self.act_groups),
                "lkd_steps": self.lkd_steps, "lkd_samples": self.lkd_samples,
                "lkd_lr": self.lkd_lr, **self.lorc_args()}
