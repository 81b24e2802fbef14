"""``--quantization gguf``: tiny models written as GGUF in each block type, run from the file's
blocks against the dequantized fp32 reference (``--quantization none``)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf import quants

from kvforge.attention.metadata import AttentionMetadata
from kvforge.loader.source import load_model_source
from kvforge.quant.gguf import GGUFBlocks, GGUFEmbedding, GGUFLinearMethod
from kvforge.quant.loading import load_model
from tests.kernels.test_cpu_kernels import needs_kernels
from tests.kernels.test_gguf_kernels import random_blocks
from tests.loader.gguf_factory import tiny_hf_state, write_gguf

KQUANT_DIMS = dict(vocab=40, hidden=256, ffn=512, layers=2, heads=4, kv_heads=2)


def _encoder(qtype):
    """Projections scaled by 1/sqrt(in) (std-1 weights would blow activations up layer after
    layer, and with them every rounding); K-quants as random valid blocks of the same size."""
    def encode(name, arr):
        if arr.ndim != 2:
            return arr, QT.F32
        if qtype in (QT.Q4_K, QT.Q5_K, QT.Q6_K):   # gguf-py cannot quantize these
            scales = (1e-3, 1e-2) if "embed" in name else (2e-5, 2e-4)
            return random_blocks(qtype, *arr.shape, seed=len(name), scales=scales), qtype
        if "embed" not in name:
            arr = arr / np.sqrt(arr.shape[1])
        return quants.quantize(arr.astype(np.float32), qtype), qtype
    return encode


def _gguf_model(tmp_path, qtype, **state_kw):
    path = str(tmp_path / f"{qtype.name}.gguf")
    dims = KQUANT_DIMS if qtype in (QT.Q4_K, QT.Q5_K, QT.Q6_K) else None
    write_gguf(path, tiny_hf_state(**state_kw, dims=dims), encode=_encoder(qtype), dims=dims)
    return load_model_source(path)


@torch.inference_mode()
def _logits(model, ids):
    blocks = -(-len(ids) // 16)
    meta = AttentionMetadata.build([len(ids)], [0], [list(range(blocks))], 16, "cpu")
    caches = [torch.zeros(model.kv_cache_shape(blocks, 16)) for _ in range(model.num_layers)]
    return model.compute_logits(model(torch.tensor(ids), meta.positions(), caches, meta))


def _greedy(model, prompt, steps):
    """Greedy continuation and each step's logits (the whole sequence rerun each step)."""
    ids, steps_logits = list(prompt), []
    for _ in range(steps):
        last = _logits(model, ids)[-1]
        steps_logits.append(last)
        ids.append(int(last.argmax()))
    return ids[len(prompt):], steps_logits


def _assert_greedy_near(native, reference, prompt, steps=6, top_k=3):
    """Equal, or at the first divergence each side's token is in the other's top-k."""
    a, a_logits = _greedy(native, prompt, steps)
    b, b_logits = _greedy(reference, prompt, steps)
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            assert y in a_logits[i].topk(top_k).indices.tolist(), (i, a, b)
            assert x in b_logits[i].topk(top_k).indices.tolist(), (i, a, b)
            return
    assert a == b


@needs_kernels
@pytest.mark.parametrize("qtype", [QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.F16,
                                   QT.Q4_K, QT.Q5_K, QT.Q6_K], ids=lambda t: t.name)
@pytest.mark.parametrize("tied", [True, False])
def test_block_model_matches_dequantized_reference(tmp_path, qtype, tied):
    source = _gguf_model(tmp_path, qtype, lm_head=not tied)
    native, reference = load_model(source, quantization="gguf"), load_model(source)
    layer = native.model.layers[0].self_attn.qkv_proj
    assert isinstance(layer.method, GGUFLinearMethod) and not hasattr(layer, "weight")
    assert [b.type_name for b in layer.gguf_blocks] == [qtype.name] * 3
    assert isinstance(native.model.embed_tokens, GGUFEmbedding)
    # 8-bit activations (the random model's std-1 weights amplify their rounding layer after
    # layer): near as a whole, for prefill (passes of the integer dots) and few rows, and
    # greedy equal or a near tie
    # K-quants' activations take one step per 256 values: a whole row of this 256-wide model
    tolerance = 0.08 if qtype in (QT.Q4_K, QT.Q5_K, QT.Q6_K) else 0.05
    long_prompt = [(7 * i) % 37 + 3 for i in range(70)]
    a, b = _logits(native, long_prompt), _logits(reference, long_prompt)
    assert (a - b).norm() <= tolerance * b.norm()
    short = long_prompt[:5]
    a, b = _logits(native, short), _logits(reference, short)
    assert (a - b).norm() <= tolerance * b.norm()
    _assert_greedy_near(native, reference, short)


