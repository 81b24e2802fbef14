"""Units of zeroquant, fp4, spqr, LoRC and LKD on synthetic layers: number formats, kernels
against dequantize-then-matmul references, outlier fraction and average bits as configured,
and bad arguments refused with errors naming the value."""
from __future__ import annotations

import pytest
import torch

from kvforge.quant.base import get_quantization_config
from kvforge.quant.bitpack import pack_bits, unpack_bits
from kvforge.quant.fp4 import FP4LinearMethod
from kvforge.quant.fp4_format import (FP4_TABLE, FP4_TABLES, dequantize_fp4, fp4_codes,
                                      quantize_fp4)
from kvforge.quant.int4 import Int4LinearMethod
from kvforge.quant.lkd import distil_weight
from kvforge.quant.lowrank import LoRCLinearMethod
from kvforge.quant.spqr import SpQRFormat, quantize_spqr
from kvforge.quant.zeroquant import (ZeroQuantLinearMethod, fake_quantize_activations,
                                     quantize_int8_groups)
from tests.quant.factories import make_linear, outlier_activations, random_weight, rel_err


def test_bit_packing_round_trips_and_takes_exactly_the_bits():
    g = torch.Generator().manual_seed(0)
    for bits in (1, 3, 4, 7, 8):
        for length in (21, 64):             # 64: whole words of 8 codes (the fast unpack)
            codes = torch.randint(0, 2 ** bits, (5, length), generator=g).to(torch.uint8)
            packed = pack_bits(codes, bits)
            assert packed.shape == (5, -(-length * bits // 8))
            assert torch.equal(unpack_bits(packed, bits, length), codes)
    with pytest.raises(ValueError, match="do not fit in 3 bits"):
        pack_bits(torch.tensor([[8]]), 3)


def test_fp4_codes_are_the_nearest_e2m1_values():
    assert FP4_TABLE[:8].tolist() == [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    w = torch.tensor([[0.0, 0.2, 0.3, -0.74, 0.76, 2.4, 2.6, -5.1, 6.0, 5.0, -6.0, 1.2,
                       3.6, -0.1, 0.9, 4.9]] * 2)
    codes, scale, offset = quantize_fp4(w, 16)
    assert offset is None
    assert torch.equal(scale.float(), torch.ones(2, 1))             # max |w| = 6 -> scale 1
    # ties (5.0, midway between 4 and 6) go to the smaller magnitude; -0.1 -> -0
    expected = torch.tensor([0, 0, 0.5, -0.5, 1, 2, 3, -6, 6, 4, -6, 1, 4, 0, 1, 4])
    assert torch.equal(FP4_TABLE[codes[0].long()], expected)


def test_fp4_layer_matches_its_dequantized_weight():
    w, x = random_weight(40, 100), torch.randn(7, 100)
    method = FP4LinearMethod(32, scale_search=4, tile_rows=16)      # several tiles, padded K
    layer = make_linear(w, method, bias=torch.randn(40))
    deq = method.dequantize(layer)
    assert 0 < rel_err(deq, w) < 0.15
    assert torch.allclose(layer(x), x @ deq.t() + layer.bias, atol=1e-5)
    searched = rel_err(FP4LinearMethod(32, 8).to_rows(w).dequantize(), w)
    assert searched < rel_err(FP4LinearMethod(32, 1).to_rows(w).dequantize(), w)


def test_fp4_e1m2_split_is_a_uniform_grid_and_codes_are_nearest():
    assert FP4_TABLES[1, :8].tolist() == [0, 0.25, 0.5, 0.75, 1, 1.25, 1.5, 1.75]
    assert torch.equal(FP4_TABLES[1, 8:], -FP4_TABLES[1, :8])
    x = torch.tensor([0.1, 0.2, -0.4, 0.9, 1.3, 1.9, -3.0])
    expected = torch.tensor([0, 0.25, -0.5, 1.0, 1.25, 1.75, -1.75])
    assert torch.equal(FP4_TABLES[1][fp4_codes(x, 1).long()], expected)


def test_fp4_e1m2_groups_carry_a_uniform_asymmetric_grid_exactly():
    """Weights on a 15-level uniform grid off zero (as a Q4 GGUF file's are, up to one end
    level) come back exactly from E1M2 with an offset; E2M1 cannot hold them."""
    g = torch.Generator().manual_seed(3)
    q = torch.randint(0, 15, (16, 4, 32), generator=g).float()
    q[..., 0], q[..., 1] = 0, 14                                  # both ends in every group
    step = 2.0 ** -torch.randint(6, 9, (16, 4, 1), generator=g).float()
    low = -step * torch.randint(3, 11, (16, 4, 1), generator=g).float()
    w = (low + step * q).view(16, 128)
    codes, scale, offset = quantize_fp4(w, 32, scale_search=16, asymmetric=True,
                                        formats="mixed")
    assert torch.signbit(scale).all()                             # every group chose E1M2
    assert rel_err(dequantize_fp4(codes, scale, 128, offset), w) < 1e-6
    codes, scale, offset = quantize_fp4(w, 32, scale_search=16, asymmetric=True)
    assert not torch.signbit(scale).any()
    assert rel_err(dequantize_fp4(codes, scale, 128, offset), w) > 0.02


@pytest.mark.parametrize("asymmetric", [False, True])
def test_fp4_mixed_splits_err_no_more_than_either_split_per_group(asymmetric):
    w = torch.cat([random_weight(24, 256), torch.rand(24, 256) * 0.1 - 0.05])   # bell + flat
    errs = {}
    for formats in ("e2m1", "e1m2", "mixed"):
        codes, scale, offset = quantize_fp4(w, 32, 8, asymmetric, formats)
        deq = dequantize_fp4(codes, scale, 256, offset)
        errs[formats] = (deq - w).pow(2).view(48, 8, 32).sum(-1)
        if formats == "mixed":
            split = torch.signbit(scale)
    assert (errs["mixed"] <= torch.minimum(errs["e2m1"], errs["e1m2"]) * (1 + 1e-6)).all()
    assert 0 < split.float().mean() < 1                           # both splits in use
    method = FP4LinearMethod(32, 8, tile_rows=20, asymmetric=asymmetric, formats="mixed")
    layer = make_linear(w, method, bias=None)
    x = torch.randn(5, 256)
    assert torch.allclose(layer(x), x @ method.dequantize(layer).t(), atol=1e-5)


def test_fp4_act_aware_codes_cut_the_output_error_on_loud_channels():
    g = torch.Generator().manual_seed(5)
    w = random_weight(64, 256)
    loud = torch.ones(256)
    loud[torch.randperm(256, generator=g)[:12]] = 30.0             # a few loud input channels
    x = torch.randn(512, 256, generator=g) * loud
    sq_mean = x.pow(2).mean(dim=0)

    def output_err(sq):
        codes, scale, offset = quantize_fp4(w, 32, 8, True, "mixed", sq)
        return float(((dequantize_fp4(codes, scale, 256, offset) - w) @ x.t()).norm())

    assert output_err(sq_mean) < 0.8 * output_err(None)


def test_fp4_act_aware_layer_waits_for_calibration_then_quantizes_with_its_statistics():
    w, x = random_weight(48, 96), torch.randn(20, 96) * torch.linspace(0.2, 5.0, 96)
    method = FP4LinearMethod(32, 4, asymmetric=True, formats="mixed", act_aware=True)
    layer = make_linear(w, method, bias=None)
    assert method.pending
    with pytest.raises(RuntimeError, match="used before calibration"):
        layer(x)
    method.recording = True
    assert torch.allclose(layer(x), x @ w.t(), atol=1e-5)         # the float layer meanwhile
    method.recording = False
    method.finish(layer)
    assert not method.pending
    expected = FP4LinearMethod(32, 4, asymmetric=True, formats="mixed").to_rows(
        w, x.pow(2).mean(dim=0))
    assert torch.equal(method.dequantize(layer), expected.dequantize())
    assert torch.allclose(layer(x), x @ expected.dequantize().t(), atol=1e-4)


@pytest.mark.parametrize("asymmetric,formats", [(False, "e2m1"), (True, "e2m1"),
                                                (True, "mixed")])
def test_fp4_rows_save_and_read_back(asymmetric, formats):
    from kvforge.quant.row_formats import read_registered_rows
    w = random_weight(6, 40) + (0.1 if asymmetric else 0.0)       # groups off zero
    rows = FP4LinearMethod(16, 4, asymmetric=asymmetric, formats=formats).to_rows(w)
    saved = rows.saved_tensors("m.q_proj", slice(2, 5))
    marker = next(k for k in saved if k.endswith("codes")).rpartition(".")[2]
    back = read_registered_rows(marker, saved.__getitem__, "m.q_proj")
    assert torch.equal(back.dequantize(), rows.dequantize()[2:5])
    assert (back.offset is not None) == asymmetric


def test_fp4_offsets_help_groups_not_centred_on_zero():
    w = random_weight(32, 128) + 0.08
    plain = rel_err(FP4LinearMethod(32).to_rows(w).dequantize(), w)
    layer = make_linear(w, FP4LinearMethod(32, asymmetric=True), bias=None)
    assert rel_err(layer.method.dequantize(layer), w) < 0.7 * plain
    x = torch.randn(3, 128)
    assert torch.allclose(layer(x), x @ layer.method.dequantize(layer).t(), atol=1e-5)


@pytest.mark.parametrize("act_groups", [True, False])
@pytest.mark.parametrize("group_size", [0, 32])
def test_zeroquant_integer_kernel_matches_fake_quantized_matmul(group_size, act_groups):
    w = random_weight(48, 80)
    x = outlier_activations(9, 80, [3, 70])
    method = ZeroQuantLinearMethod(group_size, act_groups)
    layer = make_linear(w, method, bias=torch.randn(48))
    width = 80 if group_size == 0 else group_size
    xq = fake_quantize_activations(x, width, act_groups)
    reference = xq @ method.dequantize(layer).t() + layer.bias
    assert torch.allclose(layer(x), reference, rtol=1e-4, atol=1e-4)
    assert rel_err(method.dequantize(layer), w) < 0.01
    assert method.export_rows(layer).q.dtype == torch.int8


def test_zeroquant_activation_groups_confine_an_outlier_channel():
    """One huge channel coarsens every step of a per-token scale, only its group's with groups."""
    w, x = random_weight(32, 128), outlier_activations(16, 128, [5], outlier_scale=200.0)
    errors = {}
    for act_groups in (True, False):
        layer = make_linear(w, ZeroQuantLinearMethod(32, act_groups))
        errors[act_groups] = rel_err(layer(x), x @ w.t())
    assert errors[True] < 0.5 * errors[False], errors


def test_int8_groups_round_to_nearest_within_half_a_step():
    w = random_weight(8, 70)
    q, scale = quantize_int8_groups(w, 32)
    assert q.shape == (8, 3, 32) and scale.shape == (8, 3)
    deq = (q.float() * scale[..., None]).flatten(1)[:, :70]
    steps = (deq - w).abs() / scale.repeat_interleave(32, dim=1)[:, :70]
    assert steps.max() <= 0.5 + 1e-4


def test_lkd_never_worse_than_round_to_nearest_and_improves_here():
    w, x = random_weight(24, 64), outlier_activations(128, 64, [9])
    method = ZeroQuantLinearMethod(32, act_groups=False)

    def fq_w(v):
        return method.to_rows(v).dequantize()

    def fq_x(v):
        return fake_quantize_activations(v, 32, False)

    result = distil_weight(w, x, fq_w, fq_x, steps=30, lr=0.2)
    assert result.loss < 0.95 * result.rtn_loss, (result.loss, result.rtn_loss)
    loss = float((fq_x(x) @ fq_w(result.weight).t() - x @ w.t()).pow(2).mean())
    assert loss == pytest.approx(result.loss, rel=1e-5)
    zero = distil_weight(w, x, fq_w, fq_x, steps=0, lr=0.2)
    assert torch.equal(zero.weight, w) and zero.loss == zero.rtn_loss


def test_lorc_factors_cut_the_weight_error_and_run_in_the_layer():
    g = torch.Generator().manual_seed(3)
    # a weight with low-rank structure on top of noise: what LoRC recovers
    w = random_weight(64, 96) + 0.05 * torch.randn(64, 2, generator=g) @ torch.randn(2, 96,
                                                                                      generator=g)
    x = torch.randn(5, 96)
    plain = make_linear(w, Int4LinearMethod(32))
    lorc_method = LoRCLinearMethod(Int4LinearMethod(32), 8)
    lorc = make_linear(w, lorc_method)
    assert lorc.lorc_u.shape == (64, 8) and lorc.lorc_v.shape == (8, 96)
    plain_err = rel_err(plain.method.dequantize(plain), w)
    assert rel_err(lorc_method.dequantize(lorc), w) < 0.8 * plain_err
    expected = plain(x) + (x @ lorc.lorc_v.t()) @ lorc.lorc_u.t()
    assert torch.allclose(lorc(x), expected, atol=1e-5)
    assert rel_err(lorc(x), x @ w.t()) < rel_err(plain(x), x @ w.t())


def test_activation_aware_lorc_cuts_the_output_error_more_where_channels_are_loud():
    w, x = random_weight(64, 96), outlier_activations(256, 96, [4, 50, 77], outlier_scale=30.0)
    errors = {}
    for act_aware in (False, True):
        method = LoRCLinearMethod(Int4LinearMethod(32), 4, act_aware=act_aware)
        layer = make_linear(w, method)
        if act_aware:
            assert method.pending
            with pytest.raises(RuntimeError, match="before calibration"):
                layer(x)
            method.recording = True
            layer(x)
            method.recording = False
            method.finish(layer)
            assert not method.pending
        errors[act_aware] = rel_err(layer(x), x @ w.t())
    assert errors[True] < 0.7 * errors[False], errors


def test_spqr_keeps_the_configured_outlier_fraction_and_bits():
    w, x = random_weight(64, 256), outlier_activations(64, 256, [7, 100])
    w[3, 5] = 2.0                                      # a weight far outside its group's range
    h = x.pow(2).mean(dim=0)
    fmt = SpQRFormat(bits=3, group_size=16, stat_bits=3, stat_group=16)
    rows = quantize_spqr(w, h, fmt, 0.01)
    assert rows.val.numel() == round(0.01 * 64 * 256)
    assert rows.crow[-1] == rows.val.numel() and rows.codes.max() <= 7
    # the far-off weight is an outlier, reconstructed to fp16 precision
    first, last = int(rows.crow[3]), int(rows.crow[4])
    assert 5 in rows.col[first:last].tolist()
    assert abs(float(rows.dequantize()[3, 5]) - 2.0) < 1e-3
    # outliers chosen by output sensitivity lower the output error
    none = quantize_spqr(w, h, fmt, 0.0)
    assert rel_err(x @ rows.dequantize().t(), x @ w.t()) < \
        0.8 * rel_err(x @ none.dequantize().t(), x @ w.t())


def test_spqr_model_layers_report_configured_outliers_and_average_bits(tiny_model_factory):
    from kvforge.loader.source import load_model_source
    from kvforge.quant.bits import average_bits
    from kvforge.quant.loading import load_model
    hf_dir, _ = tiny_model_factory("llama")
    args = {"bits": 3, "group_size": 16, "stat_bits": 3, "stat_group": 16,
            "outlier_fraction": 0.01}
    model = load_model(load_model_source(hf_dir), quantization="spqr", quantization_args=args)
    layers = [m for m in model.modules() if hasattr(m, "spqr_codes")]
    assert len(layers) == 4 * model.num_layers
    weights = sum(m.input_size * m.output_size for m in layers)
    outliers = sum(m.spqr_val.numel() for m in layers)
    assert abs(outliers / weights - 0.01) < 0.001
    # the stored bytes are the format's bits (packing rounds each row up to whole bytes)
    fmt = model.quant_config.format
    expected = sum(m.input_size * m.output_size * fmt.bits_per_weight(m.input_size, 0.01)
                   for m in layers) / weights
    assert expected <= average_bits(model) < expected + 0.1
    # at SmolLM2-135M's widths (576 / 1536 inputs) the defaults are about 4 bits per weight
    assert 3.9 < fmt.bits_per_weight(576, 0.01) < 4.1
    assert 3.8 < fmt.bits_per_weight(1536, 0.01) < 4.0


@pytest.mark.parametrize("name,args,match", [
    ("zeroquant", {"group_size": 48}, "group_size must be one of .* got 48"),
    ("zeroquant", {"lkd_steps": -1}, "lkd_steps must be an integer >= 0, got -1"),
    ("zeroquant", {"lkd_steps": 2, "lorc_rank": 4}, "lorc_rank=4 cannot be combined"),
    ("zeroquant", {"act_groups": 2}, "act_groups must be 0 or 1, got 2"),
    ("fp4", {"group_size": 24}, "fp4 group_size must be one of .* got 24"),
    ("fp4", {"scale_search": 0}, "scale_search must be an integer >= 1, got 0"),
    ("fp4", {"formats": "e3m0"}, "fp4 formats must be one of .* got 'e3m0'"),
    ("fp4", {"act_aware": 2}, "fp4 act_aware must be 0 or 1, got 2"),
    ("fp4", {"act_aware": 1, "lorc_rank": 8}, "act_aware=1 cannot be combined with lorc_rank=8"),
    ("spqr", {"bits": 5}, "spqr bits must be 2, 3 or 4, got 5"),
    ("spqr", {"outlier_fraction": 0.5}, r"outlier_fraction must be in \[0, 0.1\), got 0.5"),
    ("spqr", {"stat_group": 0}, "stat_group must be an integer >= 1, got 0"),
    ("int4", {"lorc_rank": -2}, "lorc_rank must be an integer >= 0 .* got -2"),
    ("int8", {"lorc_rank": "8x"}, "lorc_rank must be an integer >= 0 .* got '8x'"),
    ("awq", {"lorc_rank": 8}, "quantization 'awq' has no option 'lorc_rank'; its options"),
])
def test_bad_arguments_are_refused_naming_the_value(name, args, match):
    with pytest.raises(ValueError, match=match):
        get_quantization_config(name, **args)


@pytest.mark.parametrize("width", [32, 1500])
def test_group_int_matmul_is_exact_on_either_backend(monkeypatch, width):
    """torch._int_mm and the fp32 GEMM of int8 values give the same int32 sums, also for a
    group wider than fp32's exact range (split into exact slabs)."""
    from kvforge.quant import zeroquant
    g = torch.Generator().manual_seed(0)
    xq = torch.full((2, 5, width), 127, dtype=torch.int8)              # the largest sums
    xq[1] = torch.randint(-127, 128, (5, width), generator=g).to(torch.int8)
    wq = torch.full((2, width, 3), -127, dtype=torch.int8)
    wq[1] = torch.randint(-127, 128, (width, 3), generator=g).to(torch.int8)
    exact = torch.stack([xq[i].long() @ wq[i].long() for i in range(2)])
    for pays in (True, False):
        monkeypatch.setattr(zeroquant, "int_mm_pays", lambda: pays)
        assert torch.equal(zeroquant.group_int_matmul(xq, wq).long(), exact), pays
