"""GPT-2 (MHA, Conv1D weights) and GPTBigCode (MQA) against HF transformers."""
from __future__ import annotations

import pytest
import torch

import transformers as tf
from kvforge.models.config import ModelConfig
from kvforge.models.gpt2 import GPT2LMHeadModel
from kvforge.models.gpt_bigcode import GPTBigCodeForCausalLM
from tests.helpers.engine_vs_hf import check_engine_matches_hf
from tests.models.test_llama import alloc_caches, hf_logits, run_step

TINY = dict(n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=128,
            initializer_range=0.1, bos_token_id=1, eos_token_id=2)
CASES = {
    "gpt2": (tf.GPT2Config, tf.GPT2LMHeadModel, {}),
    "gpt2_inverse_layer_scale_n_inner": (tf.GPT2Config, tf.GPT2LMHeadModel,
                                         {"scale_attn_by_inverse_layer_idx": True, "n_inner": 96}),
    "bigcode_mqa": (tf.GPTBigCodeConfig, tf.GPTBigCodeForCausalLM, {}),
    "bigcode_mha": (tf.GPTBigCodeConfig, tf.GPTBigCodeForCausalLM, {"multi_query": False}),
}
OURS = {"GPT2LMHeadModel": GPT2LMHeadModel, "GPTBigCodeForCausalLM": GPTBigCodeForCausalLM}


def make_pair(case: str, seed: int = 0):
    cfg_cls, model_cls, overrides = CASES[case]
    torch.manual_seed(seed)
    hf = model_cls(cfg_cls(**{**TINY, **overrides})).eval()
    with torch.no_grad():     # HF initialises biases and LayerNorms to 0 / 1: make them matter
        for name, p in hf.named_parameters():
            if name.endswith("bias") or ".ln_" in name:
                p.normal_(0.5 if name.endswith("weight") else 0.0, 0.3)
    d = hf.config.to_dict()
    d["architectures"] = [model_cls.__name__]
    ours = OURS[model_cls.__name__](ModelConfig.from_hf_dict(d))
    ours.load_weights(hf.state_dict().items())
    return hf, ours


@pytest.mark.parametrize("case", list(CASES))
def test_prefill_and_chunked_decode_logits_match_hf(case):
    hf, ours = make_pair(case)
    g = torch.Generator().manual_seed(1)
    seq0, seq1 = (torch.randint(0, 256, (n,), generator=g).tolist() for n in (13, 40))
    ref0, ref1 = hf_logits(hf, seq0), hf_logits(hf, seq1)
    caches = alloc_caches(ours)
    out = run_step(ours, caches, [seq0[:6], seq1], [0, 0], [0, 1])        # two prefills
    torch.testing.assert_close(out[:6], ref0[:6], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out[6:], ref1, atol=1e-4, rtol=1e-4)
    out = run_step(ours, caches, [seq0[6:12]], [6], [0])                  # chunk with context
    torch.testing.assert_close(out, ref0[6:12], atol=1e-4, rtol=1e-4)
    out = run_step(ours, caches, [[seq0[12]]], [12], [0])                 # decode
    torch.testing.assert_close(out[0], ref0[12], atol=1e-4, rtol=1e-4)


def test_mqa_caches_one_kv_head():
    _, mha = make_pair("gpt2")
    _, mqa = make_pair("bigcode_mqa")
    # 2 layers x (K and V) x heads x head_dim 16 x 4 bytes
    assert mha.kv_cache_bytes_per_token() == 2 * 2 * 4 * 16 * 4
    assert mqa.kv_cache_bytes_per_token() == 2 * 2 * 1 * 16 * 4
    assert mqa.kv_cache_shape(10, 4) == (2, 10, 4, 1, 16)


def test_original_openai_names_and_mask_buffers_load():
    hf, ours = make_pair("gpt2")
    # the OpenAI checkpoints: no "transformer." prefix, causal masks stored as attn.bias
    legacy = {k.removeprefix("transformer."): v for k, v in hf.state_dict().items()}
    legacy["h.0.attn.bias"] = torch.ones(1, 1, 128, 128)
    legacy["h.0.attn.masked_bias"] = torch.tensor(-1e4)
    fresh = GPT2LMHeadModel(ours.config)
    fresh.load_weights(legacy.items())
    for name, p in ours.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], p), name


def test_load_weights_rejects_missing_unknown_and_misshapen():
    hf, ours = make_pair("gpt2")
    state = dict(hf.state_dict())
    with pytest.raises(ValueError, match=r"h\.1\.attn\.c_attn\.bias"):
        ours.load_weights({k: v for k, v in state.items()
                           if k != "transformer.h.1.attn.c_attn.bias"}.items())
    with pytest.raises(ValueError, match="unexpected weight"):
        ours.load_weights([*state.items(), ("transformer.h.0.attn.rotary.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match="wpe"):
        ours.load_weights([*state.items(), ("transformer.wpe.weight", torch.zeros(3, 64))])


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gpt2", "gpt_bigcode"])
def test_engine_greedy_matches_hf(kind, tiny_model_factory):
    path, hf_model = tiny_model_factory(kind, initializer_range=0.1)
    check_engine_matches_hf(path, hf_model, kind)


def test_kvforge_info_reports_mqa_kv_bytes(tiny_model_factory, capsys):
    from kvforge.cli import main
    path, _ = tiny_model_factory("gpt_bigcode", initializer_range=0.1)
    assert main(["info", path]) == 0
    out = capsys.readouterr().out
    # 2 layers x (K and V) x ONE kv head x head_dim 16 x 4 bytes (fp32)
    assert "GPTBigCodeForCausalLM" in out and "256 bytes per token" in out, out
