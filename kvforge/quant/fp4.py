"""FP4 weights with group scales (``--quantization fp4``; ZeroQuant-FP, LLM-FP4, MixFP4): the
storage, the layer and the config. The number formats and the search for each group's codes
(E2M1 / E1M2 per group, scale and offset search, activation weighting) are in fp4_format.py.

Storage: codes nibble-packed like INT4's portable form (``fp4_packed`` [n, Kp/2] uint8, even
column in the low nibble) and ``fp4_scales`` [n, Kp/G] bf16 (sign bit = E1M2): 4 + 16/G bits
per weight (``asymmetric``: + ``fp4_offsets`` [n, Kp/G] bf16, the same 4 + 32/G bits as INT4).
Forward (CPU, pure torch): a 512-entry table maps (split, packed byte) to the byte's two values
(each split's 16-entry table squared), so one gather decodes two weights; a tile of
``tile_rows`` output rows is decoded, scaled and multiplied at a time (bounded temporary memory,
nothing cached between calls). Like fp8 this is a storage format on CPU: every call decodes
every weight.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kvforge.layers.linear import LinearMethod
from kvforge.quant import packing
from kvforge.quant.base import (QuantizationConfig, is_lm_head, register_quantization,
                                weight_shard_rows)
from kvforge.quant.calibration import InputSquares
from kvforge.quant.fp4_format import (check_fp4_formats, check_fp4_group_size,
                                      decode_packed_fp4, dequantize_fp4, quantize_fp4)
from kvforge.quant.int8 import lm_head_method
from kvforge.quant.lowrank import LoRCConfigMixin
from kvforge.quant.row_formats import GroupedCodeRows, register_row_format


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


class FP4LinearMethod(InputSquares, LinearMethod):
    """FP4 storage and forward. With ``act_aware`` a float weight shard waits (fp32, in
    ``_pending``) until calibration has run the layer on its float weights and recorded mean
    x^2 per input channel; ``finish`` then quantizes it with that channel weighting. Saved
    FP4 rows load as they are, calibrated or not."""

    def __init__(self, group_size: int = 32, scale_search: int = 1, tile_rows: int = 1024,
                 asymmetric: bool = False, formats: str = "e2m1",
                 act_aware: bool = False) -> None:
        self.group_size = check_fp4_group_size(group_size)
        self.scale_search = scale_search
        self.tile_rows = tile_rows
        self.asymmetric = asymmetric
        self.formats = check_fp4_formats(formats)
        self.act_aware = act_aware
        self._pending: dict[int, torch.Tensor] = {}      # row offset -> float shard
        self.init_squares()

    @property
    def pending(self) -> bool:
        """Float shards loaded, not quantized yet (awaiting calibration)."""
        return bool(self._pending)

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

    def to_rows(self, weight: torch.Tensor, sq_mean: torch.Tensor | None = None) -> FP4Rows:
        codes, scale, offset = quantize_fp4(weight, self.group_size, self.scale_search,
                                            self.asymmetric, self.formats, sq_mean)
        return FP4Rows(codes, scale, weight.shape[1], offset)

    def load_weight(self, layer, kind, loaded, output_offset):
        rows = weight_shard_rows(layer, kind, loaded, output_offset)
        if rows is None:
            return
        if self.act_aware and not isinstance(loaded, FP4Rows):
            self._pending[output_offset] = loaded.detach().float().clone()
            return
        self._write_rows(layer, rows, loaded if isinstance(loaded, FP4Rows)
                         else self.to_rows(loaded))

    def finish(self, layer) -> None:
        """Quantize the pending shards with the recorded input statistics (every channel
        alike where calibration never reached the layer)."""
        sq_mean = self.take_sq_mean()
        for offset, weight in sorted(self._pending.items()):
            rows = slice(offset, offset + weight.shape[0])
            self._write_rows(layer, rows, self.to_rows(weight, sq_mean))
        self._pending = {}

    def _write_rows(self, layer, rows: slice, fp4: FP4Rows) -> None:
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
        if self.pending:
            self.record_squares(x2d, "fp4")
            for offset, weight in self._pending.items():     # the float layer while recording
                y[:, offset:offset + weight.shape[0]] = x2d @ weight.t()
        else:
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
    """``group_size`` in 16/32/64/128 (default 32); ``formats``: "e2m1" (default), "e1m2" or
    "mixed" (each group's split of least error); ``scale_search``: scales tried per group
    (default 1 = the range-based one only); ``asymmetric``: 1 adds a bf16 offset per group
    (default 0); ``act_aware``: 1 weighs each input channel's error by its mean x^2 on the
    calibration text (default 0); ``lm_head``: "int8" (default, as int4), "int4" or "none";
    ``lorc_rank``: LoRC low-rank compensation (0 = off), ``lorc_act``: 1 weighs its factors
    by calibration activations."""

    def __init__(self, group_size: int = 32, scale_search: int = 1, asymmetric: int = 0,
                 lm_head: str = "int8", lorc_rank: int = 0, lorc_act: int = 0,
                 formats: str = "e2m1", act_aware: int = 0) -> None:
        self.group_size = check_fp4_group_size(group_size)
        self.formats = check_fp4_formats(formats)
        for name, value in (("asymmetric", asymmetric), ("act_aware", act_aware)):
            if value not in (0, 1, True, False):
                raise ValueError(f"fp4 {name} must be 0 or 1, got {value!r}")
        self.asymmetric, self.act_aware = bool(asymmetric), bool(act_aware)
        if isinstance(scale_search, bool) or not isinstance(scale_search, int) or scale_search < 1:
            raise ValueError(f"fp4 scale_search must be an integer >= 1, got {scale_search!r}")
        self.scale_search = scale_search
        lm_head_method(lm_head, "lm_head")
        self.lm_head = lm_head
        self.init_lorc(lorc_rank, lorc_act)
        if self.act_aware and self.lorc_rank:
            # LoRC factors the error of codes chosen at load; these codes wait for calibration
            raise ValueError(f"fp4 act_aware=1 cannot be combined with lorc_rank="
                             f"{self.lorc_rank}")
        self.needs_calibration = self.needs_calibration or self.act_aware
        self.fp4_methods: dict[str, FP4LinearMethod] = {}

    def get_linear_method(self, prefix: str) -> LinearMethod | None:
        if is_lm_head(prefix):
            return self.lorc(lm_head_method(self.lm_head, prefix), prefix)
        method = FP4LinearMethod(self.group_size, self.scale_search, asymmetric=self.asymmetric,
                                 formats=self.formats, act_aware=self.act_aware)
        if self.act_aware:
            self.fp4_methods[prefix] = method
        return self.lorc(method, prefix)

    def calibrate(self, model, batches) -> None:
        if not self.act_aware:
            return super().calibrate(model, batches)          # LoRC's, when lorc_act
        from kvforge.layers.linear import Linear
        from kvforge.quant.calibration import calibrate_recording_layers
        calibrate_recording_layers(model, batches, [
            m for m in model.modules()
            if isinstance(m, Linear) and isinstance(m.method, FP4LinearMethod)
            and m.method.pending])

    def pending_layers(self) -> list[str]:
        return super().pending_layers() + [p for p, m in self.fp4_methods.items() if m.pending]

    def describe(self) -> dict:
        extra = {"act_aware": 1} if self.act_aware else {}
        return {"group_size": self.group_size, "formats": self.formats,
                "scale_search": self.scale_search,
                "asymmetric": int(self.asymmetric), **extra,
                "lm_head": self.lm_head, **self.lorc_args()}
