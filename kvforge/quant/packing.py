"""Integer weight formats and their round-to-nearest (RTN) quantizers.

Two storage formats, each with a portable form (what we save) and a kernel form (what runs):

INT8 per output channel, symmetric:   W[n, k] ~= q[n, k] * scale[n],   q in [-127, 127]
    kernel: ``torch._weight_int8pack_mm(x, q[N, K] int8, scale[N])``

INT4 group-wise, asymmetric (group of G input channels, one scale + zero per row per group):

    W[n, k] ~= (q[n, k] - 8) * scale[n, k // G] + zero[n, k // G],   q in [0, 15]

    the "- 8" is the convention of PyTorch's CPU int4 kernel (checked against a dequantize-
    then-matmul reference in tests): ``zero`` is the value of code 8, not the group minimum.
    A group's minimum ``lo`` with step ``s`` gives zero = lo + 8 s.
    portable: codes nibble-packed row-major [N, Kp / 2] uint8, byte j = q[2j] | q[2j+1] << 4
    kernel:   ``torch._convert_weight_to_int4pack_for_cpu(q int32 [N, Kp], 1)`` -> a blocked
              [N, Kp / 2] uint8 layout whose interleave depends on N and K (not documented);
              ``unpack_int4_kernel`` inverts it by packing the digits of an index matrix.

Both CPU kernels are only fast with bfloat16 activations (fp32 input takes a scalar path, many
times slower), and then they require bfloat16 scales. So scales and
zeros are stored as bf16 and codes are chosen *after* rounding them, which keeps RTN optimal
for the parameters that actually run. ``Kp`` is K padded up to a multiple of G (e.g. 576 with
G = 128 -> 640): padded weight columns are never read because padded activations are zero.
"""
from __future__ import annotations

from functools import lru_cache

import torch
import torch.nn.functional as F

INT4_GROUP_SIZES = (32, 64, 128)


def check_int4_group_size(group_size: int) -> int:
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"int4 group_size must be one of {INT4_GROUP_SIZES}, got {group_size!r}")
    return group_size
INT4_KERNEL_ROWS = 16
SCALE_DTYPE = torch.bfloat16


def padded_in_features(in_features: int, group_size: int) -> int:
    return -(-in_features // group_size) * group_size


# ---------------------------------------------------------------------------------------- int8
def quantize_int8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] float -> (q [N, K] int8, scale [N] bf16) with w ~= q * scale."""
    w = w.float()
    scale = (w.abs().amax(dim=1) / 127.0).to(SCALE_DTYPE)
    s = scale.float()
    safe = torch.where(s > 0, s, torch.ones_like(s))
    q = torch.round(w / safe[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale.float()[:, None]


# ---------------------------------------------------------------------------------------- int4
def int4_groups(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """w [N, K] -> float32 view [N, Kp/G, G], K padded by repeating the last column."""
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"int4 group_size must be one of {INT4_GROUP_SIZES}, got {group_size!r}")
    w = w.float()
    n, k = w.shape
    kp = padded_in_features(k, group_size)
    if kp != k:   # replicate the last column so padding never widens a group's range
        w = F.pad(w[None], (0, kp - k), mode="replicate")[0]
    return w.view(n, kp // group_size, group_size)


def int4_group_range(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (min, max) of each group, [N, Kp/G] float32 (padding as in the quantizer)."""
    g = int4_groups(w, group_size)
    return g.amin(dim=-1), g.amax(dim=-1)


