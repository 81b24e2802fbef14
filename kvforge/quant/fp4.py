"""FP4 (E2M1) weights with group scales (``--quantization fp4``; ZeroQuant-FP, LLM-FP4's weights).

E2M1 is a 4-bit float: sign, 2 exponent bits, 1 mantissa bit. Its 16 codes (code = sign << 3 |
magnitude index) stand for

    +-{0, 0.5, 1, 1.5, 2, 3, 4, 6}          (the OCP MX FP4 element)

Per group of G input channels of a row, ``W ~= scale * E2M1[code]``, scale = max|w| / 6 by
default. The grid is denser near zero, where most weights of a group lie, and coarser at the
edge than INT4's uniform 15 steps. ``scale_search`` > 1 tries that many scales between 0.7x and
1x the max-based one per group and keeps the one of least squared error (clipping the few
largest weights buys finer steps for the rest). Scales are bf16 and codes are chosen after the
rounding, so the search measures the parameters that actually run.

Storage: codes nibble-packed like INT4's portable form (``fp4_packed`` [n, Kp/2] uint8, even
column in the low nibble) and ``fp4_scales`` [n, Kp/G] bf16: 4 + 16/G bits per weight
(``asymmetric``: + ``fp4_offsets`` [n, Kp/G] bf16, the same 4 + 32/G bits as INT4).
Forward (CPU, pure torch): a 256-entry table maps each packed byte to its two E2M1 values (the
16-entry table squared), so one gather decodes two weights; a tile of ``tile_rows`` output rows
is decoded, scaled and multiplied at a time (bounded temporary memory, nothing cached between
calls). Like fp8 this is a storage format on CPU: every call decodes every weight.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kvforge.layers.linear import LinearMethod
from kvforge.quant import packing
from kvforge.quant.base import (QuantizationConfig, is_lm_head, register_quantization,
                                weight_shard_rows)
from kvforge.quant.int8 import lm_head_method
from kvforge.quant.lowrank import LoRCConfigMixin
from kvforge.quant.row_formats import GroupedCodeRows, register_row_format

E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0
FP4_TABLE = torch.tensor(E2M1_MAGNITUDES + tuple(-m for m in E2M1_MAGNITUDES))   # code -> value
# byte b = lo | hi << 4 -> (value of lo, value of hi): decodes two packed weights per lookup
FP4_PAIR_TABLE = torch.stack([FP4_TABLE.repeat(16), FP4_TABLE.repeat_interleave(16)], dim=1)
_MIDPOINTS = torch.tensor([(a + b) / 2 for a, b in zip(E2M1_MAGNITUDES, E2M1_MAGNITUDES[1:])])
FP4_GROUP_SIZES = (16, 32, 64, 128)
SCALE_SEARCH_LOW = 0.7                    # smallest scale tried, relative to max|w| / 6


def check_fp4_group_size(group_size) -> int:
    if group_size not in FP4_GROUP_SIZES:
        raise ValueError(f"fp4 group_size must be one of {FP4_GROUP_SIZES}, got {group_size!r}")
    return group_size


def _groups(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """w [n, K] -> [n, Kp/G, G] float32, padded with zeros (a zero costs nothing in FP4)."""
    n, k = w.shape
    kp = packing.padded_in_features(k, group_size)
    return F.pad(w.float(), (0, kp - k)).view(n, kp // group_size, group_size)


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 code (uint8 0..15) of each value of ``x`` (already divided by its scale)."""
    mag = torch.bucketize(x.abs().clamp(max=E2M1_MAX), _MIDPOINTS)
    return (mag + 8 * (x < 0)).to(torch.uint8)


