"""DeepSeek-V2 (MLA + DeepSeek-MoE) vs HF transformers' DeepseekV2ForCausalLM (the oracle)."""
from __future__ import annotations

import random

import pytest
import torch

import transformers as tf
from kvforge import LLM, SamplingParams
from kvforge.attention.metadata import AttentionMetadata
from kvforge.cli import main as cli_main
from kvforge.models.config import ModelConfig
from kvforge.models.deepseek_v2 import DeepseekV2ForCausalLM
from kvforge.models.registry import get_model_class
from tests.helpers.hf_oracle import check_greedy_close, hf_greedy

BLOCK = 4
MLA = dict(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
MOE = dict(n_routed_experts=6, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
           moe_intermediate_size=32)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            vocab_size=256, max_position_embeddings=256, initializer_range=0.1, **MLA, **MOE)
CASES = {
    "q_plain": dict(q_lora_rank=None),
    "q_lora": dict(q_lora_rank=24),
    "group_limited_scaled": dict(q_lora_rank=None, topk_method="group_limited_greedy", n_group=3,
                                 topk_group=2, routed_scaling_factor=2.5),
    "all_dense_tied": dict(q_lora_rank=None, first_k_dense_replace=3, tie_word_embeddings=True),
}


def make_pair(case: str, seed: int = 0):
    torch.manual_seed(seed)
    hf = tf.DeepseekV2ForCausalLM(tf.DeepseekV2Config(**{**TINY, **CASES[case]})).eval()
    d = hf.config.to_dict()
    d["architectures"] = ["DeepseekV2ForCausalLM"]
    ours = DeepseekV2ForCausalLM(ModelConfig.from_hf_dict(d))
    ours.load_weights(hf.state_dict().items())
    return hf, ours


def run_step(model, caches, chunks, context_lens, tables):
    meta = AttentionMetadata.build([len(c) for c in chunks], context_lens, tables, BLOCK)
    with torch.inference_mode():
        hidden = model(torch.tensor([t for c in chunks for t in c]), meta.positions(), caches, meta)
        return model.compute_logits(hidden)


def hf_logits(hf, tokens):
    with torch.inference_mode():
        return hf(torch.tensor([tokens])).logits[0]