def quantize_int4_groupwise(w: torch.Tensor, group_size: int,
                            group_range: tuple[torch.Tensor, torch.Tensor] | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] float -> (codes [N, Kp] uint8 in 0..15, scale [N, Kp/G] bf16, zero same).

    Asymmetric RTN per group: step s = (max - min) / 15, zero = min + 8 s (the kernel's code-8
    convention). A group that is constant gets s = 0 and zero = its value (codes all 8).
    ``group_range`` = (lo, hi) [N, Kp/G] replaces each group's (min, max), e.g. a clipped range
    (AWQ): weights outside it get the end codes 0 / 15.
    """
    g = int4_groups(w, group_size)
    n, kp = g.shape[0], g.shape[1] * group_size
    if group_range is None:
        lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    else:
        lo, hi = group_range[0].float(), group_range[1].float()
    if lo.shape != g.shape[:2] or hi.shape != g.shape[:2]:
        raise ValueError(f"group_range of shape {tuple(lo.shape)}, {tuple(hi.shape)} does not "
                         f"match the {tuple(g.shape[:2])} groups of the weight")
    scale = ((hi - lo) / 15.0).to(SCALE_DTYPE)
    s = scale.float()
    zero = torch.where(s > 0, lo + 8.0 * s, lo).to(SCALE_DTYPE)
    safe = torch.where(s > 0, s, torch.ones_like(s))
    codes = torch.round((g - zero.float()[..., None]) / safe[..., None] + 8.0)
    codes = torch.where(s[..., None] > 0, codes, torch.full_like(codes, 8.0))
    codes = codes.clamp_(0, 15).to(torch.uint8).reshape(n, kp)
    return codes, scale.contiguous(), zero.contiguous()


def dequantize_int4(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                    in_features: int | None = None) -> torch.Tensor:
    """codes [N, Kp] (0..15), scale/zero [N, Kp/G] -> W [N, in_features] float32."""
    n, kp = codes.shape
    groups = scale.shape[1]
    g = codes.float().view(n, groups, kp // groups)
    w = ((g - 8.0) * scale.float()[..., None] + zero.float()[..., None]).view(n, kp)
    return w[:, :in_features] if in_features is not None else w


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """[N, K] codes 0..15 -> [N, K/2] uint8, even column in the low nibble (portable form)."""
    if codes.shape[-1] % 2:
        raise ValueError(f"int4 packing needs an even number of columns, got {codes.shape[-1]}")
    c = codes.to(torch.uint8)
    return c[:, 0::2] | (c[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of ``pack_int4``: [N, K/2] uint8 -> [N, K] uint8 codes."""
    return torch.stack([packed & 15, packed >> 4], dim=-1).view(packed.shape[0], -1)


def padded_out_features(out_features: int) -> int:
    """Rows the CPU int4 kernel is given: it packs rows in blocks of 16 (N % 16 != 0 raises)."""
    return -(-out_features // INT4_KERNEL_ROWS) * INT4_KERNEL_ROWS


def pack_int4_kernel(codes: torch.Tensor) -> torch.Tensor:
    """[N, Kp] codes -> the CPU kernel's packed layout [Np, Kp / 2], N padded to a multiple of 16
    with rows of code 8 (their outputs are sliced off: see ``padded_out_features``)."""
    n = codes.shape[0]
    codes = codes.to(torch.int32)
    if padded_out_features(n) != n:
        codes = F.pad(codes, (0, 0, 0, padded_out_features(n) - n), value=8)
    return torch._convert_weight_to_int4pack_for_cpu(codes.contiguous(), 1)


@lru_cache(maxsize=16)
def _kernel_slot_sources(n: int, k: int) -> torch.Tensor:
    """For each nibble slot of the kernel layout (low nibble first), the flat index n*K + k of
    the code it holds. Found by packing the base-16 digits of an index matrix: the packer is a
    pure permutation of nibbles, so digit d of slot j is digit d of its source index."""
    index = torch.arange(n * k, dtype=torch.int64).view(n, k)
    sources = torch.zeros(n * k, dtype=torch.int64)
    digits = max(1, ((n * k - 1).bit_length() + 3) // 4)
    for d in range(digits):
        packed = pack_int4_kernel((index >> (4 * d)) & 15)
        sources |= unpack_int4(packed).reshape(-1).to(torch.int64) << (4 * d)
    return sources


def unpack_int4_kernel(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Kernel layout -> [N, K] uint8 codes (used when saving; never on the forward path)."""
    rows = packed.shape[0]                      # N padded to the kernel's multiple of 16
    codes = torch.empty(rows * k, dtype=torch.uint8)
    codes[_kernel_slot_sources(rows, k)] = unpack_int4(packed).reshape(-1)
    return codes.view(rows, k)[:n]