def quantize_fp4(w: torch.Tensor, group_size: int, scale_search: int = 1,
                 asymmetric: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """w [n, K] -> (codes [n, Kp] uint8 0..15, scale [n, Kp/G] bf16, offset [n, Kp/G] bf16 or
    None): W ~= scale * E2M1[code] (+ offset). ``asymmetric`` centres each group's grid on the
    middle of its range (offset = (min + max) / 2, as AFPQ does): a group that is not centred
    on zero then spends no code on values it does not have."""
    g = _groups(w, check_fp4_group_size(group_size))
    offset = None
    if asymmetric:
        offset = ((g.amin(dim=-1) + g.amax(dim=-1)) / 2).to(packing.SCALE_DTYPE)
        g = g - offset.float()[..., None]
    amax = g.abs().amax(dim=-1)
    best_scale, best_err = None, None
    for i in range(scale_search):
        shrink = 1.0 - (1.0 - SCALE_SEARCH_LOW) * i / max(scale_search - 1, 1)
        scale = (amax * shrink / E2M1_MAX).to(packing.SCALE_DTYPE).float()
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        deq = FP4_TABLE[e2m1_codes(g / safe[..., None]).long()] * scale[..., None]
        err = (deq - g).pow(2).sum(dim=-1)
        if best_err is None:
            best_scale, best_err = scale, err
        else:
            better = err < best_err
            best_scale = torch.where(better, scale, best_scale)
            best_err = torch.where(better, err, best_err)
    safe = torch.where(best_scale > 0, best_scale, torch.ones_like(best_scale))
    codes = e2m1_codes(g / safe[..., None]).reshape(g.shape[0], -1)
    return codes, best_scale.to(packing.SCALE_DTYPE), offset


def dequantize_fp4(codes: torch.Tensor, scale: torch.Tensor, in_features: int | None = None,
                   offset: torch.Tensor | None = None) -> torch.Tensor:
    n, kp = codes.shape
    groups = scale.shape[1]
    w = (FP4_TABLE[codes.long()].view(n, groups, kp // groups) * scale.float()[..., None])
    if offset is not None:
        w = w + offset.float()[..., None]
    w = w.view(n, kp)
    return w[:, :in_features] if in_features is not None else w


def decode_packed_fp4(packed: torch.Tensor, scale: torch.Tensor,
                      offset: torch.Tensor | None = None) -> torch.Tensor:
    """Packed codes [n, Kp/2] uint8 + scales (+ offsets) [n, Kp/G] -> W [n, Kp] float32 (one
    table gather per byte: the pair table)."""
    n, half = packed.shape
    pairs = F.embedding(packed.long(), FP4_PAIR_TABLE)            # [n, Kp/2, 2]
    groups = scale.shape[1]
    w = pairs.view(n, groups, -1) * scale.float()[..., None]
    if offset is not None:
        w += offset.float()[..., None]
    return w.view(n, 2 * half)


@dataclass
class FP4Rows(GroupedCodeRows):
    """Rows of an FP4 weight: codes [n, Kp] uint8 0..15, scale [n, Kp/G] bf16, logical K,
    offset [n, Kp/G] bf16 (asymmetric) or None."""
    codes: torch.Tensor
    scale: torch.Tensor
    in_features: int
    offset: torch.Tensor | None = None

    def dequantize(self) -> torch.Tensor:
        return dequantize_fp4(self.codes, self.scale, self.in_features, self.offset)

    def saved_tensors(self, name: str, rows: slice) -> dict[str, torch.Tensor]:
        # the marker says which form: fp4codes (symmetric) or fp4acodes (with offsets)
        marker = "fp4codes" if self.offset is None else "fp4acodes"
        out = {f"{name}.{marker}": packing.pack_int4(self.codes[rows]),
               f"{name}.fp4scales": self.scale[rows],
               f"{name}.fp4_in_features": torch.tensor([self.in_features], dtype=torch.int64)}
        if self.offset is not None:
            out[f"{name}.fp4offsets"] = self.offset[rows]
        return out


def _read_fp4(marker: str):
    def read(get, stem: str) -> FP4Rows:
        offset = get(f"{stem}.fp4offsets") if marker == "fp4acodes" else None
        return FP4Rows(packing.unpack_int4(get(f"{stem}.{marker}")), get(f"{stem}.fp4scales"),
                       int(get(f"{stem}.fp4_in_features")[0]), offset)
    return read


register_row_format("fp4codes", ("fp4scales", "fp4_in_features"), _read_fp4("fp4codes"))
register_row_format("fp4acodes", ("fp4offsets",), _read_fp4("fp4acodes"))


class FP4LinearMethod(LinearMethod):
    def __init__(self, group_size: int = 32, scale_search: int = 1, tile_rows: int = 1024,
                 asymmetric: bool = False) -> None:
        self.group_size = check_fp4_group_size(group_size)
        self.scale_search = scale_search
        self.tile_rows = tile_rows
        self.asymmetric = asymmetric

    def create_weights(self, layer, dtype, device):
        n, k = layer.output_size, layer.input_size
        layer.padded_input_size = packing.padded_in_features(k, self.group_size)
        kp = layer.padded_input_size
        layer.fp4_packed = nn.Parameter(torch.zeros(n, kp // 2, dtype=torch.uint8, device=device),
                                        requires_grad=False)
        layer.fp4_scales = nn.Parameter(
            torch.zeros(n, kp // self.group_size, dtype=packing.SCALE_DTYPE, device=device),
            requires_grad=False)
        layer.fp4_offsets = None
        if self.asymmetric:
            layer.fp4_offsets = nn.Parameter(torch.zeros_like(layer.fp4_scales),
                                             requires_grad=False)
        if layer.has_bias:
            layer.bias = nn.Parameter(torch.zeros(n, dtype=dtype, device=device), requires_grad=False)

    def to_rows(self, weight: torch.Tensor) -> FP4Rows:
        codes, scale, offset = quantize_fp4(weight, self.group_size, self.scale_search,
                                            self.asymmetric)
        return FP4Rows(codes, scale, weight.shape[1], offset)

    def load_weight(self, layer, kind, loaded, output_offset):
        rows = weight_shard_rows(layer, kind, loaded, output_offset)
        if rows is None:
            return
        fp4 = loaded if isinstance(loaded, FP4Rows) else self.to_rows(loaded)
        if fp4.group_size != self.group_size or (fp4.offset is not None) != self.asymmetric:
            raise ValueError(f"fp4 rows with group {fp4.group_size}, asymmetric "
                             f"{fp4.offset is not None} do not fit a layer quantized with group "
                             f"{self.group_size}, asymmetric {self.asymmetric}")
        layer.fp4_packed[rows] = packing.pack_int4(fp4.codes)
        layer.fp4_scales[rows] = fp4.scale.to(packing.SCALE_DTYPE)
        if self.asymmetric:
            layer.fp4_offsets[rows] = fp4.offset.to(packing.SCALE_DTYPE)

    def apply(self, layer, x):
        x2d = x.reshape(-1, layer.input_size).float()
        k = layer.input_size
        y = x2d.new_empty(x2d.shape[0], layer.output_size)
        for r0 in range(0, layer.output_size, self.tile_rows):
            r1 = min(r0 + self.tile_rows, layer.output_size)
            offsets = layer.fp4_offsets[r0:r1] if self.asymmetric else None
            w = decode_packed_fp4(layer.fp4_packed[r0:r1], layer.fp4_scales[r0:r1], offsets)
            y[:, r0:r1] = x2d @ w[:, :k].t()
        if layer.has_bias:
            y += layer.bias.float()
        return y.to(x.dtype).view(*x.shape[:-1], layer.output_size)

    def export_rows(self, layer) -> FP4Rows:
        offset = layer.fp4_offsets.detach() if self.asymmetric else None
        return FP4Rows(packing.unpack_int4(layer.fp4_packed), layer.fp4_scales.detach(),
                       layer.input_size, offset)

    def dequantize(self, layer) -> torch.Tensor:
        return self.export_rows(layer).dequantize()


@register_quantization("fp4")
class FP4Config(LoRCConfigMixin, QuantizationConfig):
    """``group_size`` in 16/32/64/128 (default 32); ``scale_search``: scales tried per group
    (default 1 = max|w| / 6 only); ``asymmetric``: 1 adds a bf16 offset per group (default 0);
    ``lm_head``: "int8" (default, as int4), "int4" or "none"; ``lorc_rank``: LoRC low-rank
    compensation (0 = off), ``lorc_act``: 1 weighs its factors by calibration activations."""

    def __init__(self, group_size: int = 32, scale_search: int = 1, asymmetric: int = 0,
                 lm_head: str = "int8", lorc_rank: int = 0, lorc_act: int = 0) -> None:
        self.group_size = check_fp4_group_size(group_size)
        if asymmetric not in (0, 1, True, False):
            raise ValueError(f"fp4 asymmetric must be 0 or 1, got {asymmetric!r}")
        self.asymmetric = bool(asymmetric)
        if isinstance(scale_search, bool) or not isinstance(scale_search, int) or scale_search < 1:
            raise ValueError(f"fp4 scale_search must be an integer >= 1, got {scale_search!r}")
        self.scale_search = scale_search
        lm_head_method(lm_head, "lm_head")
        self.lm_head = lm_head
        self.init_lorc(lorc_rank, lorc_act)

    def get_linear_method(self, prefix: str) -> LinearMethod | None:
        if is_lm_head(prefix):
            return self.lorc(lm_head_method(self.lm_head, prefix), prefix)
        return self.lorc(FP4LinearMethod(self.group_size, self.scale_search,
                                         asymmetric=self.asymmetric), prefix)

    def describe(self) -> dict:
        return {"group_size": self.group_size, "scale_search": self.scale_search,
                "asymmetric": int(self.asymmetric),
                "lm_head": self.lm_head, **self.lorc_args()}
