"""AWQ: activation-aware scaling + clipping never does worse than plain INT4 RTN on the
calibration activations, and beats it on layers with salient input channels."""
from __future__ import annotations

import pytest
import torch

from kvforge.layers.linear import Linear
from kvforge.quant import packing
from kvforge.quant.awq import AWQConfig, int4_fake_quantize, search_awq, search_clip
from kvforge.quant.int4 import Int4LinearMethod
from tests.quant.factories import make_linear, outlier_activations, random_weight, rel_err

OUTLIERS = [2, 40, 99, 130]


def rtn_reference(x, w, group_size):
    return x @ int4_fake_quantize(w, group_size).t()


def awq_reference(x, w, state, group_size):
    """(x / s) @ Q(W * s)^T with the layer's saved state, written out from packing.py."""
    s = state["scales"]
    codes, scale, zero = packing.quantize_int4_groupwise(w * s, group_size,
                                                         (state["clip_lo"], state["clip_hi"]))
    return (x / s) @ packing.dequantize_int4(codes, scale, zero, w.shape[1]).t()


def mse(a, b):
    return float((a - b).pow(2).mean())


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("in_features", [576, 192])
def test_awq_error_at_most_rtn_on_calibration_rows_at_the_same_group_size(group, in_features):
    w = random_weight(96, in_features)
    calib = outlier_activations(128, in_features, OUTLIERS, outlier_scale=20.0, seed=1)
    config = AWQConfig(group_size=group)
    layer = make_linear(w, config.get_linear_method("model.layers.0.mlp.down_proj"))
    config.calibrate_layer(layer, [calib])
    state = config.calibration_state()["model.layers.0.mlp.down_proj"]
    exact = calib @ w.t()
    # in the search's own arithmetic the guarantee is exact (RTN is one of the candidates) ...
    err_awq, err_rtn = mse(awq_reference(calib, w, state, group), exact), \
        mse(rtn_reference(calib, w, group), exact)
    assert err_awq <= err_rtn
    assert abs(err_awq - layer.method.search.mse) <= 1e-6 * err_awq
    # ... and with outlier channels it is a clear win, also through the bf16 kernel
    rtn_layer = make_linear(w, Int4LinearMethod(group))
    assert mse(layer(calib), exact) < 0.8 * mse(rtn_layer(calib), exact)


def test_awq_beats_rtn_on_held_out_activations():
    w = random_weight(96, 192)
    calib = outlier_activations(128, 192, OUTLIERS, outlier_scale=20.0, seed=1)
    held_out = outlier_activations(64, 192, OUTLIERS, outlier_scale=20.0, seed=2)
    config = AWQConfig(group_size=64)
    layer = make_linear(w, config.get_linear_method("x"))
    config.calibrate_layer(layer, [calib])
    assert layer.method.search.ratio > 0             # the search moved away from s = 1 (RTN)
    exact = held_out @ w.t()
    assert rel_err(layer(held_out), exact) < 0.8 * rel_err(rtn_reference(held_out, w, 64), exact)


@torch.inference_mode()
@pytest.mark.parametrize("group", [32, 64, 128])
def test_awq_layers_of_a_tiny_model_at_most_rtn_on_its_calibration_activations(
        tiny_model_factory, group):
    """Every linear of a random Llama, on the inputs it saw while calibrating (the float
    model's, since pending layers run float): AWQ's output error <= RTN's at the same group."""
    from kvforge.loader.source import load_model_source
    from kvforge.quant.calibration import calibration_token_batches, run_calibration_forward
    from kvforge.quant.loading import load_model
    hf_dir, _ = tiny_model_factory("llama")
    source = load_model_source(hf_dir)
    fp32 = load_model(source)
    inputs: dict[str, list[torch.Tensor]] = {}
    hooks = [m.register_forward_hook(lambda mod, inp, out, n=n: inputs.setdefault(n, []).append(
        inp[0].reshape(-1, mod.input_size).float())) for n, m in fp32.named_modules()
        if isinstance(m, Linear) and n != "lm_head"]
    run_calibration_forward(fp32, calibration_token_batches(source.load_tokenizer().encode))
    for h in hooks:
        h.remove()
    # keep every calibration row, so "calibration activations" are exactly what was searched
    awq = load_model(source, quantization="awq",
                     quantization_args={"group_size": group, "max_samples": 2048})
    awq_modules = dict(awq.named_modules())
    total_awq = total_rtn = 0.0
    for name, xs in inputs.items():
        x, w = torch.cat(xs), fp32.get_submodule(name).weight
        layer = awq_modules[name]
        assert x.shape[0] <= 2048
        exact = x @ w.t()
        deq = layer.method.inner.dequantize(layer)
        err_awq = mse((x * layer.awq_inv_scale) @ deq.t(), exact)
        err_rtn = mse(rtn_reference(x, w, group), exact)
        assert err_awq <= err_rtn * (1 + 1e-5), (name, err_awq, err_rtn)
        total_awq, total_rtn = total_awq + err_awq, total_rtn + err_rtn
    assert total_awq < 0.95 * total_rtn


def test_awq_layer_matches_dequantize_then_matmul_reference():
    w, b = random_weight(64, 128), torch.randn(64)
    x = outlier_activations(16, 128, OUTLIERS[:2])
    config = AWQConfig(group_size=32)
    layer = make_linear(w, config.get_linear_method("x"), bias=b)
    config.calibrate_layer(layer, [x])
    expected = awq_reference(x, w, config.calibration_state()["x"], 32) + b
    # the packed kernel multiplies in bf16: tolerance of bf16 activations
    assert rel_err(layer(x), expected) < 1e-2


def test_one_ratio_and_no_clipping_is_plain_rtn():
    w, x = random_weight(32, 64), torch.randn(20, 64)
    r = search_awq(w, x, x.abs().mean(0), 32, grid=1, max_shrink=0.0)
    assert r.ratio == 0.0 and not r.clipped and torch.equal(r.scales, torch.ones(64))
    assert abs(r.mse - mse(rtn_reference(x, w, 32), x @ w.t())) < 1e-9
    assert r.mse == r.rtn_mse


def test_clipping_lowers_the_error_of_groups_with_a_stray_weight():
    """One large weight per group stretches RTN's step; clipping it lowers the output error."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(16, 128, generator=g) * 0.02
    w[:, ::32] = 0.5
    x = torch.randn(256, 128, generator=g)
    lo, hi = search_clip(w, x, 32)
    assert (hi < w.view(16, 4, 32).amax(-1)).any()
    exact = x @ w.t()
    clipped = x @ int4_fake_quantize(w, 32, (lo, hi)).t()
    assert mse(clipped, exact) < mse(rtn_reference(x, w, 32), exact)


def test_uncalibrated_awq_layer_refuses_to_run():
    config = AWQConfig()
    layer = make_linear(random_weight(8, 64), config.get_linear_method("x"))
    with pytest.raises(RuntimeError, match="before calibration"):
        layer(torch.randn(2, 64))


@pytest.mark.parametrize("kwargs,match", [({"group_size": 48}, "group_size must be one of"),
                                          ({"max_shrink": 1.0}, "max_shrink"),
                                          ({"grid": 0}, "grid"),
                                          ({"lm_head": "int3"}, "lm_head")])
def test_bad_awq_arguments_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AWQConfig(**kwargs)
