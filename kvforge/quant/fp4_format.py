"""FP4 number formats and the search for each group's codes (``--quantization fp4``; the
storage and the layer are in fp4.py).

A 4-bit float is a sign and three bits split between exponent and mantissa. Two splits are
kept, each group of G input channels of a row using one of them:

    E2M1: +-{0, 0.5, 1, 1.5, 2, 3, 4, 6}          (the OCP MX FP4 element; the default)
    E1M2: +-{0, 0.25, 0.5, 0.75, 1, 1.25, 1.5, 1.75}  (a uniform grid: INT4's shape, symmetric)

(code = sign << 3 | magnitude index). Per group ``W ~= scale * FORMAT[code] (+ offset)``.
E2M1 is denser near zero, where most weights of a bell-shaped group lie; E1M2 has even steps,
which suits flat groups (and weights that already lie on a uniform 4-bit grid, as a Q4 GGUF
file's do). ``formats``: "e2m1" (default), "e1m2" or "mixed": every group takes the split of
least squared error (MixFP4's per-block choice; LLM-FP4 searches the split per tensor). The
choice costs no bits: a scale is never negative, so its sign bit says E1M2.

``scale_search`` = N > 1 tries N scales per group between 0.7x and 1x the range-based one and
keeps the least squared error (clipping the few largest weights buys finer steps for the rest);
with ``asymmetric`` it also tries the grid's lowest or highest level on the group's minimum or
maximum instead of centring it, and then refits scale and offset by least squares to the chosen
codes. ``sq_mean`` (``act_aware``) weighs each input channel's squared error by its mean x^2.
Scales and offsets are bf16, and codes are chosen after the rounding, so the search measures
the parameters that actually run.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kvforge.quant import packing
from kvforge.quant.lowrank import HESSIAN_DAMP

E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E1M2_MAGNITUDES = (0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75)
FORMAT_CHOICES = {"e2m1": (0,), "e1m2": (1,), "mixed": (0, 1)}
_MAGNITUDES = (E2M1_MAGNITUDES, E1M2_MAGNITUDES)
# [split, code] -> value
FP4_TABLES = torch.tensor([m + tuple(-v for v in m) for m in _MAGNITUDES])
FP4_TABLE = FP4_TABLES[0]
# row split * 256 + byte (byte = lo | hi << 4) -> (value of lo, value of hi): two weights a gather
FP4_PAIR_TABLES = torch.cat([torch.stack([t.repeat(16), t.repeat_interleave(16)], dim=1)
                             for t in FP4_TABLES])
FP4_GROUP_SIZES = (16, 32, 64, 128)
SCALE_SEARCH_LOW = 0.7                    # smallest scale tried, relative to the range-based one
SEARCH_CHUNK_ELEMENTS = 1 << 18


def check_fp4_group_size(group_size) -> int:
    if group_size not in FP4_GROUP_SIZES:
        raise ValueError(f"fp4 group_size must be one of {FP4_GROUP_SIZES}, got {group_size!r}")
    return group_size


def check_fp4_formats(formats) -> str:
    if formats not in FORMAT_CHOICES:
        raise ValueError(f"fp4 formats must be one of {tuple(FORMAT_CHOICES)}, got {formats!r}")
    return formats


def _groups(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """w [n, K] -> [n, Kp/G, G] float32, padded with zeros (a zero costs nothing in FP4)."""
    n, k = w.shape
    kp = packing.padded_in_features(k, group_size)
    return F.pad(w.float(), (0, kp - k)).view(n, kp // group_size, group_size)


def fp4_magnitude_index(a: torch.Tensor, split: int) -> torch.Tensor:
    """Index (0..7) of the nearest magnitude of ``split`` for each |value| ``a``, a tie going to
    the smaller one (as bucketize over the midpoints, without its per-element binary search):

        E1M2 (steps of 0.25):        ceil(4a - 1/2), at most 7
        E2M1 (0.5 steps up to 2, then 3, 4, 6):
                                     min(ceil(2a - 1/2), 4) + [a > 2.5] + [a > 3.5] + [a > 5]
    """
    if split == 1:
        return (a * 4 - 0.5).ceil_().clamp_(0, 7).to(torch.uint8)
    mag = (a * 2 - 0.5).ceil_().clamp_(0, 4).to(torch.uint8)
    for midpoint in (2.5, 3.5, 5.0):
        mag += a > midpoint
    return mag


def fp4_codes(x: torch.Tensor, split: int = 0) -> torch.Tensor:
    """Nearest code (uint8 0..15) of ``split`` (0 E2M1, 1 E1M2) for each value of ``x``
    (already divided by its scale)."""
    mag = fp4_magnitude_index(x.abs(), split)
    return mag.add_(torch.signbit(x).to(torch.uint8) * 8)


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(packing.SCALE_DTYPE).float()


class _Best:
    """Per group, the candidate (split, scale, offset) of least squared error so far; with
    ``channel_weight`` [1, Kp/G, G] each weight's squared error counts that much."""

    def __init__(self, shape, channel_weight: torch.Tensor | None = None) -> None:
        self.weight = channel_weight
        self.err = torch.full(shape, float("inf"))
        self.scale = torch.zeros(shape)
        self.offset = torch.zeros(shape)
        self.split = torch.zeros(shape, dtype=torch.bool)

    def offer(self, g, split: int, scale, offset) -> None:
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        codes = fp4_codes((g - offset[..., None]) / safe[..., None], split)
        deq = FP4_TABLES[split][codes.long()] * scale[..., None] + offset[..., None]
        sq = (deq - g).pow_(2)
        err = (sq if self.weight is None else sq.mul_(self.weight)).sum(dim=-1)
        better = err < self.err
        self.err = torch.where(better, err, self.err)
        self.scale = torch.where(better, scale, self.scale)
        self.offset = torch.where(better, offset, self.offset)
        self.split = torch.where(better, split == 1, self.split)

    def _scaled(self, g) -> torch.Tensor:
        safe = torch.where(self.scale > 0, self.scale, torch.ones_like(self.scale))
        return (g - self.offset[..., None]) / safe[..., None]

    def codes(self, g) -> torch.Tensor:
        x = self._scaled(g)
        return torch.where(self.split[..., None], fp4_codes(x, 1), fp4_codes(x, 0))

    def refit(self, g, split: int, asymmetric: bool) -> None:
        """(Weighted) least-squares scale (and offset) for the chosen codes of ``split`` (every
        group's split here), kept where it errs less."""
        t = FP4_TABLES[split][fp4_codes(self._scaled(g), split).long()]
        h = torch.ones_like(g) if self.weight is None else self.weight.expand_as(g)
        hsum = h.sum(dim=-1, keepdim=True).clamp_min(1e-30)
        if asymmetric:
            t_mean = (h * t).sum(dim=-1, keepdim=True) / hsum
            g_mean = (h * g).sum(dim=-1, keepdim=True) / hsum
            tc = t - t_mean
            var = (h * tc * tc).sum(dim=-1)
            scale = (h * tc * g).sum(dim=-1) / torch.where(var > 0, var, torch.ones_like(var))
            offset = (g_mean - scale[..., None] * t_mean).squeeze(-1)
        else:
            norm = (h * t * t).sum(dim=-1)
            scale = (h * t * g).sum(dim=-1) / torch.where(norm > 0, norm, torch.ones_like(norm))
            offset = torch.zeros_like(scale)
        ok = scale > 0
        scale = _bf16(torch.where(ok, scale, self.scale))
        offset = _bf16(torch.where(ok, offset, self.offset))
        self.offer(g, split, scale, offset)

    def merge(self, other: _Best) -> None:
        better = other.err < self.err
        for name in ("err", "scale", "offset", "split"):
            setattr(self, name, torch.where(better, getattr(other, name), getattr(self, name)))


