"""Llama-family model vs HF transformers (the oracle) on tiny random models built offline."""
from __future__ import annotations

import pytest
import torch

import transformers as tf
from kvforge.attention.metadata import AttentionMetadata
from kvforge.models.config import ModelConfig
from kvforge.layers.linear import MergedLinear
from kvforge.models.llama import LlamaForCausalLM
from kvforge.models.registry import get_model_class, supported_architectures

BLOCK_SIZE = 4
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=256,
            initializer_range=0.1)   # larger than HF's 0.02 so that a wrong op moves logits a lot
FAMILIES = {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
            "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
            "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM)}
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32, "rope_theta": 5e5}

CASES = {
    "llama_untied": ("llama", {}),
    "llama_tied": ("llama", {"tie_word_embeddings": True}),
    "llama3_rope": ("llama", {"rope_parameters": LLAMA3_ROPE}),
    "linear_rope": ("llama", {"rope_parameters": {"rope_type": "linear", "factor": 4.0,
                                                  "rope_theta": 1e4}}),
    "head_dim_32": ("llama", {"head_dim": 32}),
    "llama_biases": ("llama", {"attention_bias": True, "mlp_bias": True}),
    "mqa": ("llama", {"num_key_value_heads": 1}),
    "mistral": ("mistral", {"sliding_window": None}),
    "qwen2": ("qwen2", {"tie_word_embeddings": True}),
}


# ------------------------------------------------------------------------------ factories
def make_pair(kind: str, seed: int = 0, **overrides):
    """(HF model, our model with the HF model's weights)."""
    cfg_cls, model_cls = FAMILIES[kind]
    torch.manual_seed(seed)
    hf = model_cls(cfg_cls(**{**TINY, **overrides})).eval()
    if overrides.get("attention_bias") or kind == "qwen2":
        # HF initialises biases to zero; make them matter
        with torch.no_grad():
            for name, p in hf.named_parameters():
                if name.endswith("bias"):
                    p.normal_(0, 0.5)
    d = hf.config.to_dict()
    d["architectures"] = [model_cls.__name__]
    ours = LlamaForCausalLM(ModelConfig.from_hf_dict(d))
    ours.load_weights(hf.state_dict().items())
    return hf, ours


def alloc_caches(model, num_blocks: int = 64):  # 2 sequences x BLOCKS_PER_SEQ
    return [torch.zeros(model.kv_cache_shape(num_blocks, BLOCK_SIZE)) for _ in range(model.num_layers)]


def block_table_for(seq_index: int, num_tokens: int, blocks_per_seq: int = 32) -> list[int]:
    """Sequence s owns blocks [32 s, 32 s + 32), handed out in reverse so that a sequence's
    blocks are never contiguous in the cache:  s=1, 9 tokens -> [63, 62, 61]."""
    n = -(-num_tokens // BLOCK_SIZE)
    assert n <= blocks_per_seq, f"test sequence of {num_tokens} tokens needs {n} blocks"
    return [(seq_index + 1) * blocks_per_seq - 1 - j for j in range(n)]


def run_step(model, caches, chunks: list[list[int]], context_lens: list[int], seq_ids: list[int]):
    """One forward over several sequences' new tokens; returns logits for every token."""
    meta = AttentionMetadata.build(
        [len(c) for c in chunks], context_lens,
        [block_table_for(s, ctx + len(c)) for s, c, ctx in zip(seq_ids, chunks, context_lens)],
        BLOCK_SIZE)
    ids = torch.tensor([t for c in chunks for t in c])
    with torch.inference_mode():
        hidden = model(ids, meta.positions(), caches, meta)
        return model.compute_logits(hidden)


def hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([tokens])).logits[0]


