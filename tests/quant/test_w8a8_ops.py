"""INT8 building blocks: torch._int_mm on CPU and the per-channel / per-token quantizers."""
from __future__ import annotations

import pytest
import torch

from kvforge.quant import w8a8_ops
from kvforge.quant.w8a8_ops import (dequantize_weight, exact_float_matmul, int8_matmul, int_mm,
                                    padded_int_mm, quantize_per_token,
                                    quantize_weight_per_channel)


@pytest.mark.parametrize("m,k,n", [(1, 64, 64), (5, 7, 3), (17, 96, 33), (32, 576, 128)])
def test_int_mm_is_exact_int32_accumulation_for_any_shape(m, k, n):
    g = torch.Generator().manual_seed(m * k + n)
    a = torch.randint(-127, 128, (m, k), dtype=torch.int8, generator=g)
    b = torch.randint(-127, 128, (k, n), dtype=torch.int8, generator=g)
    out = int_mm(a, b)
    assert out.dtype == torch.int32
    assert torch.equal(out.long(), a.long() @ b.long())
    if w8a8_ops.int_mm_exact():
        # the zero-padded form other devices take (cuBLAS shapes), run here on the CPU's
        # torch._int_mm (where that is exact: not oneDNN's AVX2 kernel without VNNI)
        padded = padded_int_mm(a, b)
        assert padded.shape == (m, n) and torch.equal(padded, out)


@pytest.mark.parametrize("k", [64, 1500])
@pytest.mark.parametrize("pays", [True, False])
def test_int_mm_is_exact_where_int16_pair_sums_saturate(monkeypatch, k, pays):
    """All-127 and mixed-sign operands (the sums a saturating u8 x s8 kernel loses) and K past
    one exact fp32 slab: ``int_mm`` exact on either path it may take on this CPU
    (``torch._int_mm`` only where the probe found it exact)."""
    g = torch.Generator().manual_seed(k)
    a = torch.full((24, k), 127, dtype=torch.int8)
    a[1::2] = -127
    a[-4:] = torch.randint(-128, 128, (4, k), dtype=torch.int8, generator=g)
    b = torch.full((k, 16), 127, dtype=torch.int8)
    b[:, 8:] = torch.randint(-128, 128, (k, 8), dtype=torch.int8, generator=g)
    exact = a.long() @ b.long()
    monkeypatch.setattr(w8a8_ops, "int_mm_pays", lambda: pays and w8a8_ops.int_mm_exact())
    assert torch.equal(int_mm(a, b).long(), exact)
    assert torch.equal(exact_float_matmul(a, b).long(), exact)
    assert torch.equal(exact_float_matmul(a[None], b[None])[0].long(), exact)    # batched


def test_int_mm_exact_probe_tells_the_truth():
    """The probe's verdict is what torch._int_mm does on the operands it fears."""
    a, b = torch.full((24, 64), 127, dtype=torch.int8), torch.full((64, 8), 127, dtype=torch.int8)
    direct = torch.equal(torch._int_mm(a, b).long(), a.long() @ b.long())
    if not direct:
        assert not w8a8_ops.int_mm_exact() and not w8a8_ops.int_mm_pays()
    if w8a8_ops.int_mm_exact():
        assert direct


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