@needs_kernels
def test_qwen2_biases_and_llama_permuted_rows(tmp_path):
    """qkv bias (Qwen2, rows stored as is) and llama's rotary-permuted q/k rows of blocks."""
    for arch, permute, bias in (("qwen2", False, True), ("llama", True, False)):
        path = str(tmp_path / f"{arch}.gguf")
        write_gguf(path, tiny_hf_state(bias=bias), arch=arch, permute=permute,
                   encode=_encoder(QT.Q8_0))
        source = load_model_source(path)
        native, reference = load_model(source, quantization="gguf"), load_model(source)
        qkv = native.model.layers[1].self_attn.qkv_proj
        torch.testing.assert_close(qkv.method.dequantize(qkv),
                                   reference.model.layers[1].self_attn.qkv_proj.weight)
        if bias:
            torch.testing.assert_close(qkv.bias,
                                       reference.model.layers[1].self_attn.qkv_proj.bias)
        prompt = [3 + i % 30 for i in range(70)]         # more rows than one pass of the dots
        a, b = _logits(native, prompt), _logits(reference, prompt)
        assert (a - b).norm() <= 0.05 * b.norm()


@needs_kernels
def test_weights_stay_in_the_file_mapping(tmp_path):
    source = _gguf_model(tmp_path, QT.Q4_0)
    native = load_model(source, quantization="gguf")
    mapping = np.frombuffer(source._reader._map, dtype=np.uint8)      # the whole file's map
    lo, hi = mapping.ctypes.data, mapping.ctypes.data + mapping.nbytes
    v_rows = native.model.layers[0].self_attn.qkv_proj.gguf_blocks[2].raw   # not permuted
    table = native.model.embed_tokens.gguf_blocks[0].raw
    for raw in (v_rows, table, native.model.layers[1].mlp.down_proj.gguf_blocks[0].raw):
        assert lo <= raw.data_ptr() and raw.data_ptr() + raw.numel() <= hi
    # the tied head reads the embedding's own bytes
    assert native.lm_head.gguf_blocks[0].raw.data_ptr() == table.data_ptr()
    # no float copy of any weight: the only fp32 storage left is norms (the tiny model's
    # weights in fp32 would be ~50x more)
    float_bytes = sum(t.untyped_storage().nbytes() for t in native.parameters()
                      if t.dtype == torch.float32)
    norms = sum(p.numel() * 4 for n, p in native.named_parameters() if "norm" in n)
    assert float_bytes == norms


@needs_kernels
def test_lookup_dequantizes_only_the_rows_asked(tmp_path):
    source = _gguf_model(tmp_path, QT.Q8_0)
    native, reference = load_model(source, quantization="gguf"), load_model(source)
    ids = torch.tensor([[3, 9], [39, 3]])
    torch.testing.assert_close(native.model.embed_tokens(ids),
                               reference.model.embed_tokens(ids))


def test_unsupported_type_is_named(tmp_path):
    path = str(tmp_path / "q2k.gguf")
    state = tiny_hf_state(dims=KQUANT_DIMS)

    def encode(name, arr):
        if name.endswith("mlp.down_proj.weight"):
            n, k = arr.shape
            return np.zeros((n, k // 256 * 84), dtype=np.uint8), QT.Q2_K
        return arr, QT.F32
    write_gguf(path, state, encode=encode, dims=KQUANT_DIMS)
    with pytest.raises(ValueError, match=r"'blk.0.ffn_down.weight' .*GGML type Q2_K.*"
                                         r"--quantization none"):
        load_model(load_model_source(path), quantization="gguf")


def test_float_weight_becomes_f32_rows():
    w = torch.randn(3, 32)
    blocks = GGUFBlocks.from_float(w, "x")
    assert blocks.shape == (3, 32) and blocks.type_name == "F32"
    torch.testing.assert_close(blocks.dequantize(), w)


@pytest.mark.parametrize("qtype, cols", [(QT.Q4_K, (256, 768)), (QT.Q6_K, (0, 256)),
                                         (QT.Q8_0, (32, 96)), (QT.Q4_1, (480, 512)),
                                         (QT.F16, (3, 10))])
def test_block_slices_decode_to_the_same_values(qtype, cols):
    """Row and column slices (the cuts tensor parallel makes) keep the encoding and decode to
    the matching part of the whole; zero padding decodes to zeros; a cut inside a block is
    refused."""
    raw = torch.from_numpy(random_blocks(qtype, 6, 768, seed=1))
    blocks = GGUFBlocks(raw, qtype.name, 768, "t")
    whole = blocks.dequantize()
    start, stop = cols
    columns = blocks.column_slice(start, stop)
    assert columns.type_name == qtype.name and columns.shape == (6, stop - start)
    torch.testing.assert_close(columns.dequantize(), whole[:, start:stop], rtol=0, atol=0)
    rows = blocks.row_slice(2, 5)
    assert rows.raw.data_ptr() == raw[2].data_ptr()              # a view, no copy
    torch.testing.assert_close(rows.dequantize(), whole[2:5], rtol=0, atol=0)
    padded = rows.zero_padded(5).dequantize()
    torch.testing.assert_close(padded[:3], whole[2:5], rtol=0, atol=0)
    assert torch.count_nonzero(padded[3:]) == 0
    if blocks.block_columns > 1:
        with pytest.raises(ValueError, match=f"blocks of {blocks.block_columns}"):
            blocks.column_slice(start + 1, stop)
