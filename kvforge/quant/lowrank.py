"""LoRC, low-rank compensation (ZeroQuant-V2, Yao et al. 2023): ``--quantization-arg lorc_rank=R``
on int4, int8, fp4 and zeroquant.

Each weight matrix W (each HF shard: q, k, v, gate, up, ... separately) is quantized by the
inner method as usual, and the part of W its codes miss is approximated by a rank-R product:

    E = W - Q(W)                    the quantization error, float [n, K]
    E ~= U V,  U = U_r S_r [n, R],  V = V_r^T [R, K]     (truncated SVD: the best rank-R fit in
                                                          Frobenius norm, Eckart-Young)
    y = Q(W) x + U (V x)            the inner kernel, plus two thin fp32 matmuls

A fused layer (q|k|v, gate|up) holds one (U_s, V_s) per shard: V stacks them ([S R, K]) and U is
block-diagonal ([n, S R], zeros off the shard's block), so one pair of matmuls serves every
shard and each shard saves and reloads its own factors (``<name>.lorc_u`` [n_s, R],
``<name>.lorc_v`` [R, K]). Cost per layer: (n + K) R fp32 numbers per shard, e.g. 2.3% of the
INT4 codes of a 576 x 1536 matrix at R = 8.

Activation-aware factors (``lorc_act=1``): what matters is the output error E x, not E itself,
and LLM inputs have a few channels far louder than the rest. With h_k = mean x_k^2 over the
calibration tokens (quant/data/calibration.txt), E[U V] = E_x |(E - U V) x|^2 is
|(E - U V) D|_F^2 for D = diag(sqrt(h)) if channels are uncorrelated, so the best rank-R
factors are the SVD of E D, with V = V_r^T D^-1. The errors wait (fp32, one layer's worth per
layer: the float model's size in all) until calibration has run the model (Q(W) without the
correction) and recorded h; a saved model carries the factors and needs no calibration.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kvforge.layers.linear import LinearMethod
from kvforge.quant import packing
from kvforge.quant.calibration import InputSquares


def check_lorc_rank(rank: Any) -> int:
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ValueError(f"lorc_rank must be an integer >= 0 (0 disables LoRC), got {rank!r}")
    return rank


def low_rank_factors(error: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The best rank-``rank`` approximation of ``error`` [n, K] as (U [n, r], V [r, K]), r =
    min(rank, n, K): the truncated SVD U_r S_r V_r^T, from the eigenvectors of the smaller Gram
    matrix (V_r of E^T E, then U_r S_r = E V_r; or the transpose), eigh in float64. A full SVD
    of a 49152 x 576 LM head costs minutes on a small CPU; its 576 x 576 Gram matrix does not."""
    e = error.float()
    r = min(rank, *e.shape)
    if e.shape[0] >= e.shape[1]:
        _, vecs = torch.linalg.eigh((e.t() @ e).double())      # ascending eigenvalues
        v = vecs[:, -r:].flip(1).float()                        # [K, r], top first
        return (e @ v).contiguous(), v.t().contiguous()
    _, vecs = torch.linalg.eigh((e @ e.t()).double())
    u = vecs[:, -r:].flip(1).float()                            # [n, r]
    return u.contiguous(), (u.t() @ e).contiguous()


def dequantize_rows(rows) -> torch.Tensor:
    """The float weight [n, K] a method's portable rows stand for (what its kernel multiplies)."""
    from kvforge.quant.int4 import Int4Blocks
    from kvforge.quant.int8 import Int8Rows
    if isinstance(rows, Int4Blocks):
        return packing.dequantize_int4(rows.codes, rows.scale, rows.zero, rows.in_features)
    if isinstance(rows, Int8Rows):
        return packing.dequantize_int8(rows.q, rows.scale)
    if hasattr(rows, "dequantize"):
        return rows.dequantize()
    raise ValueError(f"LoRC cannot dequantize {type(rows).__name__}")


def quantize_rows(method: LinearMethod, weight: torch.Tensor):
    """A float weight slice -> the portable rows ``method`` would store for it."""
    from kvforge.quant.int4 import Int4LinearMethod
    from kvforge.quant.int8 import Int8LinearMethod, Int8Rows
    if isinstance(method, Int4LinearMethod):
        return method.to_blocks(weight)
    if isinstance(method, Int8LinearMethod):
        return Int8Rows(*packing.quantize_int8_per_channel(weight))
    if hasattr(method, "to_rows"):
        return method.to_rows(weight)
    raise ValueError(f"LoRC does not support {type(method).__name__}")


