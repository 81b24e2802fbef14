"""FP8 (E4M3) weight storage with per-output-channel scales."""
from __future__ import annotations

import pytest
import torch

from kvforge.quant.fp8 import FP8Config
from tests.quant.factories import make_linear, random_weight, rel_err


def test_matches_dequantize_then_matmul_reference_across_tiles():
    w, b = random_weight(100, 48), torch.randn(100)
    layer = make_linear(w, FP8Config(tile_cols=32).get_linear_method("x"), bias=b)  # 4 tiles
    assert layer.weight_fp8_t.dtype == torch.float8_e4m3fn and "weight" not in layer._parameters
    scale = w.abs().amax(1) / 448                        # reference: written from the format
    w_deq = (w / scale[:, None]).to(torch.float8_e4m3fn).float() * scale[:, None]
    x = torch.randn(7, 48)
    torch.testing.assert_close(layer(x), x @ w_deq.t() + b, rtol=1e-5, atol=1e-5)


def test_fp8_error_bounded_by_e4m3_precision():
    w = random_weight(64, 64)
    layer = make_linear(w, FP8Config().get_linear_method("x"))
    x = torch.randn(5, 64)
    # 3 mantissa bits: each weight within 2^-4 relative (normal range); the product much less
    assert rel_err(layer(x), x @ w.t()) < 2 ** -4
    w_deq = layer.weight_fp8_t.float().t() * layer.weight_scale[:, None]
    big = w.abs() > w.abs().amax(1, keepdim=True) * 2 ** -6     # normals of each row
    assert torch.all(((w_deq - w).abs() <= w.abs() * 2 ** -4 + 1e-12)[big])


def test_bf16_activations_and_bad_tile():
    w = random_weight(16, 32)
    layer = make_linear(w, FP8Config().get_linear_method("x"))
    y = layer(torch.randn(3, 32, dtype=torch.bfloat16))
    assert y.dtype == torch.bfloat16 and y.shape == (3, 16)
    assert FP8Config().get_linear_method("lm_head") is None
    with pytest.raises(ValueError, match="tile_cols"):
        FP8Config(tile_cols=0)
