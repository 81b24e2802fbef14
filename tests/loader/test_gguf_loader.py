"""GGUF loading on tiny synthetic files: names, config, q/k un-permutation, dequantization."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from kvforge.loader import load_model_source
from kvforge.loader.gguf_loader import iter_raw_tensors, unpermute_qk_rows
from tests.loader.gguf_factory import TINY, llama_cpp_permute, tiny_hf_state, write_gguf

UP = "model.layers.0.mlp.up_proj.weight"     # (96, 64): 96 rows of two 32-element blocks


def load_state(path: str) -> dict[str, torch.Tensor]:
    return dict(load_model_source(path).iter_weights())


def hand_blocks(kind: str, rows: int, cols: int, seed: int = 0):
    """Quantized bytes built from ggml's block layouts, and the values they encode.

    Q4_0: [d f16][16 bytes: element j in low nibble of byte j, element j+16 in the high nibble]
          x = (q - 8) * d
    Q4_1: [d f16][m f16][16 bytes, same nibbles]   x = q * d + m
    Q8_0: [d f16][32 x int8]                       x = q * d
    """
    rng = np.random.default_rng(seed)
    nblocks = rows * cols // 32
    d = rng.uniform(0.01, 1.0, nblocks).astype(np.float16)
    if kind == "Q8_0":
        q = rng.integers(-128, 128, (nblocks, 32)).astype(np.int8)
        values = q.astype(np.float32) * d.astype(np.float32)[:, None]
        raw = np.concatenate([d.view(np.uint8).reshape(-1, 2), q.view(np.uint8)], axis=1)
    else:
        q = rng.integers(0, 16, (nblocks, 32)).astype(np.uint8)
        packed = q[:, :16] | (q[:, 16:] << 4)
        head = [d.view(np.uint8).reshape(-1, 2)]
        if kind == "Q4_0":
            values = (q.astype(np.float32) - 8) * d.astype(np.float32)[:, None]
        else:
            m = rng.uniform(-1.0, 1.0, nblocks).astype(np.float16)
            head.append(m.view(np.uint8).reshape(-1, 2))
            values = (q.astype(np.float32) * d.astype(np.float32)[:, None]
                      + m.astype(np.float32)[:, None])
        raw = np.concatenate(head + [packed], axis=1)
    return raw.reshape(rows, -1), torch.from_numpy(values.reshape(rows, cols))


def test_f32_names_shapes_and_qk_unpermuted(tmp_path):
    state = tiny_hf_state(seed=1)
    path = str(tmp_path / "tiny.gguf")
    write_gguf(path, state)
    loaded = load_state(path)
    assert set(loaded) == set(state)          # no lm_head: tied
    for name, t in state.items():
        assert loaded[name].dtype == torch.float32
        torch.testing.assert_close(loaded[name], t, rtol=0, atol=0, msg=name)


def test_config_mapping(tmp_path):
    path = str(tmp_path / "tiny.gguf")

    def extra(w):
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(4.0)
        w.add_rope_scaling_orig_ctx_len(64)

    write_gguf(path, tiny_hf_state(lm_head=True), extra=extra)
    src = load_model_source(path)
    c = src.config
    assert (src.format, c.architecture) == ("gguf", "LlamaForCausalLM")
    assert (c.num_hidden_layers, c.hidden_size, c.intermediate_size) == (2, 64, 96)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (4, 2, 16)
    assert (c.vocab_size, c.max_position_embeddings) == (40, 256)
    assert c.rope_theta == 50000.0 and c.rms_norm_eps == pytest.approx(1e-5)
    assert c.tie_word_embeddings is False     # output.weight present
    assert c.rope_scaling["rope_type"] == "linear" and c.rope_scaling["factor"] == 4.0
    assert c.rope_scaling["original_max_position_embeddings"] == 64
    assert (c.bos_token_id, c.eos_token_ids) == (1, [2])
    assert "lm_head.weight" in dict(src.iter_weights())


def test_qwen2_keeps_rows_and_maps_biases(tmp_path):
    # llama.cpp stores qwen2 (NEOX rope) q/k unpermuted; the loader must not permute them
    state = tiny_hf_state(seed=2, bias=True)
    path = str(tmp_path / "qwen.gguf")
    write_gguf(path, state, arch="qwen2", permute=False)
    src = load_model_source(path)
    assert src.config.architecture == "Qwen2ForCausalLM" and src.config.attention_bias
    loaded = dict(src.iter_weights())
    for name in ("model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.bias"):
        torch.testing.assert_close(loaded[name], state[name], rtol=0, atol=0)


def test_llama_biases_are_unpermuted(tmp_path):
    state = tiny_hf_state(seed=3, bias=True)
    path = str(tmp_path / "bias.gguf")
    write_gguf(path, state)
    loaded = load_state(path)
    for name in ("model.layers.0.self_attn.q_proj.bias", "model.layers.0.self_attn.k_proj.bias"):
        torch.testing.assert_close(loaded[name], state[name], rtol=0, atol=0)


def test_unpermute_small_example_and_inverse():
    # one head of dim 4: HF rows [x0 x1 y0 y1] are stored by llama.cpp as [x0 y0 x1 y1]
    stored = torch.tensor([[0.0], [2.0], [1.0], [3.0]])
    assert unpermute_qk_rows(stored, n_head=1).flatten().tolist() == [0.0, 1.0, 2.0, 3.0]
    w = torch.randn(3 * 8, 5)
    torch.testing.assert_close(unpermute_qk_rows(llama_cpp_permute(w, 3), 3), w, rtol=0, atol=0)
    with pytest.raises(ValueError, match="7 rows"):
        unpermute_qk_rows(torch.zeros(7, 2), n_head=2)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_quantized_blocks_match_ggml_layout(tmp_path, kind):
    state = tiny_hf_state(seed=4)
    raw, expected = hand_blocks(kind, *state[UP].shape)
    state[UP] = expected

    def encode(name, arr):
        return (raw, QT[kind]) if name == UP else (arr, QT.F32)

    path = str(tmp_path / f"{kind}.gguf")
    write_gguf(path, state, encode=encode)
    loaded = load_state(path)
    assert loaded[UP].dtype == torch.float32 and loaded[UP].shape == (96, 64)
    torch.testing.assert_close(loaded[UP], expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("kind,tol", [("Q4_0", 0.2), ("Q4_1", 0.2), ("Q8_0", 0.02)])
def test_quantized_permuted_q_round_trip(tmp_path, kind, tol):
    # q_proj quantized row by row after the llama.cpp permutation must come back in HF order
    state = tiny_hf_state(seed=5)
    q_name = "model.layers.1.self_attn.q_proj.weight"

    def encode(name, arr):
        if name == q_name:
            return gguf.quants.quantize(arr, QT[kind]), QT[kind]
        return arr, QT.F32

    path = str(tmp_path / "q.gguf")
    write_gguf(path, state, encode=encode)
    loaded = load_state(path)[q_name]
    # error bound relative to each row's scale; a wrong row order would be off by O(1)
    err = (loaded - state[q_name]).abs() / state[q_name].abs().amax(dim=1, keepdim=True)
    assert err.max() < tol


def test_f16_and_bf16_keep_file_dtype(tmp_path):
    state = tiny_hf_state(seed=6)
    names = {"model.layers.0.mlp.down_proj.weight": "F16", UP: "BF16"}

    def encode(name, arr):
        kind = names.get(name)
        if kind == "F16":
            return arr.astype(np.float16), QT.F16
        if kind == "BF16":
            return gguf.quants.quantize(arr, QT.BF16), QT.BF16
        return arr, QT.F32

    path = str(tmp_path / "half.gguf")
    write_gguf(path, state, encode=encode)
    loaded = load_state(path)
    down = "model.layers.0.mlp.down_proj.weight"
    assert loaded[down].dtype == torch.float16 and loaded[UP].dtype == torch.bfloat16
    assert torch.equal(loaded[down], state[down].half())
    # gguf rounds to nearest-even like torch does
    assert torch.equal(loaded[UP], state[UP].bfloat16())


def test_iter_raw_tensors_reports_types_and_bytes(tmp_path):
    state = tiny_hf_state(seed=7)

    def encode(name, arr):
        return (gguf.quants.quantize(arr, QT.Q8_0), QT.Q8_0) if name == UP else (arr, QT.F32)

    path = str(tmp_path / "raw.gguf")
    write_gguf(path, state, encode=encode)
    raw = {name: (kind, shape, data) for name, kind, shape, data in iter_raw_tensors(path)}
    assert set(raw) == set(state)
    kind, shape, data = raw[UP]
    assert (kind, shape, data.dtype) == ("Q8_0", (96, 64), np.uint8)
    assert data.size == 96 * 2 * 34            # two 34-byte Q8_0 blocks per row
    kind, shape, data = raw["model.norm.weight"]
    assert (kind, shape, data.size) == ("F32", (TINY["hidden"],), TINY["hidden"] * 4)


# ------------------------------------------------------------------------------ gemma3
def test_hf_tensor_name_depends_on_architecture():
    from kvforge.loader.gguf_loader import hf_tensor_name
    # llama.cpp's ffn_norm is the norm after attention for Llama, before the MLP for Gemma
    assert hf_tensor_name("blk.2.ffn_norm.weight") == "model.layers.2.post_attention_layernorm.weight"
    assert (hf_tensor_name("blk.2.ffn_norm.weight", "gemma3")
            == "model.layers.2.pre_feedforward_layernorm.weight")
    assert (hf_tensor_name("blk.0.post_attention_norm.weight", "gemma3")
            == "model.layers.0.post_attention_layernorm.weight")
    assert hf_tensor_name("blk.0.attn_k_norm.weight", "gemma3") == "model.layers.0.self_attn.k_norm.weight"
    assert hf_tensor_name("blk.0.post_ffw_norm.weight") is None
    assert hf_tensor_name("blk.0.attn_q.weight", "gemma3") == "model.layers.0.self_attn.q_proj.weight"


@pytest.fixture(scope="module")
def gemma_gguf(tmp_path_factory):
    from tests.models.test_gemma3 import gguf_shaped_hf
    from tests.loader.gguf_factory import write_hf_model_gguf
    hf = gguf_shaped_hf(sliding_window=16)
    path = str(tmp_path_factory.mktemp("gemma3_loader") / "g.gguf")
    write_hf_model_gguf(path, hf, "gemma3")
    return hf, path


def test_gemma3_weights_come_back_in_hf_names_and_values(gemma_gguf):
    """Every tensor maps to its HF name; norms are llama.cpp's 1 + w minus the 1 again."""
    hf, path = gemma_gguf
    state = {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"}   # tied
    loaded = load_state(path)
    assert set(loaded) == set(state)
    for name, t in state.items():
        tol = 1e-6 if name.endswith("norm.weight") else 0.0
        torch.testing.assert_close(loaded[name], t, rtol=0, atol=tol, msg=name)
    assert state["model.layers.3.pre_feedforward_layernorm.weight"].abs().max() > 0.1


def test_gemma3_config_from_metadata(gemma_gguf):
    hf, path = gemma_gguf
    c = load_model_source(path).config
    assert c.architecture == "Gemma3ForCausalLM" and c.hf_config["model_type"] == "gemma3_text"
    assert (c.head_dim, c.sliding_window, c.rope_theta) == (256, 16, 1e6)
    assert c.tie_word_embeddings                         # no output.weight
    hf_extras = {k: c.hf_config[k] for k in ("hidden_activation", "rope_local_base_freq",
                                             "query_pre_attn_scalar")}
    assert hf_extras == {"hidden_activation": "gelu_pytorch_tanh",
                         "rope_local_base_freq": 10000.0, "query_pre_attn_scalar": 256}
    assert "layer_types" not in c.hf_config           # llama.cpp's fixed 5:1 pattern applies


def test_gemma3_sliding_window_pattern_key(tmp_path):
    from tests.models.test_gemma3 import gguf_shaped_hf
    from tests.loader.gguf_factory import write_hf_model_gguf
    from kvforge.models.gemma3 import Gemma3Options
    hf = gguf_shaped_hf(num_hidden_layers=3)
    path = str(tmp_path / "pattern.gguf")
    # newer converters write the per-layer pattern (True = sliding window)
    write_hf_model_gguf(path, hf, "gemma3", extra=lambda w: w.add_sliding_window_pattern(
        [True, False, True]))
    opts = Gemma3Options.from_config(load_model_source(path).config)
    assert opts.layer_types == ("sliding_attention", "full_attention", "sliding_attention")


def test_gemma3_without_window_key_is_all_global(tmp_path):
    from kvforge.models.gemma3 import Gemma3Options
    from tests.loader.gguf_factory import write_hf_model_gguf
    from tests.models.test_gemma3 import gguf_shaped_hf
    path = str(tmp_path / "global.gguf")
    # as llama.cpp reads a gemma3 file without attention.sliding_window
    write_hf_model_gguf(path, gguf_shaped_hf(num_hidden_layers=2, sliding_window=None), "gemma3")
    opts = Gemma3Options.from_config(load_model_source(path).config)
    assert opts.layer_types == ("full_attention",) * 2
