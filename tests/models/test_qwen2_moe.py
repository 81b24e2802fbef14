"""Qwen2-MoE (routed experts + sigmoid-gated shared expert, dense layers mixed in) against HF."""
from __future__ import annotations

import pytest
import torch

import transformers as tf
from kvforge.layers.moe import FusedMoE
from kvforge.models.config import ModelConfig
from kvforge.models.llama import LlamaMLP
from kvforge.models.qwen2_moe import Qwen2MoeForCausalLM
from tests.helpers.engine_vs_hf import check_engine_matches_hf
from tests.models.test_llama import assert_prefill_then_decode_match_hf

TINY = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
            shared_expert_intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=256, num_experts=4,
            num_experts_per_tok=2, mlp_only_layers=[1], initializer_range=0.1)


def make_pair(seed: int = 0, **overrides):
    torch.manual_seed(seed)
    hf = tf.Qwen2MoeForCausalLM(tf.Qwen2MoeConfig(**{**TINY, **overrides})).eval()
    with torch.no_grad():                  # HF initialises q/k/v biases to 0: make them matter
        for name, p in hf.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    d = hf.config.to_dict()
    d["architectures"] = ["Qwen2MoeForCausalLM"]
    ours = Qwen2MoeForCausalLM(ModelConfig.from_hf_dict(d))
    ours.load_weights(hf.state_dict().items())
    return hf, ours


@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_prefill_and_decode_logits_match_hf(norm_topk_prob):
    hf, ours = make_pair(norm_topk_prob=norm_topk_prob)
    layers = ours.model.layers
    assert isinstance(layers[0].mlp.experts, FusedMoE) and isinstance(layers[1].mlp, LlamaMLP)
    assert layers[0].mlp.experts.renormalize is norm_topk_prob
    assert_prefill_then_decode_match_hf(hf, ours)


def test_saved_per_expert_names_load_the_same(tmp_path):
    hf, ours = make_pair()
    hf.save_pretrained(tmp_path)          # mlp.experts.e.{gate,up,down}_proj names on disk
    from kvforge.loader.source import load_model_source
    src = load_model_source(str(tmp_path))
    assert any(".mlp.experts.3.up_proj.weight" in n for n, _ in src.iter_weights())
    fresh = Qwen2MoeForCausalLM(src.config)
    fresh.load_weights(src.iter_weights())
    for name, p in ours.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], p), name


@pytest.mark.slow
def test_engine_greedy_matches_hf(tiny_model_factory):
    path, hf_model = tiny_model_factory("qwen2_moe", moe_intermediate_size=32,
                                        shared_expert_intermediate_size=96, num_experts=4,
                                        num_experts_per_tok=2, initializer_range=0.1)
    check_engine_matches_hf(path, hf_model, "qwen2_moe")
