"""Fused decode-step ops: the compiled kernel when it applies, else the same math in PyTorch.

A kernel applies to fp32 CPU tensors with the layouts below; anything else (bf16, CUDA, odd
strides) takes the PyTorch path, which is also the reference the kernel tests compare against.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from kvforge.kernels import cpu_kernels
from kvforge.kernels.tune import tuned_kernel_rows


_FP32 = torch.float32


# the K/V element types the compiled decode attention and decode stack read
KERNEL_KV_DTYPES = (torch.float32, torch.float8_e4m3fn, torch.float8_e5m2)


def _kernel_for(*tensors: torch.Tensor):
    # called per layer per step: plain attribute checks only (no device objects, no generators)
    for t in tensors:
        if t.dtype is not _FP32 or not t.is_cpu:
            return None
    return cpu_kernels()


def _rows_ok(x: torch.Tensor) -> bool:
    """2-D with contiguous rows (any row stride)."""
    return x.dim() == 2 and x.stride(1) == 1


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual) * weight, x + residual)`` over the last dim (fp32 statistics).
    Without ``residual`` the second result is ``x`` itself."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    r2 = None if residual is None else residual.reshape(-1, shape[-1])
    ops = _kernel_for(x2, weight, *(() if r2 is None else (r2,)))
    if (ops is not None and _rows_ok(x2) and weight.is_contiguous()
            and (r2 is None or _rows_ok(r2))):
        y, total = ops.add_rms_norm(x2, r2, weight, eps)
        return y.view(shape), (x if residual is None else total.view(shape))
    total = x if residual is None else x + residual
    y = F.rms_norm(total.float(), (shape[-1],), None, eps).to(total.dtype) * weight
    return y, total


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up = [gate | up]`` along the last dim."""
    shape = gate_up.shape
    g2 = gate_up.reshape(-1, shape[-1])
    ops = _kernel_for(g2)
    if ops is not None and _rows_ok(g2) and shape[-1] % 2 == 0:
        return ops.silu_and_mul(g2).view(*shape[:-1], shape[-1] // 2)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rotary_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [T, heads, D] with the [cos | cos] / [-sin | sin] tables gathered per token
    ([T, 1, D]); returns a new contiguous [T, heads, D]."""
    ops = _kernel_for(x, cos, sin)
    if (ops is not None and x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]
            and cos.shape[-1] == x.shape[-1] and cos.stride(-1) == 1 and sin.stride(-1) == 1):
        return ops.rotary_neox(x, cos.reshape(x.shape[0], -1), sin.reshape(x.shape[0], -1))
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin)


def argmax_last_dim(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` of a [rows, vocab] tensor: the first index of each row's
    maximum (a NaN counts as the maximum). fp32 CPU rows take the compiled kernel (torch's CPU
    argmax is a scalar loop: ~60-85 us per 49k-entry row, the kernel ~7 us)."""
    if logits.dim() == 2 and logits.shape[1] > 0 and logits.stride(1) == 1:
        ops = _kernel_for(logits)
        if ops is not None:
            return ops.argmax_rows(logits)
    return logits.argmax(dim=-1)


def paged_decode_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor,
                           scale: float, window: int = 0) -> torch.Tensor | None:
    """One query per sequence attending over its paged context (``window`` > 0: over its last
    ``window`` keys, a sliding window); fp32 q, fp32 or fp8 caches (``quant/fp8_kv.py``, read
    as their exact float values); None when the kernel does not apply (the caller then runs
    its gather + SDPA path)."""
    ops = _kernel_for(q)
    if (ops is None or key_cache.dtype not in KERNEL_KV_DTYPES or not key_cache.is_cpu
            or value_cache.dtype is not key_cache.dtype or not value_cache.is_cpu
            or q.stride(2) != 1 or q.shape[1] % key_cache.shape[2]
            or key_cache.stride(3) != 1 or value_cache.stride(3) != 1
            or block_tables.dtype != torch.int64 or seq_lens.dtype != torch.int64
            or block_tables.stride(1) != 1 or not seq_lens.is_contiguous()):
        return None
    return ops.paged_decode_attention(q, key_cache, value_cache, block_tables, seq_lens, scale,
                                      window)


