"""The compiled W8A8 group GEMM (csrc/w8a8_gemm.cpp, ZeroQuant's kernel) against exact integer
references, on every ISA build and int8 dot instruction this CPU runs; the int8 dot's choice
(``KVFORGE_INT8_DOT``); and a zeroquant model's greedy tokens with the kernel on and off."""
from __future__ import annotations

import pytest
import torch

from kvforge.kernels import ops
from kvforge.quant.zeroquant import ZeroQuantLinearMethod, quantize_int8_groups
from tests.kernels.test_cpu_kernels import compiled, needs_kernels  # noqa: F401 (fixture)
from tests.quant.factories import make_linear, outlier_activations, random_weight

pytestmark = needs_kernels

DOTS = list(ops.INT8_DOTS.items())


def dots_of(module):
    """The int8 dots this CPU and build run: maddubs always (AVX2), VNNI where present."""
    return [(name, code) for name, code in DOTS if module.int8_dot_supported(code)]


def exact_reference(x, codes, scales, width, act_groups):
    """y[t, o] = sum_g x_step[t, g] w_scale[o, g] sum_{k in g} xq[t, k] wq[o, k], the integer
    sums in int64 and the rest in float64."""
    if act_groups:
        xq, x_step = quantize_int8_groups(x, width)                  # [T, ng, G], [T, ng]
    else:
        step = x.abs().amax(dim=1).clamp_min(1e-12) / 127
        groups = codes.shape[1] // width
        padded = torch.nn.functional.pad(x, (0, codes.shape[1] - x.shape[1]))
        xq = torch.round(padded / step[:, None]).clamp(-127, 127).to(torch.int8).view(
            x.shape[0], groups, width)
        x_step = step[:, None].expand(-1, groups)
    wq = codes.view(codes.shape[0], -1, width)                      # [n, ng, G]
    sums = torch.einsum("tgk,ogk->tog", xq.long(), wq.long()).double()
    return (sums * x_step.double()[:, None, :] * scales.double()[None]).sum(-1)


@pytest.mark.parametrize("act_groups", [True, False])
@pytest.mark.parametrize("rows,in_features,out_features,group", [
    (1, 96, 40, 32),        # one row; 5 panels: a full tile of panels and the rest one by one
    (5, 130, 17, 64),       # K padded to whole groups; a last panel of one column
    (13, 256, 64, 128),     # several row tiles with a remainder
    (7, 84, 24, 0),         # one group spanning a row of 84 (a multiple of 4, not of 32)
    (70, 8192, 16, 256),    # 32 groups of 256, 23 row tiles of 3 (AVX2) and a rest
])
def test_w8a8_projection_matches_exact_integer_sums(compiled, rows, in_features, out_features,
                                                     group, act_groups):
    width = in_features if group == 0 else group
    x = outlier_activations(rows, in_features, [3, in_features - 2])
    w = random_weight(out_features, in_features)
    q, scales = quantize_int8_groups(w, width)
    codes = q.flatten(-2)
    bias = torch.randn(out_features)
    projection = ops.w8a8_projection(*ops.pack_w8a8_panels(codes, scales), out_features,
                                     in_features, bias)
    assert (projection.in_features, projection.out_features) == (in_features, out_features)
    ref = exact_reference(x, codes, scales, width, act_groups) + bias.double()
    for name, dot in dots_of(compiled):
        y = projection.forward(x, act_groups, dot)
        assert y.shape == (rows, out_features)
        assert torch.allclose(y.double(), ref, rtol=1e-5, atol=1e-4 * ref.abs().max()), name


