"""SpQR (Dettmers et al. 2023): small-group low-bit weights with quantized statistics, plus the
few most sensitive weights kept exactly as a sparse matrix (``--quantization spqr``).

Per row, groups of G input channels (``group_size``, default 16) are quantized asymmetrically to
b bits (``bits``, default 3):

    W[o, k] ~= s[o, g] * (q[o, k] - z[o, g]),   q in [0, 2^b - 1],  g = k // G

Second level: a row's scales s[o, :] -- and separately its zero points z[o, :] -- are themselves
quantized to ``stat_bits`` (default 3) in chunks of ``stat_group`` consecutive groups (default
16), each chunk keeping an fp16 (min, step). Codes are chosen *after* the statistics are
rounded, so they fit the statistics that actually run.

Outliers: the weights whose rounding hurts the output most are kept out of the dense part.
GPTQ's saliency of a weight is err^2 / [H^-1]_kk with H = X^T X the layer-input Gram matrix;
with H's diagonal alone (``h_k`` = mean x_k^2 over the calibration tokens, kvforge's shipped
text) that is err^2 * h_k. Two passes: quantize, rank every weight by err^2 * h_k, recompute the
group statistics without the top ``outlier_fraction`` (they no longer stretch their group's
range), requantize and rank again; the final top fraction stores its residual
w - dense(w) in fp16 as a CSR matrix (int32 row pointers, int16 columns). Forward:

    y = x dense(W)^T + x S^T         (S: the sparse residuals; index_add over the outliers)

Storage is bit-packed (bitpack.py), so the bits are the format's: at the defaults
3 + 2*3/16 + 2*2*16/(16*16) + 1% * 32 + 32/K ~= 4.0 bits per weight
(``SpQRFormat.bits_per_weight``; bits.average_bits measures the stored bytes).
Forward is pure torch on CPU: each call decodes ``tile_rows`` rows at a time (a storage format,
like fp4 and fp8, not a speed-up).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kvforge.quant import packing
from kvforge.quant.base import is_lm_head, register_quantization
from kvforge.quant.bitpack import pack_bits, packed_bytes, unpack_bits
from kvforge.quant.calibration import CalibratedLinearMethod, CalibratedQuantConfig
from kvforge.quant.int8 import lm_head_method
from kvforge.quant.row_formats import register_row_format

SPQR_GROUP_SIZES = (16, 32, 64, 128)
HESSIAN_DAMP = 0.01          # h += 1% of its mean: a channel never seen still counts a little


@dataclass(frozen=True)
class SpQRFormat:
    bits: int = 3
    group_size: int = 16
    stat_bits: int = 3
    stat_group: int = 16

    def groups(self, in_features: int) -> tuple[int, int, int]:
        """(Kp, groups per row, second-level chunks per row: the last may be partial)."""
        kp = packing.padded_in_features(in_features, self.group_size)
        ng = kp // self.group_size
        return kp, ng, -(-ng // self.stat_group)

    def bits_per_weight(self, in_features: int, outlier_fraction: float) -> float:
        """The format's storage per weight of a row of ``in_features``: codes, first-level
        statistics, second-level (min, step) fp16 pairs, outliers (fp16 value + int16 column)
        and the row's int32 CSR pointer."""
        kp, ng, chunks = self.groups(in_features)
        row_bits = kp * self.bits + 2 * ng * self.stat_bits + chunks * 2 * 2 * 16 + 32
        return row_bits / in_features + 32 * outlier_fraction


