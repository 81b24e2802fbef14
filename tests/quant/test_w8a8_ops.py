"""INT8 building blocks: torch._int_mm on CPU and the per-channel / per-token quantizers."""
from __future__ import annotations

import pytest
import torch

from kvforge.quant.w8a8_ops import (dequantize_weight, int8_matmul, padded_int_mm,
                                    quantize_per_token, quantize_weight_per_channel)


@pytest.mark.parametrize("m,k,n", [(1, 64, 64), (5, 7, 3), (17, 96, 33), (32, 576, 128)])
def test_int_mm_is_exact_int32_accumulation_for_any_shape(m, k, n):
    g = torch.Generator().manual_seed(m * k + n)
    a = torch.randint(-127, 128, (m, k), dtype=torch.int8, generator=g)
    b = torch.randint(-127, 128, (k, n), dtype=torch.int8, generator=g)
    out = torch._int_mm(a, b)
    assert out.dtype == torch.int32
    assert torch.equal(out.long(), a.long() @ b.long())
    # the zero-padded form other devices take (cuBLAS shapes), run here on the CPU
    padded = padded_int_mm(a, b)
    assert padded.shape == (m, n) and torch.equal(padded, out)


def test_weight_quantization_error_is_half_a_step_per_row():
    w = torch.randn(48, 80)
    wq_t, scale = quantize_weight_per_channel(w)
    assert wq_t.shape == (80, 48) and wq_t.dtype == torch.int8 and wq_t.is_contiguous()
    assert int(wq_t.abs().max()) == 127          # each row's max hits the top code
    err = (dequantize_weight(wq_t, scale) - w).abs()
    assert torch.all(err <= scale[:, None] / 2 + 1e-6)


def test_per_token_quantization_handles_zero_rows():
    x = torch.randn(4, 16)
    x[2] = 0.0
    xq, scale = quantize_per_token(x)
    assert torch.all(xq[2] == 0) and torch.isfinite(scale).all()
    assert torch.all((xq.float() * scale[:, None] - x).abs() <= scale[:, None] / 2 + 1e-6)


def test_int8_matmul_matches_dequantized_reference():
    x, w = torch.randn(9, 64), torch.randn(40, 64)
    xq, xs = quantize_per_token(x)
    wq_t, ws = quantize_weight_per_channel(w)
    reference = (xq.float() * xs[:, None]) @ dequantize_weight(wq_t, ws).t()
    torch.testing.assert_close(int8_matmul(xq, xs, wq_t, ws), reference, rtol=1e-5, atol=1e-5)