def test_w8a8_sums_do_not_saturate(compiled):
    """Codes of +-127 everywhere: a 16-bit pair sum of u8 x s8 products would saturate (the
    sign trick keeps |w| x sign(x, w) <= 127 * 127; VNNI sums in int32)."""
    k, n = 256, 16
    signs = torch.where(torch.arange(n * k) % 3 == 0, -1.0, 1.0).view(n, k)
    codes = (127 * signs).to(torch.int8)
    scales = torch.ones(n, k // 32)
    x = torch.where(torch.arange(2 * k) % 5 == 0, -1.0, 1.0).view(2, k)   # codes +-127
    projection = ops.w8a8_projection(*ops.pack_w8a8_panels(codes, scales), n, k)
    exact = (127 * x.double()) @ codes.double().t() * (1.0 / 127)
    for name, dot in dots_of(compiled):
        assert torch.allclose(projection.forward(x, True, dot).double(), exact, rtol=1e-6), name


def test_w8a8_panels_round_trip_and_hold_the_vnni_offsets():
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(-127, 128, (13, 96), dtype=torch.int8, generator=g)
    scales = torch.rand(13, 3, generator=g)
    panel_codes, panel_scales, sums = ops.pack_w8a8_panels(codes, scales)
    assert panel_codes.shape == (2, 24, 8, 4) and panel_scales.shape == sums.shape == (2, 3, 8)
    assert panel_codes[0, 5, 3].tolist() == codes[3, 20:24].tolist()   # k step 5 of column 3
    assert int(sums[1, 2, 4]) == 128 * int(codes[12, 64:96].long().sum())
    assert not panel_codes[1, :, 5:].any() and not panel_scales[1, :, 5:].any()  # rows past 13
    back_codes, back_scales = ops.unpack_w8a8_panels(panel_codes, panel_scales, 13)
    assert torch.equal(back_codes, codes) and torch.equal(back_scales, scales)


def test_w8a8_projection_refuses_bad_shapes(compiled):
    panels = ops.pack_w8a8_panels(torch.zeros(8, 64, dtype=torch.int8), torch.ones(8, 2))
    codes, scales, sums = panels
    make = compiled.W8A8Projection
    with pytest.raises(RuntimeError, match="scales must be contiguous"):
        make(codes, torch.ones(1, 3, 8), torch.zeros(1, 3, 8, dtype=torch.int32), 8, 64, None)
    with pytest.raises(RuntimeError, match="code_sums must be"):
        make(codes, scales, sums.float(), 8, 64, None)
    odd = ops.pack_w8a8_panels(torch.zeros(8, 72, dtype=torch.int8), torch.ones(8, 4))
    with pytest.raises(RuntimeError, match="group width 18 is not a multiple of 4"):
        make(*odd, 8, 72, None)
    with pytest.raises(RuntimeError, match="out_features 9 does not fill 1 panels"):
        make(*panels, 9, 64, None)
    with pytest.raises(RuntimeError, match="in_features 20 does not pad to 64"):
        make(*panels, 8, 20, None)
    projection = make(*panels, 8, 60, None)
    with pytest.raises(RuntimeError, match=r"input must be \[T, 60\]"):
        projection.forward(torch.zeros(2, 64), True, 0)
    with pytest.raises(RuntimeError, match="int8 dot 7 is not available"):
        projection.forward(torch.zeros(2, 60), True, 7)


def test_int8_dot_choice_follows_the_environment(compiled, monkeypatch):
    vnni = [code for name, code in dots_of(compiled) if name != "maddubs"]
    monkeypatch.delenv(ops.INT8_DOT_ENV, raising=False)
    assert ops.int8_dot() == (vnni[0] if vnni else ops.INT8_DOTS["maddubs"])
    monkeypatch.setenv(ops.INT8_DOT_ENV, "maddubs")
    assert ops.int8_dot() == ops.INT8_DOTS["maddubs"]
    monkeypatch.setenv(ops.INT8_DOT_ENV, "vnni")
    if vnni:
        assert ops.int8_dot() == vnni[0]
    else:
        with pytest.raises(RuntimeError, match="has no VNNI"):
            ops.int8_dot()
    monkeypatch.setenv(ops.INT8_DOT_ENV, "sse9")
    with pytest.raises(ValueError, match="'sse9' is not one of"):
        ops.int8_dot()


def test_a_bad_int8_dot_setting_fails_when_the_model_is_configured(monkeypatch,
                                                                   tiny_model_factory):
    from kvforge import LLM
    hf_dir, _ = tiny_model_factory("llama")
    monkeypatch.setenv(ops.INT8_DOT_ENV, "vnni2")
    with pytest.raises(ValueError, match="KVFORGE_INT8_DOT='vnni2' is not one of"):
        LLM(hf_dir, quantization="zeroquant", kv_cache_memory="8MiB")


def test_zeroquant_layer_moves_to_panels_and_back(compiled):
    """A CPU forward moves the codes to the kernel's panels (one copy), a reload moves them back;
    the outputs match the PyTorch path, and a group width the kernel cannot take stays there."""
    w, x, bias = random_weight(24, 64), outlier_activations(6, 64, [5]), torch.randn(24)
    method = ZeroQuantLinearMethod(32, True)
    layer = make_linear(w, method, bias=bias)
    rows = method.export_rows(layer)
    in_torch = ZeroQuantLinearMethod(32, True)
    in_torch.use_kernel = False
    reference = make_linear(w, in_torch, bias=bias)
    y = layer(x)
    names = {name for name, _ in layer.named_parameters()}
    assert {"w8a8_codes", "w8a8_scales", "w8a8_code_sums"} <= names
    assert "qweight_g" not in names and "qweight_g" in dict(reference.named_parameters())
    assert torch.allclose(y, reference(x), rtol=1e-5, atol=1e-5)
    back = method.export_rows(layer)
    assert torch.equal(back.q, rows.q) and torch.equal(back.scale, rows.scale)
    layer.load_weight("weight", w * 2)                       # a reload: groups again
    assert "qweight_g" in dict(layer.named_parameters()) and method._kernel is None
    assert torch.allclose(layer(x), 2 * (reference(x) - bias) + bias, rtol=1e-4, atol=1e-4)
    odd = ZeroQuantLinearMethod(0, True)                     # 6 inputs in one group
    odd_layer = make_linear(random_weight(8, 6), odd)
    odd_layer(torch.randn(3, 6))
    assert odd._kernel is None and "qweight_g" in dict(odd_layer.named_parameters())


def test_zeroquant_model_greedy_tokens_kernel_on_equal_off(compiled, tiny_model_factory,
                                                           monkeypatch):
    from kvforge import LLM
    from tests.quant.test_weight_only_models import _greedy
    hf_dir, _ = tiny_model_factory("llama", initializer_range=0.1)
    kw = dict(quantization="zeroquant", quantization_args={"group_size": 32},
              kv_cache_memory="8MiB")
    runs = {}
    for name, _ in dots_of(compiled):
        monkeypatch.setenv(ops.INT8_DOT_ENV, name)
        runs[name] = _greedy(LLM(hf_dir, **kw))
    monkeypatch.setattr(ZeroQuantLinearMethod, "use_kernel", False)
    off = _greedy(LLM(hf_dir, **kw))
    assert all(tokens == off for tokens in runs.values()), (runs, off)


def test_w8a8_benchmark_columns_compute_the_same_projection(compiled):
    """benchmarks/w8a8_kernel.py times like with like: every kernel column gives the PyTorch
    path's output, and fp32 differs by the 8-bit rounding only."""
    from benchmarks.w8a8_kernel import build_layers
    fns, kernel_columns = build_layers(64, 40, 32)
    assert kernel_columns == [f"kernel {name}" for name, _ in dots_of(compiled)]
    x = outlier_activations(3, 64, [7])
    reference = fns["zeroquant PyTorch"](x)
    for name in kernel_columns:
        assert torch.allclose(fns[name](x), reference, rtol=1e-5, atol=1e-5), name
    fp32 = fns["fp32"](x)
    assert 0 < float((fp32 - reference).norm() / fp32.norm()) < 0.02