def assert_prefill_then_decode_match_hf(hf, ours) -> None:
    """Two sequences prefilled in one batch (11 and 37 tokens, the first cut at 10), then the
    first one's 11th token as a lone decode over its cached context: logits equal HF's."""
    g = torch.Generator().manual_seed(1)
    seq0, seq1 = (torch.randint(0, 256, (n,), generator=g).tolist() for n in (11, 37))
    ref0, ref1 = hf_logits(hf, seq0), hf_logits(hf, seq1)
    caches = alloc_caches(ours)
    out = run_step(ours, caches, [seq0[:10], seq1], [0, 0], [0, 1])
    torch.testing.assert_close(out[:10], ref0[:10], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out[10:], ref1, atol=1e-4, rtol=1e-4)
    out = run_step(ours, caches, [[seq0[10]]], [10], [0])
    torch.testing.assert_close(out[0], ref0[10], atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("case", list(CASES))
def test_prefill_logits_match_hf(case):
    kind, overrides = CASES[case]
    hf, ours = make_pair(kind, **overrides)
    g = torch.Generator().manual_seed(1)
    # two sequences in one batch; the long one reaches positions where rope scaling matters
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (7, 70)]
    logits = run_step(ours, alloc_caches(ours), prompts, [0, 0], [0, 1])
    assert logits.dtype == torch.float32 and logits.shape == (77, 256)
    torch.testing.assert_close(logits[:7], hf_logits(hf, prompts[0]), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits[7:], hf_logits(hf, prompts[1]), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("case", ["llama_tied", "qwen2", "llama3_rope"])
def test_chunked_prefill_then_decode_matches_hf(case):
    """Seq 0: prefill in two chunks, then decodes; seq 1 prefills while seq 0 decodes (mixed
    batch, decodes first). Every step's logits equal HF's on the full sequence."""
    kind, overrides = CASES[case]
    hf, ours = make_pair(kind, **overrides)
    caches = alloc_caches(ours)
    g = torch.Generator().manual_seed(2)
    seq0 = torch.randint(0, 256, (14,), generator=g).tolist()
    seq1 = torch.randint(0, 256, (9,), generator=g).tolist()
    ref0, ref1 = hf_logits(hf, seq0), hf_logits(hf, seq1)

    out = run_step(ours, caches, [seq0[:6]], [0], [0])                       # chunk 1
    torch.testing.assert_close(out, ref0[:6], atol=1e-4, rtol=1e-4)
    out = run_step(ours, caches, [seq0[6:10]], [6], [0])                     # chunk 2, context 6
    torch.testing.assert_close(out, ref0[6:10], atol=1e-4, rtol=1e-4)
    out = run_step(ours, caches, [[seq0[10]]], [10], [0])                    # lone decode
    torch.testing.assert_close(out[0], ref0[10], atol=1e-4, rtol=1e-4)
    out = run_step(ours, caches, [[seq0[11]], seq1[:5]], [11, 0], [0, 1])    # decode + prefill
    torch.testing.assert_close(out[0], ref0[11], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out[1:], ref1[:5], atol=1e-4, rtol=1e-4)
    for step in range(2):                                                    # two decodes
        pos0, pos1 = 12 + step, 5 + step
        out = run_step(ours, caches, [[seq0[pos0]], [seq1[pos1]]], [pos0, pos1], [0, 1])
        torch.testing.assert_close(out[0], ref0[pos0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(out[1], ref1[pos1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("rows", [1, 2, 5, 8, 9, 40])
def test_linear_every_batch_path_matches_float64_reference(rows):
    # the plain method uses a different GEMM form for M = 1, 2..8 and > 8 rows
    torch.manual_seed(rows)
    layer = MergedLinear(24, [10, 6], bias=True)
    w, b = torch.randn(16, 24), torch.randn(16)
    layer.load_shard(0, "weight", w[:10]); layer.load_shard(1, "weight", w[10:])
    layer.load_shard(0, "bias", b[:10]); layer.load_shard(1, "bias", b[10:])
    x = torch.randn(rows, 24)
    y = layer(x)
    assert y.shape == (rows, 16) and y.is_contiguous()
    torch.testing.assert_close(y.double(), x.double() @ w.double().T + b.double(),
                               atol=1e-5, rtol=1e-5)


def test_tied_head_shares_the_embedding_tensor():
    _, tied = make_pair("llama", tie_word_embeddings=True)
    assert tied.lm_head.weight.data_ptr() == tied.model.embed_tokens.weight.data_ptr()
    _, untied = make_pair("llama")
    assert untied.lm_head.weight.data_ptr() != untied.model.embed_tokens.weight.data_ptr()


def test_fused_weights_and_cache_geometry():
    _, ours = make_pair("llama", head_dim=32)
    attn = ours.model.layers[0].self_attn
    # one qkv matmul (4*32 + 2*32 + 2*32 rows) and one gate_up matmul (2 * 128)
    assert attn.qkv_proj.output_sizes == [128, 64, 64]
    assert ours.model.layers[0].mlp.gate_up_proj.output_size == 256
    assert ours.kv_cache_shape(10, BLOCK_SIZE) == (2, 10, BLOCK_SIZE, 2, 32)
    # 2 layers x (K and V) x 2 kv heads x 32 dims x 4 bytes
    assert ours.kv_cache_bytes_per_token() == 2 * 2 * 2 * 32 * 4
    assert not any(p.requires_grad for p in ours.parameters())


def test_qwen2_has_no_o_proj_bias_but_llama_attention_bias_has():
    _, qwen = make_pair("qwen2")
    _, llama = make_pair("llama", attention_bias=True)
    assert qwen.model.layers[0].self_attn.qkv_proj.has_bias
    assert not qwen.model.layers[0].self_attn.o_proj.has_bias
    assert llama.model.layers[0].self_attn.o_proj.has_bias


def test_load_weights_rejects_missing_unknown_and_misshapen():
    hf, ours = make_pair("llama")
    state = dict(hf.state_dict())
    without_k = {k: v for k, v in state.items() if k != "model.layers.1.self_attn.k_proj.weight"}
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.qkv_proj\.weight#1"):
        ours.load_weights(without_k.items())
    with pytest.raises(ValueError, match="model.layers.0.foo.weight"):
        ours.load_weights([*state.items(), ("model.layers.0.foo.weight", torch.zeros(3))])
    bad = dict(state, **{"model.norm.weight": torch.zeros(65)})
    with pytest.raises(ValueError, match="model.norm.weight"):
        ours.load_weights(bad.items())
    bad = dict(state, **{"model.layers.0.mlp.up_proj.weight": torch.zeros(127, 64)})
    with pytest.raises(ValueError, match="127"):
        ours.load_weights(bad.items())


def test_registry_maps_hf_and_gguf_names():
    for arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                 "llama", "mistral", "qwen2"):
        assert get_model_class(arch) is LlamaForCausalLM
    with pytest.raises(ValueError, match=r"'FalconForCausalLM'.*LlamaForCausalLM"):
        get_model_class("FalconForCausalLM")
    assert "qwen2" in supported_architectures()
