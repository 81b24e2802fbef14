"""AWQ: activation-aware scaling beats plain INT4 RTN on layers with salient input channels."""
from __future__ import annotations

import torch

from kvforge.quant import packing
from kvforge.quant.awq import search_awq_scales
from kvforge.quant.awq import AWQConfig
from tests.quant.factories import make_linear, outlier_activations, random_weight, rel_err

OUTLIERS = [2, 40, 99, 130]


def rtn_reference(x, w, group_size):
    codes, scale, zero = packing.quantize_int4_groupwise(w, group_size)
    return x @ packing.dequantize_int4(codes, scale, zero, w.shape[1]).t()


def test_awq_output_error_below_rtn_on_calibration_and_held_out_activations():
    w = random_weight(96, 192)
    calib = outlier_activations(128, 192, OUTLIERS, outlier_scale=20.0, seed=1)
    held_out = outlier_activations(64, 192, OUTLIERS, outlier_scale=20.0, seed=2)
    config = AWQConfig(group_size=64)
    layer = make_linear(w, config.get_linear_method("model.layers.0.mlp.down_proj"))
    config.calibrate_layer(layer, [calib])
    assert layer.method.ratio > 0                   # the search moved away from s = 1 (RTN)
    for x in (calib, held_out):
        exact = x @ w.t()
        err_awq, err_rtn = rel_err(layer(x), exact), rel_err(rtn_reference(x, w, 64), exact)
        assert err_awq < 0.8 * err_rtn, (err_awq, err_rtn)


def test_awq_layer_matches_dequantize_then_matmul_reference():
    w, b = random_weight(64, 128), torch.randn(64)
    x = outlier_activations(16, 128, OUTLIERS[:2])
    config = AWQConfig(group_size=32)
    layer = make_linear(w, config.get_linear_method("x"), bias=b)
    config.calibrate_layer(layer, [x])
    s = config.calibration_state()["x"]
    codes, scale, zero = packing.quantize_int4_groupwise(w * s, 32)
    expected = (x / s) @ packing.dequantize_int4(codes, scale, zero, 128).t() + b
    # the packed kernel multiplies in bf16: tolerance of bf16 activations
    assert rel_err(layer(x), expected) < 1e-2


def test_ratio_zero_is_plain_rtn():
    """With grid=1 only ratio 0 (s = 1) is tried: the search result is exactly RTN's error."""
    w, x = random_weight(32, 64), torch.randn(20, 64)
    s, ratio, mse = search_awq_scales(w, x, x.abs().mean(0), 32, grid=1)
    assert ratio == 0.0 and torch.allclose(s, torch.ones(64))
    assert abs(mse - float((rtn_reference(x, w, 32) - x @ w.t()).pow(2).mean())) < 1e-9
