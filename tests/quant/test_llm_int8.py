"""LLM.int8(): int8 x int8 for regular features, fp32 for outlier features."""
from __future__ import annotations

import pytest
import torch

from kvforge.quant.llm_int8 import LLMInt8Config
from tests.quant.factories import make_linear, outlier_activations, random_weight, rel_err

OUTLIERS = [3, 17, 50]


def representable_weight(out_features: int, in_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """W whose rows are exactly int8 codes times a per-row scale (max code 127): int8 storage
    loses nothing, so any error left comes from the activations."""
    g = torch.Generator().manual_seed(5)
    codes = torch.randint(-127, 128, (out_features, in_features), generator=g).float()
    codes[:, 0] = 127.0
    scale = torch.rand(out_features, generator=g) * 0.01 + 0.001
    return codes * scale[:, None], scale


def reference(x: torch.Tensor, w: torch.Tensor, outlier_cols: list[int]) -> torch.Tensor:
    """Dequantize-then-matmul: regular features rounded per token to 127 levels, outlier
    features and W as given (W representable)."""
    regular = x.clone()
    regular[:, outlier_cols] = 0.0
    step = regular.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 127
    x_deq = torch.round(regular / step) * step
    x_deq[:, outlier_cols] = x[:, outlier_cols]
    return x_deq.double() @ w.double().t()


def test_matches_dequantize_then_matmul_reference():
    w, _ = representable_weight(40, 64)
    layer = make_linear(w, LLMInt8Config().get_linear_method("m.down_proj"))
    x = outlier_activations(11, 64, OUTLIERS, outlier_scale=20.0)
    y = layer(x)
    torch.testing.assert_close(y.double(), reference(x, w, OUTLIERS), rtol=1e-4, atol=1e-4)


def test_outlier_features_are_exact():
    """Only outlier features non-zero: the whole product runs in fp32 on the stored weight."""
    w, _ = representable_weight(32, 64)
    layer = make_linear(w, LLMInt8Config(threshold=6.0)
                        .get_linear_method("x"))
    x = torch.zeros(5, 64)
    x[:, OUTLIERS] = torch.tensor([[7.3, -100.125, 9.0]]) * torch.arange(1, 6)[:, None]
    torch.testing.assert_close(layer(x).double(), x.double() @ w.double().t(),
                               rtol=1e-6, atol=1e-5)


def test_decomposition_beats_plain_w8a8_on_outlier_activations():
    w = random_weight(96, 128)
    x = outlier_activations(16, 128, OUTLIERS, outlier_scale=60.0)
    exact = x @ w.t()
    with_outliers = make_linear(w, LLMInt8Config().get_linear_method("x"))
    plain = make_linear(w, LLMInt8Config(threshold=1e9).get_linear_method("x"))
    err_decomposed, err_plain = rel_err(with_outliers(x), exact), rel_err(plain(x), exact)
    assert err_decomposed < 0.01
    assert err_decomposed < err_plain / 3


def test_bias_leading_dims_and_storage():
    w, b = random_weight(24, 32), torch.randn(24)
    layer = make_linear(w, LLMInt8Config().get_linear_method("x"), bias=b)
    assert "weight" not in layer._parameters and layer.qweight_t.dtype == torch.int8
    x = torch.randn(2, 3, 32)
    y = layer(x)
    assert y.shape == (2, 3, 24)
    assert rel_err(y, x @ w.t() + b) < 0.02


def test_lm_head_stays_float_and_bad_threshold_rejected():
    assert LLMInt8Config().get_linear_method("lm_head") is None
    with pytest.raises(ValueError, match="threshold"):
        LLMInt8Config(threshold=0)
