"""INT8 / INT4 weight-only: packing round trips and each linear against dequantize-then-matmul."""
import pytest
import torch

from kvforge.layers.linear import MergedLinear
from kvforge.quant import packing
from kvforge.quant.int4 import Int4Blocks, Int4Config, Int4LinearMethod
from kvforge.quant.int8 import Int8LinearMethod
from tests.quant.factories import make_linear, random_weight, rel_err


def _reference(x, w_deq, bias=None):
    # the kernels run on bf16 activations: the reference uses the same rounded inputs
    y = x.to(torch.bfloat16).float() @ w_deq.t()
    return y if bias is None else y + bias


def test_int4_portable_pack_round_trip():
    codes = torch.randint(0, 16, (7, 64), dtype=torch.uint8)
    assert torch.equal(packing.unpack_int4(packing.pack_int4(codes)), codes)


@pytest.mark.parametrize("n,k", [(96, 64), (128, 256), (960, 576)])
def test_int4_kernel_pack_round_trip(n, k):
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    packed = packing.pack_int4_kernel(codes)
    assert packed.shape == (n, k // 2)
    assert torch.equal(packing.unpack_int4_kernel(packed, n, k), codes)


def test_int4_rtn_error_within_half_step():
    w = random_weight(64, 256)
    codes, scale, zero = packing.quantize_int4_groupwise(w, 64)
    deq = packing.dequantize_int4(codes, scale, zero)
    step = scale.float().repeat_interleave(64, dim=1)
    # half a step, plus the bf16 rounding of zero (its value shifts the whole grid)
    assert ((deq - w).abs() <= 0.5 * step + zero.float().abs().repeat_interleave(64, 1) / 128).all()
    assert codes.min() >= 0 and codes.max() <= 15


def test_int4_constant_group_is_exact():
    w = torch.full((4, 32), 0.25)
    codes, scale, zero = packing.quantize_int4_groupwise(w, 32)
    assert torch.equal(packing.dequantize_int4(codes, scale, zero), w)


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("k", [576, 256])
def test_int4_linear_matches_dequantized_reference(group, k):
    w, bias = random_weight(192, k), torch.randn(192) * 0.1
    layer = make_linear(w, Int4LinearMethod(group), bias)
    x = torch.randn(5, k)
    method = layer.method
    w_deq = method.dequantize(layer)
    y = layer(x)
    ref = _reference(x, w_deq, bias)
    assert y.dtype == torch.float32 and y.shape == (5, 192)
    assert rel_err(y, ref) < 1e-2            # bf16 output rounding of the kernel
    assert rel_err(w_deq, w) < 0.15          # and the quantization itself is sane
    codes, scale, zero = packing.quantize_int4_groupwise(w, group)
    assert torch.equal(method.export_blocks(layer).codes, codes)   # kernel layout invertible


@pytest.mark.parametrize("n", [40, 8])
def test_int4_linear_with_rows_not_a_multiple_of_16(n):
    """The CPU kernel packs 16 rows at a time: padded rows must never reach the output."""
    w, bias = random_weight(n, 96), torch.randn(n) * 0.1
    layer = make_linear(w, Int4LinearMethod(32), bias)
    x = torch.randn(3, 96)
    y = layer(x)
    assert y.shape == (3, n)
    assert rel_err(y, _reference(x, layer.method.dequantize(layer), bias)) < 1e-2
    assert torch.equal(layer.method.export_blocks(layer).codes,
                       packing.quantize_int4_groupwise(w, 32)[0])


def test_int4_merged_shards_equal_whole_matrix():
    """Quantizing q|k|v shard by shard gives the codes of quantizing the fused matrix."""
    ws = [random_weight(64, 128, seed=s) for s in (1, 2, 3)]
    merged = MergedLinear(128, [64, 64, 64], method=Int4LinearMethod(32))
    for i, w in enumerate(ws):
        merged.load_shard(i, "weight", w)
    merged.process_weights_after_loading()
    whole = make_linear(torch.cat(ws), Int4LinearMethod(32))
    x = torch.randn(3, 128)
    assert torch.equal(merged(x), whole(x))


def test_int4_missing_rows_fail_loudly():
    merged = MergedLinear(64, [32, 32], method=Int4LinearMethod(32))
    merged.load_shard(0, "weight", random_weight(32, 64))
    with pytest.raises(ValueError, match="32 of 64"):
        merged.process_weights_after_loading()


def test_int4_blocks_are_stored_as_given():
    w = random_weight(32, 64)
    codes, scale, zero = packing.quantize_int4_groupwise(w, 32)
    layer = make_linear(Int4Blocks(codes, scale, zero, 64), Int4LinearMethod(32))
    assert torch.equal(layer.method.dequantize(layer), packing.dequantize_int4(codes, scale, zero))


def test_int8_linear_matches_dequantized_reference():
    w, bias = random_weight(300, 576), torch.randn(300) * 0.1
    layer = make_linear(w, Int8LinearMethod(), bias)
    x = torch.randn(4, 576) * 3
    y = layer(x)
    q, s = packing.quantize_int8_per_channel(w)
    assert torch.equal(layer.qweight, q)
    assert rel_err(y, _reference(x, packing.dequantize_int8(q, s), bias)) < 1e-2
    assert rel_err(packing.dequantize_int8(q, s), w) < 0.02


def test_bad_group_size_and_lm_head_choice_raise():
    with pytest.raises(ValueError, match="group_size"):
        Int4Config(group_size=48)
    with pytest.raises(ValueError, match="lm_head"):
        Int4Config(lm_head="int2")


def test_int4_lm_head_choice_uses_group_32_and_matches_reference():
    head = Int4Config(group_size=128, lm_head="int4").get_linear_method("lm_head")
    assert isinstance(head, Int4LinearMethod) and head.group_size == 32
    assert isinstance(Int4Config(lm_head="int8").get_linear_method("lm_head"), Int8LinearMethod)
    assert Int4Config(lm_head="none").get_linear_method("lm_head") is None
    w = random_weight(4096, 64)
    layer = make_linear(w, head)
    x = torch.randn(2, 64)
    assert rel_err(layer(x), _reference(x, head.dequantize(layer))) < 1e-2