@dataclass
class LoRCRows:
    """Saved rows of a LoRC layer: the inner method's rows plus one shard's factors
    (u [n, r], v [r, K]); a whole layer's export carries every shard's (``shards``)."""
    rows: Any
    u: torch.Tensor
    v: torch.Tensor
    shard_starts: tuple[int, ...] = (0,)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.rows.shape)

    def factor_tensors(self, name: str, rows: slice) -> dict[str, torch.Tensor]:
        """The factors of the shard whose rows start at ``rows.start`` (serialize.py)."""
        start = rows.start or 0
        if start not in self.shard_starts:
            raise ValueError(f"rows {rows} of {name!r} do not start a LoRC shard "
                             f"(shards start at {self.shard_starts})")
        s = self.shard_starts.index(start)
        r = self.v.shape[0] // len(self.shard_starts)
        return {f"{name}.lorc_u": self.u[rows, s * r:(s + 1) * r],
                f"{name}.lorc_v": self.v[s * r:(s + 1) * r]}


HESSIAN_DAMP = 0.01        # h += 1% of its mean: no channel is weighed as if never used


def activation_weighted_factors(error: torch.Tensor, sq_mean: torch.Tensor, rank: int
                                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank-``rank`` factors minimising the expected output error for inputs whose channels
    have mean squares ``sq_mean`` [K] (module docstring)."""
    h = sq_mean.float().clamp_min(0)
    d = (h + HESSIAN_DAMP * h.mean() + 1e-12).sqrt()
    u, v = low_rank_factors(error.float() * d, rank)
    return u, (v / d).contiguous()


class LoRCLinearMethod(InputSquares, LinearMethod):
    """Wraps a weight-only/W8A8 method: its storage and kernel, plus ``lorc_u`` [n, S r] and
    ``lorc_v`` [S r, K] (S shards) created with the first weight shard. With ``act_aware`` the
    factors are computed by ``finish`` after calibration (``LoRCConfigMixin.calibrate``)."""

    def __init__(self, inner: LinearMethod, rank: int, act_aware: bool = False) -> None:
        if check_lorc_rank(rank) == 0:
            raise ValueError("LoRCLinearMethod needs lorc_rank >= 1")
        self.inner, self.rank, self.act_aware = inner, rank, act_aware
        self._factored: set[int] = set()
        self._errors: dict[int, tuple[int, torch.Tensor]] = {}    # shard -> (offset, W - Q(W))
        self.init_squares()

    @property
    def pending(self) -> bool:
        """Float errors loaded, factors not computed yet (awaiting calibration)."""
        return bool(self._errors)

    def create_weights(self, layer, dtype, device):
        self.inner.create_weights(layer, dtype, device)

    def _shards(self, layer) -> list[int]:
        """Row offsets where the layer's shards start (MergedLinear sets its sizes after the
        constructor creates the weights, so they are read at load time)."""
        sizes = getattr(layer, "output_sizes", [layer.output_size])
        return [sum(sizes[:i]) for i in range(len(sizes))]

    def load_weight(self, layer, kind, loaded, output_offset):
        if kind != "weight":
            return self.inner.load_weight(layer, kind, loaded, output_offset)
        starts = self._shards(layer)
        if output_offset not in starts:
            raise ValueError(f"LoRC weight rows at offset {output_offset} do not start a shard "
                             f"(shards start at {starts})")
        s = starts.index(output_offset)
        if isinstance(loaded, LoRCRows):
            rows, u, v = loaded.rows, loaded.u.float(), loaded.v.float()
            if u.shape != (loaded.shape[0], self.rank) or v.shape != (self.rank, layer.input_size):
                raise ValueError(f"LoRC factors of shapes {tuple(u.shape)}, {tuple(v.shape)} do "
                                 f"not fit rank {self.rank} and rows {tuple(loaded.shape)}")
        elif isinstance(loaded, torch.Tensor):
            if loaded.dim() != 2 or loaded.shape[1] != layer.input_size:
                raise ValueError(f"weight of shape {tuple(loaded.shape)} does not fit a linear "
                                 f"layer with input_size {layer.input_size}")
            rows = quantize_rows(self.inner, loaded)
            error = loaded.float() - dequantize_rows(rows)
            if self.act_aware:
                self._errors[s] = (output_offset, error)
                u = torch.zeros(loaded.shape[0], self.rank)
                v = torch.zeros(self.rank, layer.input_size)
            else:
                u, v = _padded(*low_rank_factors(error, self.rank), self.rank)
        else:
            raise ValueError(f"LoRC layer got saved rows ({type(loaded).__name__}) without "
                             f"their low-rank factors")
        if not hasattr(layer, "lorc_u"):
            r = self.rank * len(starts)
            layer.lorc_u = nn.Parameter(torch.zeros(layer.output_size, r), requires_grad=False)
            layer.lorc_v = nn.Parameter(torch.zeros(r, layer.input_size), requires_grad=False)
        n = rows.shape[0]
        cols = slice(s * self.rank, (s + 1) * self.rank)
        layer.lorc_u[output_offset:output_offset + n, cols] = u
        layer.lorc_v[cols] = v
        if not (self.act_aware and isinstance(loaded, torch.Tensor)):
            self._factored.add(s)
        self.inner.load_weight(layer, kind, rows, output_offset)

    def process_weights_after_loading(self, layer):
        self.inner.process_weights_after_loading(layer)
        if len(self._factored) + len(self._errors) != len(self._shards(layer)):
            raise ValueError(f"LoRC got factors for {len(self._factored)} of "
                             f"{len(self._shards(layer))} weight shards")

    def finish(self, layer) -> None:
        """Activation-aware factors from the recorded input statistics. A layer calibration
        does not reach (the LM head: calibration runs the decoder, never the logits) weighs
        every channel alike, i.e. gets the plain SVD."""
        sq_mean = self.take_sq_mean()
        if sq_mean is None:
            sq_mean = torch.ones(layer.input_size)
        for s, (offset, error) in sorted(self._errors.items()):
            u, v = _padded(*activation_weighted_factors(error, sq_mean, self.rank), self.rank)
            cols = slice(s * self.rank, (s + 1) * self.rank)
            layer.lorc_u[offset:offset + error.shape[0], cols] = u
            layer.lorc_v[cols] = v
            self._factored.add(s)
        self._errors = {}

    def apply(self, layer, x):
        y = self.inner.apply(layer, x)
        x2d = x.reshape(-1, layer.input_size).float()
        if self.pending:
            self.record_squares(x2d, "LoRC")
            return y                                 # Q(W) x while calibrating
        correction = (x2d @ layer.lorc_v.t()) @ layer.lorc_u.t()
        return y + correction.to(y.dtype).view(y.shape)

    def export_rows(self, layer) -> LoRCRows:
        return LoRCRows(self.inner.export_rows(layer), layer.lorc_u.detach(),
                        layer.lorc_v.detach(), tuple(self._shards(layer)))

    def dequantize(self, layer) -> torch.Tensor:
        """Q(W) + U V: the float weight this layer multiplies by (up to activation rounding)."""
        return self.inner.dequantize(layer) + layer.lorc_u @ layer.lorc_v


def _padded(u: torch.Tensor, v: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A shard narrower than the rank (tiny test models) pads its factors with zeros."""
    return (torch.nn.functional.pad(u, (0, rank - u.shape[1])),
            torch.nn.functional.pad(v, (0, 0, 0, rank - v.shape[0])))


