"""SmoothQuant W8A8: smoothing moves activation outliers into the weights."""
from __future__ import annotations

import pytest
import torch

from kvforge.quant.smoothquant import SmoothQuantConfig
from kvforge.quant.smoothquant import smoothing_scales
from tests.quant.factories import make_linear, outlier_activations, random_weight, rel_err

OUTLIERS = [5, 30, 77]


def calibrated(w, x_calib, bias=None, alpha=0.5):
    config = SmoothQuantConfig(alpha=alpha)
    layer = make_linear(w, config.get_linear_method("model.layers.0.mlp.down_proj"), bias)
    config.calibrate_layer(layer, [x_calib])
    return layer, config


def naive_w8a8(x, w):
    """Reference W8A8 without smoothing: per-token x and per-row W rounded to 127 levels."""
    xs = x.abs().amax(1, keepdim=True) / 127
    ws = w.abs().amax(1, keepdim=True) / 127
    return (torch.round(x / xs) * xs) @ (torch.round(w / ws) * ws).t()


def test_smoothing_scale_formula():
    s = smoothing_scales(torch.tensor([4.0, 0.0, 9.0]), torch.tensor([1.0, 2.0, 0.25]), 0.5)
    torch.testing.assert_close(s, torch.tensor([2.0, 1.0, 6.0]))   # sqrt(a) / sqrt(w), 1 if a=0


def test_matches_dequantize_then_matmul_reference():
    w, b = random_weight(48, 96), torch.randn(48)
    x = outlier_activations(12, 96, OUTLIERS)
    layer, config = calibrated(w, x, bias=b)
    s = config.calibration_state()["model.layers.0.mlp.down_proj"]["scales"]
    # reference from the formula, written out: x / s per token, W * s per row, 127 levels
    xs_, ws_ = x / s, w * s
    xstep = xs_.abs().amax(1, keepdim=True) / 127
    wstep = ws_.abs().amax(1, keepdim=True) / 127
    expected = (torch.round(xs_ / xstep) * xstep) @ (torch.round(ws_ / wstep) * wstep).t() + b
    torch.testing.assert_close(layer(x), expected, rtol=1e-4, atol=1e-4)
    assert layer.qweight_t.dtype == torch.int8 and "weight" not in layer._parameters


def test_close_to_fp32_and_better_than_naive_w8a8_on_held_out_activations():
    w = random_weight(128, 256)
    calib = outlier_activations(64, 256, OUTLIERS, outlier_scale=50.0, seed=1)
    held_out = outlier_activations(32, 256, OUTLIERS, outlier_scale=50.0, seed=2)
    layer, _ = calibrated(w, calib)
    exact = held_out @ w.t()
    err_smooth, err_naive = rel_err(layer(held_out), exact), rel_err(naive_w8a8(held_out, w), exact)
    assert err_smooth < 0.02
    assert err_smooth < err_naive / 2


def test_uncalibrated_layer_refuses_to_run():
    config = SmoothQuantConfig()
    layer = make_linear(random_weight(8, 16), config.get_linear_method("x"))
    with pytest.raises(RuntimeError, match="before calibration"):
        layer(torch.randn(2, 16))


def test_bad_alpha_rejected():
    with pytest.raises(ValueError, match="alpha"):
        SmoothQuantConfig(alpha=1.5)