# rows the compiled linear kernel is used for (csrc/kernels.h: kLinearRowsMin..kLinearRowsMax);
# F.linear is faster for longer prefill chunks
LINEAR_ROWS_MIN, LINEAR_ROWS_MAX = 1, 256


def single_pass_rows(device: torch.device, dtype: torch.dtype) -> int | None:
    """Rows an fp32 CPU projection multiplies in one pass over its weights: the compiled
    kernel's few-rows register tile (8 with AVX-512, 4 with AVX2), or 2 on MKL alone (its
    ``W @ x^T`` reads W once for 1-2 rows); None elsewhere (no such limit known)."""
    if torch.device(device).type != "cpu" or dtype is not _FP32:
        return None
    ops = cpu_kernels()
    return 2 if ops is None else int(ops.linear_few_rows_max)


def linear_rows(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """``x [M, K] @ weight[N, K]^T`` by the compiled register-tiled kernel where it is the
    faster one: the machine's tuned choice for this shape and M (kernels/tune.py), untuned
    LINEAR_ROWS_MIN <= M <= LINEAR_ROWS_MAX; None when it does not apply (caller uses MKL)."""
    tuned = tuned_kernel_rows(x.shape[1], weight.shape[0], x.shape[0])
    if tuned is False or (tuned is None and not LINEAR_ROWS_MIN <= x.shape[0] <= LINEAR_ROWS_MAX):
        return None
    ops = _kernel_for(x, weight)
    if ops is None or x.stride(1) != 1 or not weight.is_contiguous():
        return None
    return ops.linear_rows(x, weight)


# ---- the packed weight layout of csrc/linear.cpp -------------------------------------------
#
#   W [N, K] (N padded with zero rows to a multiple of R = pack_rows, K a multiple of L = lanes)
#     -> packed [N / R, K / L, R, L]:   packed[g, kb, j, :] = W[g * R + j, kb * L : (kb + 1) * L]
#
# The compiled kernels take K-major panels, L = 1 and R = 32 (AVX-512, 2 vectors) or 24 (AVX2,
# 3 vectors): one k step of the outer-product tile reads R adjacent floats, so the kernel
# streams W sequentially.

def packed_layout() -> tuple[int, int] | None:
    """(pack_rows, lanes) of the compiled kernel, or None without it."""
    ops = cpu_kernels()
    return None if ops is None else (int(ops.linear_pack_rows), int(ops.linear_pack_lanes))


PACKED_WEIGHTS_ENV = "KVFORGE_PACKED_WEIGHTS"


def packing_pays() -> bool:
    """Whether layers should be packed: by default yes, the packed kernel being each build's
    faster one (K-major panels multiplied in outer-product form: 1.1-1.3x the row-major tiles
    from 16 rows, even at 1-8; csrc/linear.cpp).
    ``KVFORGE_PACKED_WEIGHTS=1`` / ``0`` forces it either way (the row-major kernel runs on
    every ISA, so the tests can run both paths on any CPU)."""
    ops = cpu_kernels()
    if ops is None:
        return False
    forced = os.environ.get(PACKED_WEIGHTS_ENV, "auto").strip().lower()
    if forced in ("1", "on", "true", "yes"):
        return True
    if forced in ("0", "off", "false", "no"):
        return False
    if forced not in ("", "auto"):
        raise ValueError(f"{PACKED_WEIGHTS_ENV}={forced!r}: use auto, 1 or 0")
    return bool(ops.linear_packing_pays)


def packed_shape(weight: torch.Tensor) -> tuple[int, int, int, int] | None:
    """The packed layout's shape for ``weight`` [N, K], or None when the kernel cannot take it
    (no compiled kernels, not fp32 on CPU, K not a multiple of the lanes)."""
    layout = packed_layout()
    if layout is None or weight.dim() != 2 or weight.dtype is not _FP32 or not weight.is_cpu:
        return None
    rows, lanes = layout
    n, k = weight.shape
    if k % lanes:
        return None
    return -(-n // rows), k // lanes, rows, lanes


def pack_linear_weight(weight: torch.Tensor, out: torch.Tensor | None = None
                       ) -> torch.Tensor | None:
    """``weight`` [N, K] in the packed layout (written into ``out``, a contiguous tensor of
    ``packed_shape(weight)``, when given), or None when the kernel cannot take it."""
    shape = packed_shape(weight)
    if shape is None:
        return None
    groups, k_blocks, rows, lanes = shape
    padded = F.pad(weight, (0, 0, 0, groups * rows - weight.shape[0]))
    packed = padded.view(groups, rows, k_blocks, lanes).permute(0, 2, 1, 3)
    if out is None:
        return packed.contiguous()
    if tuple(out.shape) != shape or not out.is_contiguous() or out.dtype is not _FP32:
        raise ValueError(f"out must be a contiguous fp32 tensor of shape {shape}, got "
                         f"{tuple(out.shape)} {out.dtype}")
    return out.copy_(packed)


def unpack_linear_weight(packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """The row-major [out_features, K] weight back from its packed layout (a new tensor)."""
    groups, k_blocks, rows, lanes = packed.shape
    row_major = packed.permute(0, 2, 1, 3).reshape(groups * rows, k_blocks * lanes)
    return row_major[:out_features].contiguous()


def linear_packed(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor | None:
    """``x [M, K] @ W^T`` over W's packed layout for LINEAR_ROWS_MIN <= M <= LINEAR_ROWS_MAX;
    None when it does not apply (the caller unpacks for MKL)."""
    if not LINEAR_ROWS_MIN <= x.shape[0] <= LINEAR_ROWS_MAX:
        return None
    ops = _kernel_for(x, packed)
    if ops is None or x.stride(1) != 1:
        return None
    return ops.linear_packed(x, packed, out_features)


def packed_rows(packed: torch.Tensor, ids: torch.Tensor, out_features: int) -> torch.Tensor:
    """Rows ``ids`` (any shape) of a packed [out_features, K] weight: ``[*ids.shape, K]``. An
    id outside [0, out_features) raises IndexError."""
    flat = ids.reshape(-1)
    ops = cpu_kernels()
    if ops is not None and packed.is_cpu and packed.dtype is _FP32 and flat.dtype == torch.int64:
        try:
            rows = ops.packed_rows(packed, flat.contiguous(), out_features)
        except RuntimeError as exc:                     # the kernel's bounds check
            raise IndexError(str(exc).splitlines()[0]) from None
    else:
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= out_features):
            raise IndexError(f"token id out of range [0, {out_features}): "
                             f"min {int(flat.min())}, max {int(flat.max())}")
        group = packed.shape[2]
        rows = packed[flat // group, :, flat % group, :]          # [T, K / L, L]
    return rows.reshape(*ids.shape, packed.shape[1] * packed.shape[3])


INT8_DOT_ENV = "KVFORGE_INT8_DOT"
# KVFORGE_INT8_DOT name -> the kernel's code (csrc/kernels.h, Int8Dot)
INT8_DOTS = {"maddubs": 0, "avxvnni": 1, "avx512vnni": 2}


def int8_dot_setting() -> str:
    """``KVFORGE_INT8_DOT`` checked: auto, vnni or a name of ``INT8_DOTS`` (ValueError naming
    the value otherwise). Read where a W8A8 model is configured, so a typo fails there."""
    wanted = os.environ.get(INT8_DOT_ENV, "auto").strip().lower() or "auto"
    if wanted not in ("auto", "vnni", *INT8_DOTS):
        raise ValueError(f"{INT8_DOT_ENV}={wanted!r} is not one of auto, vnni, "
                         f"{', '.join(INT8_DOTS)}")
    return wanted


def int8_dot() -> int | None:
    """The int8 dot instruction the integer kernels use (the W8A8 GEMM, csrc/w8a8_gemm.cpp, and
    the GGUF dot kernels, csrc/gguf_dot.cpp), or None without compiled kernels.
    ``KVFORGE_INT8_DOT``: ``auto`` (default: VNNI's vpdpbusd / vpdpwssd where this CPU has
    them, else AVX2's maddubs + madd), ``vnni`` (either VNNI, an error without one), or one by
    name: ``maddubs`` (every AVX2 CPU: what the tests run everywhere), ``avxvnni``,
    ``avx512vnni``. The GGUF dots give the same outputs with each."""
    wanted = int8_dot_setting()
    ops = cpu_kernels()
    if ops is None:
        return None
    vnni = [INT8_DOTS[name] for name in ("avxvnni", "avx512vnni")
            if ops.int8_dot_supported(INT8_DOTS[name])]
    if wanted == "auto":
        return vnni[0] if vnni else INT8_DOTS["maddubs"]
    if wanted == "vnni":
        if not vnni:
            raise RuntimeError(f"{INT8_DOT_ENV}=vnni: this CPU (or kernel build) has no VNNI")
        return vnni[0]
    if not ops.int8_dot_supported(INT8_DOTS[wanted]):
        raise RuntimeError(f"{INT8_DOT_ENV}={wanted}: this CPU (or kernel build) lacks it")
    return INT8_DOTS[wanted]


def pack_w8a8_panels(codes: torch.Tensor, scales: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """int8 ``codes`` [N, Kp] and ``scales`` [N, Kp / G] (one per output row and group of G
    inputs) in the W8A8 kernel's panels of 8 output columns (csrc/w8a8_gemm.cpp; rows past N
    zero): codes [panels, Kp / 4, 8, 4] (k step t of column c: 4 bytes), scales and
    code_sums (128 x each group's codes summed, VNNI's offset) [panels, Kp / G, 8]:

        codes[8p + c, 4t : 4t + 4]  ->  panel_codes[p, t, c, :]   (one 32-byte vector per
                                                                   k step t: 8 columns x 4)
        scales[8p + c, g]           ->  panel_scales[p, g, c]     (8 columns' scales of group g)
    """
    n, kp = codes.shape
    groups = scales.shape[1]
    panels = -(-n // 8)
    padded = F.pad(codes, (0, 0, 0, panels * 8 - n))
    panel_codes = padded.view(panels, 8, kp // 4, 4).permute(0, 2, 1, 3).contiguous()
    panel_scales = F.pad(scales.float(), (0, 0, 0, panels * 8 - n)).view(
        panels, 8, groups).permute(0, 2, 1).contiguous()
    sums = padded.view(panels, 8, groups, kp // groups).sum(-1, dtype=torch.int32) * 128
    return panel_codes, panel_scales, sums.permute(0, 2, 1).contiguous()


def unpack_w8a8_panels(panel_codes: torch.Tensor, panel_scales: torch.Tensor,
                       out_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``pack_w8a8_panels`` undone: (codes [N, Kp], scales [N, Kp / G]), new tensors."""
    panels, steps, _, _ = panel_codes.shape
    codes = panel_codes.permute(0, 2, 1, 3).reshape(panels * 8, steps * 4)
    scales = panel_scales.permute(0, 2, 1).reshape(panels * 8, panel_scales.shape[1])
    return codes[:out_features].contiguous(), scales[:out_features].contiguous()


def w8a8_projection(panel_codes: torch.Tensor, panel_scales: torch.Tensor,
                    code_sums: torch.Tensor, out_features: int, in_features: int,
                    bias: torch.Tensor | None = None):
    """The compiled W8A8 projection (csrc/w8a8_gemm.cpp) over ``pack_w8a8_panels``' tensors
    (held, not copied), or None without compiled kernels. Its ``forward(x, act_groups, dot)``
    takes fp32 [T, in_features] on CPU."""
    ops = cpu_kernels()
    if ops is None:
        return None
    return ops.W8A8Projection(panel_codes, panel_scales, code_sums, out_features, in_features,
                              None if bias is None else bias.float().contiguous())


def w8a8_kernel_applies(device: torch.device, group_width: int) -> bool:
    """Whether a W8A8 layer on ``device`` with groups of ``group_width`` inputs runs the
    compiled kernel: CPU, kernels built, and the group a whole number of k steps of 4."""
    return device.type == "cpu" and group_width % 4 == 0 and cpu_kernels() is not None
