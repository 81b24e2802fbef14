"""The default model file: config mapping, real quantized blocks, and transformers as oracle."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from kvforge.loader import load_model_source
from kvforge.loader.gguf_loader import iter_raw_tensors, tensor_to_torch


@pytest.fixture(scope="module")
def source(default_model_path):
    return load_model_source(default_model_path)


def decode_q4_1_row(raw_row: np.ndarray) -> np.ndarray:
    """ggml Q4_1 by hand: per 20-byte block [d f16][m f16][16 nibble bytes], x = q*d + m."""
    blocks = raw_row.reshape(-1, 20)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    qs = blocks[:, 4:]
    q = np.concatenate([qs & 0xF, qs >> 4], axis=1).astype(np.float32)
    return (q * d + m).reshape(-1)


def decode_q8_0_row(raw_row: np.ndarray) -> np.ndarray:
    blocks = raw_row.reshape(-1, 34)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    return (blocks[:, 2:].copy().view(np.int8).astype(np.float32) * d).reshape(-1)


def test_config(source):
    c = source.config
    assert source.format == "gguf" and c.architecture == "LlamaForCausalLM"
    assert (c.num_hidden_layers, c.hidden_size, c.intermediate_size) == (30, 576, 1536)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (9, 3, 64)
    assert (c.vocab_size, c.max_position_embeddings) == (49152, 8192)
    assert c.rope_theta == 1e5 and c.rope_scaling is None
    assert c.rms_norm_eps == pytest.approx(1e-5)
    assert c.tie_word_embeddings is True
    assert (c.bos_token_id, c.eos_token_ids) == (1, [2])


def test_real_blocks_decode_like_ggml(source):
    reader = source._reader
    tensors = {t.name: t for t in reader.tensors}
    types = Counter(t.tensor_type.name for t in reader.tensors)
    assert types == {"Q4_1": 210, "F32": 61, "Q8_0": 1}

    up = tensors["blk.3.ffn_up.weight"]                       # Q4_1, (1536, 576)
    ours = tensor_to_torch(up)
    assert ours.shape == (1536, 576)
    for row in (0, 777, 1535):
        np.testing.assert_allclose(ours[row].numpy(), decode_q4_1_row(up.data[row]), atol=1e-6)

    emb = tensors["token_embd.weight"]                        # Q8_0, (49152, 576)
    ours = tensor_to_torch(emb)
    assert ours.shape == (49152, 576)
    for row in (0, 19556, 49151):
        np.testing.assert_allclose(ours[row].numpy(), decode_q8_0_row(emb.data[row]), atol=1e-6)

    norm = tensors["blk.0.attn_norm.weight"]                  # F32
    np.testing.assert_array_equal(tensor_to_torch(norm).numpy(), np.asarray(norm.data))


def test_q_rows_come_from_permuted_file_rows(source):
    # HF row (head h, half s, index i) was stored by llama.cpp at row h*64 + 2*i + s
    weights = {}
    for name, tensor in source.iter_weights():               # lazy: stop after layer 0
        if name.startswith("model.layers.1."):
            break
        weights[name] = tensor
    raw = {n: d for n, _, _, d in iter_raw_tensors(source._reader)
           if n.startswith("model.layers.0.self_attn")}
    for name, n_head in (("q_proj", 9), ("k_proj", 3)):
        full = f"model.layers.0.self_attn.{name}.weight"
        rows = raw[full].reshape(n_head * 64, -1)
        for h, s, i in ((0, 0, 0), (0, 1, 0), (1, 0, 5), (n_head - 1, 1, 31)):
            stored = decode_q4_1_row(rows[h * 64 + 2 * i + s])
            hf_row = weights[full][h * 64 + s * 32 + i].numpy()
            np.testing.assert_allclose(hf_row, stored, atol=1e-6)


@pytest.mark.slow
def test_state_dict_equals_transformers_gguf_loading(source):
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    hf_cfg = {k: v for k, v in source.config.hf_config.items() if k != "architectures"}
    with torch.device("meta"):
        skeleton = LlamaForCausalLM(LlamaConfig(**hf_cfg))
    reference = load_gguf_checkpoint(source.path, return_tensors=True,
                                     model_to_load=skeleton)["tensors"]
    ours = dict(source.iter_weights())
    assert set(ours) == set(reference)
    for name, ref in reference.items():
        assert ours[name].shape == ref.shape, name
        torch.testing.assert_close(ours[name], ref.float(), rtol=0, atol=1e-6, msg=name)