def with_lorc(method: LinearMethod | None, rank: int, act_aware: bool = False
              ) -> LinearMethod | None:
    """``method`` wrapped in LoRC when ``rank`` > 0 (None: a float layer stays float)."""
    if method is None or rank == 0:
        return method
    return LoRCLinearMethod(method, rank, act_aware)


class LoRCConfigMixin:
    """``lorc_rank`` / ``lorc_act`` options for a QuantizationConfig: wraps its methods, and
    with ``lorc_act`` makes the config calibrate (record input statistics, then factor)."""

    def init_lorc(self, lorc_rank, lorc_act) -> None:
        self.lorc_rank = check_lorc_rank(lorc_rank)
        if lorc_act not in (0, 1, True, False):
            raise ValueError(f"lorc_act must be 0 or 1, got {lorc_act!r}")
        self.lorc_act = bool(lorc_act) and self.lorc_rank > 0
        self.needs_calibration = self.lorc_act
        self.lorc_methods: dict[str, LoRCLinearMethod] = {}

    def lorc(self, method: LinearMethod | None, prefix: str) -> LinearMethod | None:
        wrapped = with_lorc(method, self.lorc_rank, self.lorc_act)
        if isinstance(wrapped, LoRCLinearMethod):
            self.lorc_methods[prefix] = wrapped
        return wrapped

    def lorc_args(self) -> dict:
        """What ``describe`` adds (nothing when LoRC is off, so older saves read the same)."""
        if not self.lorc_rank:
            return {}
        return {"lorc_rank": self.lorc_rank, "lorc_act": int(self.lorc_act)}

    def calibrate(self, model, batches) -> None:
        from kvforge.layers.linear import Linear
        from kvforge.quant.calibration import calibrate_recording_layers
        calibrate_recording_layers(model, batches, [
            m for m in model.modules()
            if isinstance(m, Linear) and isinstance(m.method, LoRCLinearMethod)
            and m.method.pending])

    def pending_layers(self) -> list[str]:
        return [p for p, m in self.lorc_methods.items() if m.pending]