def _quantize_stat(v: torch.Tensor, fmt: SpQRFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """v [n, ng] -> (codes [n, ng] uint8, second [n, chunks, 2] fp16 (min, step)); a partial
    last chunk is padded with its last value for the range (the padding is not stored)."""
    n, ng = v.shape
    ngp = -(-ng // fmt.stat_group) * fmt.stat_group
    chunks = F.pad(v, (0, ngp - ng), mode="replicate").view(n, -1, fmt.stat_group)
    lo = chunks.amin(dim=-1).half()
    step = ((chunks.amax(dim=-1) - lo.float()) / (2 ** fmt.stat_bits - 1)).half()
    safe = torch.where(step.float() > 0, step.float(), torch.ones_like(step.float()))
    codes = torch.round((chunks - lo.float()[..., None]) / safe[..., None])
    codes = codes.clamp_(0, 2 ** fmt.stat_bits - 1).to(torch.uint8).view(n, ngp)[:, :ng]
    return codes, torch.stack([lo, step], dim=-1)


def _dequantize_stat(codes: torch.Tensor, second: torch.Tensor, fmt: SpQRFormat) -> torch.Tensor:
    n, ng = codes.shape
    ngp = second.shape[1] * fmt.stat_group
    c = F.pad(codes.float(), (0, ngp - ng)).view(n, -1, fmt.stat_group)
    return (second[..., 0:1].float() + c * second[..., 1:2].float()).view(n, ngp)[:, :ng]


def _dense(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int
           ) -> torch.Tensor:
    n, kp = codes.shape
    q = codes.float().view(n, kp // group_size, group_size)
    return (scale[..., None] * (q - zero[..., None])).view(n, kp)


@dataclass
class SpQRRows:
    """Rows of a SpQR weight: codes [n, Kp] uint8; stat_codes [n, 2, ng] uint8 (scales, zeros);
    second [n, 2, chunks, 2] fp16; outliers in CSR (crow [n + 1] int32, col int16,
    val fp16: residuals); the format; logical K."""
    codes: torch.Tensor
    stat_codes: torch.Tensor
    second: torch.Tensor
    crow: torch.Tensor
    col: torch.Tensor
    val: torch.Tensor
    fmt: SpQRFormat
    in_features: int

    @property
    def shape(self) -> tuple[int, int]:
        return (self.codes.shape[0], self.in_features)

    def stats(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized (scale, zero) [n, groups]."""
        return _stats(self.stat_codes, self.second, self.fmt)

    def dequantize(self) -> torch.Tensor:
        scale, zero = self.stats()
        w = _dense(self.codes, scale, zero, self.fmt.group_size)[:, :self.in_features].clone()
        rows = torch.repeat_interleave(torch.arange(w.shape[0]), self.crow.diff().long())
        w[rows, self.col.long()] += self.val.float()
        return w

    def saved_tensors(self, name: str, rows: slice) -> dict[str, torch.Tensor]:
        n = self.codes.shape[0]
        r0, r1, _ = rows.indices(n)
        a, b = int(self.crow[r0]), int(self.crow[r1])
        f = self.fmt
        header = torch.tensor([self.in_features, f.bits, f.group_size, f.stat_bits, f.stat_group])
        return {f"{name}.spqr_codes": pack_bits(self.codes[rows], f.bits),
                f"{name}.spqr_stats": pack_bits(self.stat_codes[rows].flatten(1), f.stat_bits),
                f"{name}.spqr_second": self.second[rows],
                f"{name}.spqr_crow": self.crow[r0:r1 + 1] - a,
                f"{name}.spqr_col": self.col[a:b], f"{name}.spqr_val": self.val[a:b],
                f"{name}.spqr_format": header}


def _stats(stat_codes, second, fmt: SpQRFormat):
    return (_dequantize_stat(stat_codes[:, 0], second[:, 0], fmt),
            _dequantize_stat(stat_codes[:, 1], second[:, 1], fmt))


def _read_spqr(get, stem: str) -> SpQRRows:
    k, bits, g, sbits, sgroup = (int(v) for v in get(f"{stem}.spqr_format"))
    fmt = SpQRFormat(bits, g, sbits, sgroup)
    kp, ng, _ = fmt.groups(k)
    codes = unpack_bits(get(f"{stem}.spqr_codes"), bits, kp)
    stat_codes = unpack_bits(get(f"{stem}.spqr_stats"), sbits, 2 * ng).view(-1, 2, ng)
    return SpQRRows(codes, stat_codes, get(f"{stem}.spqr_second"), get(f"{stem}.spqr_crow"),
                    get(f"{stem}.spqr_col"), get(f"{stem}.spqr_val"), fmt, k)


register_row_format("spqr_codes", ("spqr_stats", "spqr_second", "spqr_crow", "spqr_col",
                                   "spqr_val", "spqr_format"), _read_spqr)


def _leave_one_out_saliency(g: torch.Tensor, h: torch.Tensor, levels: int) -> torch.Tensor:
    """[n, ng, G] groups -> [n, Kp] err^2 * h of each weight rounded with its group's range
    computed *without* it (SpQR's leave-one-out): a weight that alone stretches its group is
    represented exactly by the group's own range, so its plain error says nothing; left out,
    it lands outside the range of the others and is clamped."""
    s = g.sort(dim=-1).values
    lo = torch.where(g == s[..., :1], s[..., 1:2], s[..., :1]).clamp(max=0.0)
    hi = torch.where(g == s[..., -1:], s[..., -2:-1], s[..., -1:]).clamp(min=0.0)
    scale = ((hi - lo) / levels).clamp_min(1e-8)
    q = torch.round((g - lo) / scale).clamp_(0, levels)
    err = (g - (q * scale + lo)).pow(2).flatten(1)
    return err * F.pad(h, (0, err.shape[1] - h.shape[0]))


def quantize_spqr(weight: torch.Tensor, hessian_diag: torch.Tensor, fmt: SpQRFormat,
                  outlier_fraction: float) -> SpQRRows:
    """W [n, K] and h [K] (mean squared input per channel) -> SpQR rows (module docstring)."""
    n, k = weight.shape
    kp, ng, _ = fmt.groups(k)
    levels = 2 ** fmt.bits - 1
    w = weight.float()
    g = F.pad(w[None], (0, kp - k), mode="replicate")[0].view(n, ng, fmt.group_size)
    h = hessian_diag.float().clamp_min(0)
    h = h + HESSIAN_DAMP * h.mean() + 1e-12
    num_outliers = int(round(outlier_fraction * n * k))
    kept = torch.ones_like(g, dtype=torch.bool)

    def quantize(kept):
        lo = torch.where(kept, g, torch.full_like(g, float("inf"))).amin(dim=-1)
        hi = torch.where(kept, g, torch.full_like(g, float("-inf"))).amax(dim=-1)
        # the range always holds 0 (as GPTQ's quantizer): zero points stay in [0, 2^b - 1], so
        # the second level sees no far-off zero; a group of outliers only gets (0, 0)
        lo, hi = lo.clamp(max=0.0), hi.clamp(min=0.0)
        scale = ((hi - lo) / levels).clamp_min(1e-8)
        zero = -lo / scale
        s_codes, s_second = _quantize_stat(scale, fmt)
        z_codes, z_second = _quantize_stat(zero, fmt)
        stat_codes, second = torch.stack([s_codes, z_codes], 1), torch.stack([s_second, z_second], 1)
        s, z = _stats(stat_codes, second, fmt)
        safe = torch.where(s > 0, s, torch.ones_like(s))
        codes = torch.round(g / safe[..., None] + z[..., None]).clamp_(0, levels)
        codes = codes.to(torch.uint8).view(n, kp)
        dense = _dense(codes, s, z, fmt.group_size)[:, :k]
        saliency = (w - dense).pow(2) * h
        return codes, stat_codes, second, dense, saliency

    if num_outliers:
        top = _leave_one_out_saliency(g, h, levels)[:, :k].flatten().topk(num_outliers).indices
        mask = torch.zeros(n * kp, dtype=torch.bool)
        mask[(top // k) * kp + top % k] = True
        codes, stat_codes, second, dense, saliency = quantize(~mask.view(n, ng, fmt.group_size))
        top = saliency.flatten().topk(num_outliers).indices.sort().values
    else:
        codes, stat_codes, second, dense, saliency = quantize(kept)
        top = torch.zeros(0, dtype=torch.long)
    rows, cols = top // k, top % k
    crow = F.pad(torch.bincount(rows, minlength=n).cumsum(0), (1, 0)).to(torch.int32)
    col_dtype = torch.int16 if k <= 2 ** 15 else torch.int32
    val = (w - dense)[rows, cols].half()
    return SpQRRows(codes, stat_codes, second, crow, cols.to(col_dtype), val, fmt, k)


class SpQRLinearMethod(CalibratedLinearMethod):
    """Float until calibrated (records mean x^2 per input channel), then SpQR. Storage: the
    bit-packed ``spqr_codes`` [n, Kp b / 8], ``spqr_stats`` [n, 2 ng sb / 8], ``spqr_second``
    [n, 2, chunks, 2] fp16 and the outlier CSR ``spqr_crow`` / ``spqr_col`` / ``spqr_val``
    (created once every row is in: shards arrive one at a time)."""

    def record(self, x2d):
        super().record(x2d)
        sq = x2d.detach().float().pow(2).sum(dim=0)
        self.sq_sum = sq if getattr(self, "sq_sum", None) is None else self.sq_sum + sq

    def compute_state(self, layer):
        h = self.sq_sum / self.num_rows
        self.sq_sum = None
        return {"scales": torch.ones(layer.input_size), "hessian_diag": h}

    def quantized_rows(self, weight, state):
        return quantize_spqr(weight, state["hessian_diag"], self.config.format,
                             self.config.outlier_fraction)

    def install(self, layer, scales, dtype):
        if not bool((scales == 1).all()):
            raise ValueError(f"spqr layer {self.prefix!r} got input scales other than 1")
        fmt, n = self.config.format, layer.output_size
        kp, ng, chunks = fmt.groups(layer.input_size)
        layer.spqr_codes = nn.Parameter(torch.zeros(n, packed_bytes(kp, fmt.bits),
                                                    dtype=torch.uint8), requires_grad=False)
        layer.spqr_stats = nn.Parameter(torch.zeros(n, packed_bytes(2 * ng, fmt.stat_bits),
                                                    dtype=torch.uint8), requires_grad=False)
        layer.spqr_second = nn.Parameter(torch.zeros(n, 2, chunks, 2,
                                                     dtype=torch.float16), requires_grad=False)
        self._outliers: dict[int, SpQRRows] = {}

    def load_rows(self, layer, rows, output_offset):
        fmt = self.config.format
        if not isinstance(rows, SpQRRows) or rows.fmt != fmt:
            got = rows.fmt if isinstance(rows, SpQRRows) else type(rows).__name__
            raise ValueError(f"spqr layer {self.prefix!r} takes SpQR rows of {fmt}, got {got}")
        r = slice(output_offset, output_offset + rows.shape[0])
        layer.spqr_codes[r] = pack_bits(rows.codes, fmt.bits)
        layer.spqr_stats[r] = pack_bits(rows.stat_codes.flatten(1), fmt.stat_bits)
        layer.spqr_second[r] = rows.second.half()
        self._outliers[output_offset] = rows
        if sum(o.shape[0] for o in self._outliers.values()) == layer.output_size:
            self._build_outliers(layer)

    def _build_outliers(self, layer) -> None:
        """Concatenate the shards' CSR pieces in row order."""
        parts = [self._outliers[o] for o in sorted(self._outliers)]
        counts = torch.cat([p.crow.diff() for p in parts])
        layer.spqr_crow = nn.Parameter(F.pad(counts.cumsum(0), (1, 0)).to(torch.int32),
                                       requires_grad=False)
        layer.spqr_col = nn.Parameter(torch.cat([p.col for p in parts]), requires_grad=False)
        layer.spqr_val = nn.Parameter(torch.cat([p.val for p in parts]).half(),
                                      requires_grad=False)
        self._outliers = {}

    def _rows(self, layer, r: slice) -> SpQRRows:
        fmt = self.config.format
        kp, ng, _ = fmt.groups(layer.input_size)
        n = r.stop - r.start
        a, b = int(layer.spqr_crow[r.start]), int(layer.spqr_crow[r.stop])
        return SpQRRows(unpack_bits(layer.spqr_codes[r], fmt.bits, kp),
                        unpack_bits(layer.spqr_stats[r], fmt.stat_bits, 2 * ng).view(n, 2, ng),
                        layer.spqr_second[r], layer.spqr_crow[r.start:r.stop + 1] - a,
                        layer.spqr_col[a:b], layer.spqr_val[a:b], fmt, layer.input_size)

    def export_rows(self, layer):
        return self._rows(layer, slice(0, layer.output_size))

    def dequantize(self, layer) -> torch.Tensor:
        return self.export_rows(layer).dequantize()

    def apply_quantized(self, layer, x):
        x2d = x.reshape(-1, layer.input_size).float()
        n, k, tile = layer.output_size, layer.input_size, self.config.tile_rows
        fmt = self.config.format
        kp, ng, _ = fmt.groups(k)
        y = x2d.new_empty(x2d.shape[0], n)
        for r0 in range(0, n, tile):
            r1 = min(r0 + tile, n)
            codes = unpack_bits(layer.spqr_codes[r0:r1], fmt.bits, kp)
            stat_codes = unpack_bits(layer.spqr_stats[r0:r1], fmt.stat_bits, 2 * ng)
            scale, zero = _stats(stat_codes.view(-1, 2, ng), layer.spqr_second[r0:r1], fmt)
            y[:, r0:r1] = x2d @ _dense(codes, scale, zero, fmt.group_size)[:, :k].t()
        if layer.spqr_val.numel():
            rows = torch.repeat_interleave(torch.arange(n), layer.spqr_crow.diff().long())
            y.index_add_(1, rows, x2d[:, layer.spqr_col.long()] * layer.spqr_val.float())
        if layer.has_bias:
            y += layer.bias.float()
        return y.to(x.dtype).view(*x.shape[:-1], n)


@register_quantization("spqr")
class SpQRConfig(CalibratedQuantConfig):
    """``bits`` (2..4), ``group_size`` (16, 32, 64, 128), ``stat_bits`` (2..8) and ``stat_group``
    (groups per second-level chunk, >= 1), ``outlier_fraction`` in [0, 0.1); ``lm_head``: "int8"
    (default, as int4) or "none"; ``tile_rows``: rows decoded per step of the forward."""

    def __init__(self, bits: int = 3, group_size: int = 16, stat_bits: int = 3,
                 stat_group: int = 16, outlier_fraction: float = 0.01, lm_head: str = "int8",
                 tile_rows: int = 1024) -> None:
        super().__init__()
        if bits not in (2, 3, 4):
            raise ValueError(f"spqr bits must be 2, 3 or 4, got {bits!r}")
        if group_size not in SPQR_GROUP_SIZES:
            raise ValueError(f"spqr group_size must be one of {SPQR_GROUP_SIZES}, "
                             f"got {group_size!r}")
        if isinstance(stat_bits, bool) or stat_bits not in range(2, 9):
            raise ValueError(f"spqr stat_bits must be 2..8, got {stat_bits!r}")
        if isinstance(stat_group, bool) or not isinstance(stat_group, int) or stat_group < 1:
            raise ValueError(f"spqr stat_group must be an integer >= 1, got {stat_group!r}")
        if not 0.0 <= outlier_fraction < 0.1:
            raise ValueError(f"spqr outlier_fraction must be in [0, 0.1), got "
                             f"{outlier_fraction!r}")
        if isinstance(tile_rows, bool) or not isinstance(tile_rows, int) or tile_rows < 1:
            raise ValueError(f"spqr tile_rows must be an integer >= 1, got {tile_rows!r}")
        lm_head_method(lm_head, "lm_head")
        if lm_head == "int4":
            raise ValueError("spqr lm_head must be 'int8' or 'none', got 'int4'")
        self.format = SpQRFormat(bits, group_size, stat_bits, stat_group)
        self.outlier_fraction = float(outlier_fraction)
        self.lm_head, self.tile_rows = lm_head, tile_rows

    def get_linear_method(self, prefix: str):
        if is_lm_head(prefix):
            return lm_head_method(self.lm_head, prefix)
        return self.register_method(SpQRLinearMethod(self, prefix))

    def describe(self) -> dict:
        f = self.format
        return {"bits": f.bits, "group_size": f.group_size, "stat_bits": f.stat_bits,
                "stat_group": f.stat_group, "outlier_fraction": self.outlier_fraction,
                "lm_head": self.lm_head, "tile_rows": self.tile_rows}