def quantize_fp4(w: torch.Tensor, group_size: int, scale_search: int = 1,
                 asymmetric: bool = False, formats: str = "e2m1",
                 sq_mean: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """w [n, K] -> (codes [n, Kp] uint8 0..15, scale [n, Kp/G] bf16 whose sign bit marks
    E1M2 groups, offset [n, Kp/G] bf16 or None): W ~= |scale| * FORMAT[code] (+ offset).
    ``asymmetric`` gives each group an offset (first candidate: the middle of its range, as
    AFPQ does): a group that is not centred on zero then spends no code on values it lacks.
    ``sq_mean`` [K] (mean x_k^2 of the layer's inputs) weighs each input channel's squared
    error by it: the expected output error E|(W - Q(W)) x|^2 for uncorrelated channels."""
    g = _groups(w, check_fp4_group_size(group_size))
    check_fp4_formats(formats)
    channel_weight = None
    if sq_mean is not None:
        h = sq_mean.float().clamp_min(0)
        h = (h + HESSIAN_DAMP * h.mean() + 1e-12) / (h.mean() + 1e-12)
        channel_weight = F.pad(h, (0, g.shape[1] * g.shape[2] - h.shape[0])).view(1, *g.shape[1:])
    # the search makes ~15 passes per candidate: rows in chunks of ~1 MiB stay in cache
    chunk = max(1, SEARCH_CHUNK_ELEMENTS // (g.shape[1] * g.shape[2]))
    parts = [_quantize_groups(g[r:r + chunk], scale_search, asymmetric, formats, channel_weight)
             for r in range(0, g.shape[0], chunk)]
    codes = torch.cat([c for c, _, _ in parts])
    scale = torch.cat([s for _, s, _ in parts])
    offset = torch.cat([o for _, _, o in parts]) if asymmetric else None
    return codes, scale, offset


def _quantize_groups(g: torch.Tensor, scale_search: int, asymmetric: bool, formats: str,
                     channel_weight: torch.Tensor | None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """quantize_fp4 of the groups g [n, Kp/G, G]."""
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    if asymmetric:
        half = (hi - lo) / 2
        centre = _bf16((lo + hi) / 2)
    else:
        half, centre = g.abs().amax(dim=-1), torch.zeros_like(lo)
    best = None
    for split in FORMAT_CHOICES[formats]:                        # each split on its own,
        found = _Best(lo.shape, channel_weight)                   # then the better per group
        top = _MAGNITUDES[split][-1]
        for i in range(scale_search):
            shrink = 1.0 - (1.0 - SCALE_SEARCH_LOW) * i / max(scale_search - 1, 1)
            scale = _bf16(half * shrink / top)
            found.offer(g, split, scale, centre)
            if asymmetric and i > 0:      # the shrunk grid's end on the group's min or max
                found.offer(g, split, scale, _bf16(lo + scale * top))
                found.offer(g, split, scale, _bf16(hi - scale * top))
        if scale_search > 1:
            found.refit(g, split, asymmetric)
        if best is None:
            best = found
        else:
            best.merge(found)
    codes = best.codes(g).reshape(g.shape[0], -1)
    scale = torch.where(best.split, -best.scale, best.scale).to(packing.SCALE_DTYPE)
    return codes, scale, best.offset.to(packing.SCALE_DTYPE) if asymmetric else None


def _split_of(scale: torch.Tensor) -> torch.Tensor:
    return torch.signbit(scale).long()


def dequantize_fp4(codes: torch.Tensor, scale: torch.Tensor, in_features: int | None = None,
                   offset: torch.Tensor | None = None) -> torch.Tensor:
    n, kp = codes.shape
    groups = scale.shape[1]
    split = _split_of(scale)[..., None]
    values = FP4_TABLES.view(-1)[codes.long().view(n, groups, kp // groups) + 16 * split]
    w = values * scale.float().abs()[..., None]
    if offset is not None:
        w = w + offset.float()[..., None]
    w = w.view(n, kp)
    return w[:, :in_features] if in_features is not None else w


def decode_packed_fp4(packed: torch.Tensor, scale: torch.Tensor,
                      offset: torch.Tensor | None = None) -> torch.Tensor:
    """Packed codes [n, Kp/2] uint8 + scales (+ offsets) [n, Kp/G] -> W [n, Kp] float32 (one
    table gather per byte: the pair table of the group's split)."""
    n, half = packed.shape
    groups = scale.shape[1]
    index = packed.long().view(n, groups, -1) + 256 * _split_of(scale)[..., None]
    w = F.embedding(index, FP4_PAIR_TABLES).view(n, groups, -1) * scale.float().abs()[..., None]
    if offset is not None:
        w += offset.float()[..., None]
    return w.view(n, 2 * half)
