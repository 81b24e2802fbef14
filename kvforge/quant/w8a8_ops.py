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

Not every CPU's ``torch._int_mm`` is exact: oneDNN's AVX2 kernel for CPUs without VNNI adds
128 to one operand and multiplies u8 x s8 pairs into a saturating int16 (``vpmaddubsw``), so
64 products of 127 x 127 came back as 8,160 instead of 1,032,256. Where it is not exact, or is
slower than fp32 (no VNNI: ~20x on a 2-core EPYC), ``int_mm`` multiplies the int8 values as
fp32 in slabs of ``EXACT_FP32_K`` along K: every slab's sum is an integer below 2^24, which fp32
holds exactly, so the int32 result is the same either way.
"""
from __future__ import annotations

import functools
import time

import torch
import torch.nn.functional as F

INT8_MAX = 127
# fp32 holds every integer up to 2^24 exactly; a dot product of K int8 x int8 terms is at most
# K * 128^2 in magnitude, <= 2^24 for K <= 1024
EXACT_FP32_K = 1024


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
    """a [M, K] int8 @ b [K, N] int8 -> int32 [M, N], exact on any device: ``torch._int_mm``
    on a CPU where it is exact and the faster (``int_mm_pays``), else exact fp32 slabs."""
    if not a.is_cpu:
        return padded_int_mm(a, b)
    return torch._int_mm(a, b) if int_mm_pays() else exact_float_matmul(a, b)


def exact_float_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [..., M, K] int8 @ b [..., K, N] int8 -> the exact int32 sums, as fp32 GEMMs of slabs
    of ``EXACT_FP32_K`` along K (each slab's sums are integers fp32 holds exactly)."""
    acc = None
    for k0 in range(0, a.shape[-1], EXACT_FP32_K):
        part = torch.matmul(a[..., k0:k0 + EXACT_FP32_K].float(),
                            b[..., k0:k0 + EXACT_FP32_K, :].float()).to(torch.int32)
        acc = part if acc is None else acc.add_(part)
    if acc is None:                                   # K = 0
        return torch.zeros(*a.shape[:-1], b.shape[-1], dtype=torch.int32, device=a.device)
    return acc


@functools.lru_cache(maxsize=1)
def int_mm_exact() -> bool:
    """Whether this CPU's ``torch._int_mm`` returns exact int32 sums, probed once per process
    on the operands that saturate a 16-bit pair sum (all-127 and mixed signs) and on random
    ones (module doc: oneDNN's AVX2 kernel without VNNI does not)."""
    g = torch.Generator().manual_seed(0)
    pairs = [(torch.full((24, 64), va, dtype=torch.int8), torch.full((64, 8), vb, dtype=torch.int8))
             for va in (127, -127) for vb in (127, -127)]
    pairs.append((torch.randint(-127, 128, (24, 256), dtype=torch.int8, generator=g),
                  torch.randint(-127, 128, (256, 40), dtype=torch.int8, generator=g)))
    return all(torch.equal(torch._int_mm(a, b).long(), a.long() @ b.long()) for a, b in pairs)


@functools.lru_cache(maxsize=1)
def int_mm_pays() -> bool:
    """Whether ``int_mm`` should call ``torch._int_mm`` on this CPU: it is exact here and beats
    an fp32 GEMM (it needs VNNI-class int8 dot products; without them PyTorch's CPU fallback
    ran ~20x slower than fp32 on a 2-core EPYC). Timed once per process on a 64 x 512 x 512
    product; the choice never changes results."""
    if not int_mm_exact():
        return False
    a = torch.randint(-127, 128, (64, 512), dtype=torch.int8)
    b = torch.randint(-127, 128, (512, 512), dtype=torch.int8)

    def best(fn) -> float:
        fn()
        times = []
        for _ in range(3):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return min(times)

    return best(lambda: torch._int_mm(a, b)) < best(lambda: a.float() @ b.float())


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
