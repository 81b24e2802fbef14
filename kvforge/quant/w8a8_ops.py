"""INT8 x INT8 building blocks shared by the W8A8 methods (LLM.int8(), SmoothQuant).

Symmetric quantization, zero point 0, range [-127, 127] (-128 is never produced, so negating a
quantized value never overflows):

    weight  W [out, in]  -> Wq [in, out] int8 (stored transposed, like the fp ``weight_t``),
                            w_scale [out] = max_i |W[o, i]| / 127        (per output channel)
    act     x [T, in]    -> xq [T, in] int8, x_scale [T] = max_i |x[t, i]| / 127  (per token,
                            computed at run time: "dynamic")

    y[t, o] = sum_i x[t, i] W[o, i]  ~=  x_scale[t] * w_scale[o] * sum_i xq[t, i] Wq[i, o]
                                                                  \\_ torch._int_mm, int32 acc _/

``torch._int_mm`` on CPU (torch >= 2.4) takes any [M, K] x [K, N] int8 pair and accumulates in
int32 (checked for odd shapes such as 5x7x3 in tests/quant/test_w8a8_ops.py), so no padding is
needed there; cuBLAS (CUDA) takes only M > 16 and M, K, N multiples of 8, so ``int_mm`` pads
with zeros elsewhere. An int32 accumulator cannot overflow here: |acc| <= K * 127 * 127, < 2^31
for K < 133k.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

INT8_MAX = 127


def quantize_weight_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W [out, in] float -> (Wq_t [in, out] int8 contiguous, w_scale [out] float32)."""
    w = weight.float()
    w_scale = w.abs().amax(dim=1).clamp_min(1e-12) / INT8_MAX
    wq = torch.round(w / w_scale[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return wq.t().contiguous(), w_scale


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, in] float -> (xq [T, in] int8, x_scale [T] float32). All-zero rows get scale 1e-12
    and quantize to zeros (never a division by zero)."""
    xf = x.float()
    x_scale = xf.abs().amax(dim=1).clamp_min(1e-12) / INT8_MAX
    xq = torch.round(xf / x_scale[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return xq, x_scale


def int_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [M, K] int8 @ b [K, N] int8 -> int32 [M, N], exact on any device."""
    return torch._int_mm(a, b) if a.is_cpu else padded_int_mm(a, b)


def padded_int_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``int_mm`` with the operands padded with zero rows / columns up to cuBLAS's shapes
    (M >= 24, every dimension a multiple of 8); zeros add nothing to a sum, and the padding is
    sliced off. cuBLASLt's int8 GEMM takes only a row-major ``a`` and a column-major ``b`` (its
    "TN" layout), so ``b`` goes in as the transpose of a contiguous [Np, Kp]:

        a [M, K] -> [Mp, Kp]    b [K, N] -> [Kp, Np] column-major    result [Mp, Np] -> [:M, :N]
    """
    m, k = a.shape
    n = b.shape[1]
    mp, kp, np_ = max(24, -(-m // 8) * 8), -(-k // 8) * 8, -(-n // 8) * 8
    if (mp, kp, np_) != (m, k, n):
        a = F.pad(a, (0, kp - k, 0, mp - m))
        b = F.pad(b, (0, np_ - n, 0, kp - k))
    return torch._int_mm(a.contiguous(), b.t().contiguous().t())[:m, :n]


def int8_matmul(xq: torch.Tensor, x_scale: torch.Tensor, wq_t: torch.Tensor,
                w_scale: torch.Tensor) -> torch.Tensor:
    """(xq [T, in] int8, x_scale [T]) x (Wq_t [in, out] int8, w_scale [out]) -> fp32 [T, out]."""
    acc = int_mm(xq, wq_t)                              # int32 [T, out]
    return acc.float().mul_(x_scale[:, None]).mul_(w_scale[None, :])


def take_float_weight(layer) -> torch.Tensor | None:
    """Remove and return the float W [out, in] that ``UnquantizedLinearMethod`` loaded into
    ``layer`` (None if already taken). Accepts either of its layouts (``weight`` [out, in] or an
    older ``weight_t`` [in, out]) so quantized methods do not depend on which one it uses."""
    if "weight" in layer._parameters and layer._parameters["weight"] is not None:
        w = layer.weight
        del layer.weight
        return w
    if hasattr(layer, "weight_t"):
        w = layer.weight_t.t()
        del layer.weight_t
        return w
    return None


def float_weight(layer) -> torch.Tensor:
    """The loaded float W [out, in] of a layer still in float form (not removed)."""
    if "weight" in layer._parameters and layer._parameters["weight"] is not None:
        return layer.weight
    return layer.weight_t.t()


def dequantize_weight(wq_t: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """The float weight W [out, in] the int8 storage stands for (tests and outlier columns)."""
    return wq_t.t().float() * w_scale[:, None]