@pytest.mark.parametrize("case", list(CASES))
def test_prefill_chunk_and_decode_logits_match_hf(case):
    """Seq 0 prefills in two chunks then decodes beside seq 1's prefill (mixed batch)."""
    hf, ours = make_pair(case)
    caches = [torch.zeros(ours.kv_cache_shape(32, BLOCK)) for _ in range(ours.num_layers)]
    g = torch.Generator().manual_seed(1)
    seq0 = torch.randint(0, 256, (13,), generator=g).tolist()
    seq1 = torch.randint(0, 256, (9,), generator=g).tolist()
    t0, t1 = [31, 7, 30, 8], [2, 29, 12]                    # scattered block ids
    ref0, ref1 = hf_logits(hf, seq0), hf_logits(hf, seq1)
    close = dict(atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(run_step(ours, caches, [seq0[:6]], [0], [t0[:2]]), ref0[:6], **close)
    torch.testing.assert_close(run_step(ours, caches, [seq0[6:12]], [6], [t0[:3]]), ref0[6:12], **close)
    out = run_step(ours, caches, [[seq0[12]], seq1], [12, 0], [t0[:4], t1])
    torch.testing.assert_close(out[0], ref0[12], **close)
    torch.testing.assert_close(out[1:], ref1, **close)


def test_kv_bytes_per_token_is_the_latent_and_meta_construction_works():
    hf, _ = make_pair("q_plain")
    d = hf.config.to_dict()
    d["architectures"] = ["DeepseekV2ForCausalLM"]
    cfg = ModelConfig.from_hf_dict(d)
    model = get_model_class("DeepseekV2ForCausalLM")(cfg, device="meta")   # as `kvforge info`
    entry = MLA["kv_lora_rank"] + MLA["qk_rope_head_dim"]
    assert model.kv_cache_shape(10, BLOCK) == (1, 10, BLOCK, entry)
    assert model.kv_cache_bytes_per_token() == entry * 4 * TINY["num_hidden_layers"]
    # an MHA cache of the same model would hold K and V per head: 4 * (24 + 16) values
    assert entry < TINY["num_attention_heads"] * (16 + 8 + 16)


def test_bad_configs_raise_value_error():
    hf, _ = make_pair("q_plain")
    d = hf.config.to_dict()
    d["architectures"] = ["DeepseekV2ForCausalLM"]
    with pytest.raises(ValueError, match="attention_backend 'tiled'"):
        DeepseekV2ForCausalLM(ModelConfig.from_hf_dict(d), attn_backend="tiled", device="meta")
    with pytest.raises(ValueError, match="lacks MLA fields"):
        DeepseekV2ForCausalLM(ModelConfig.from_hf_dict({**d, "kv_lora_rank": None}), device="meta")
    with pytest.raises(ValueError, match="topk_method 'noaux_tc'"):
        DeepseekV2ForCausalLM(ModelConfig.from_hf_dict({**d, "topk_method": "noaux_tc"}),
                              device="meta")
    _, ours = make_pair("q_plain")
    with pytest.raises(ValueError, match="unexpected weight"):
        ours.load_weights([("model.layers.0.self_attn.k_proj.weight", torch.zeros(4, 4))])
    with pytest.raises(ValueError, match="weights missing"):
        ours.load_weights([])


# ------------------------------------------------------------------ through the engine (LLM)
# num_key_value_heads = heads: HF DeepSeek-V2 expands K/V to every head itself (TINY_BASE has 2)
ENGINE_OVERRIDES = dict(q_lora_rank=None, num_hidden_layers=3, num_key_value_heads=4, **MLA, **MOE)


MAX_TOKENS = 12


def random_prompts(seed: int, lengths=(3, 17, 40, 1)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module")
def tiny_deepseek(tiny_model_factory):
    """(model dir, prompts, HF greedy (tokens, logprobs) per prompt), HF run once per module."""
    path, hf_model = tiny_model_factory("deepseek_v2", **ENGINE_OVERRIDES)
    prompts = random_prompts(5)
    return path, prompts, [hf_greedy(hf_model, p, MAX_TOKENS) for p in prompts]


@pytest.mark.slow
@pytest.mark.parametrize("engine_kwargs,expect_preemption", [
    (dict(num_kv_blocks=128, max_num_batched_tokens=256), False),     # one batch, whole prompts
    (dict(num_kv_blocks=128, max_num_batched_tokens=7, max_num_seqs=3), False),   # chunked
    (dict(num_kv_blocks=16, max_num_batched_tokens=32), True),         # pool forces preemption
], ids=["batched", "chunked", "preempting"])
def test_engine_greedy_matches_hf(tiny_deepseek, engine_kwargs, expect_preemption):
    path, prompts, hf_refs = tiny_deepseek
    llm = LLM(path, block_size=BLOCK, **engine_kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=4)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out, (hf_tokens, hf_lps) in zip(prompts, outs, hf_refs):
        check_greedy_close(out.outputs[0].token_ids, out.outputs[0].logprobs, hf_tokens, hf_lps,
                           name=f"len={len(prompt)}")
    preemptions = sum(o.metrics.num_preemptions for o in outs)
    assert (preemptions > 0) == expect_preemption, f"{preemptions} preemptions"
    llm.engine.check_integrity()
    assert llm.engine.num_free_blocks == engine_kwargs["num_kv_blocks"]


def test_cli_info_reports_latent_kv_bytes(tiny_deepseek, capsys):
    path = tiny_deepseek[0]
    assert cli_main(["info", path]) == 0
    out = capsys.readouterr().out
    assert "DeepseekV2ForCausalLM" in out
    assert f"{(32 + 8) * 4 * 3} bytes per token" in out
