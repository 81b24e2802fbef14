"""Mixtral (Llama attention + top-2 sparse MoE) against HF transformers."""
from __future__ import annotations

import pytest
import torch

import transformers as tf
from kvforge.layers.moe import FusedMoE
from kvforge.models.config import ModelConfig
from kvforge.models.mixtral import MixtralForCausalLM
from tests.helpers.engine_vs_hf import check_engine_matches_hf
from tests.models.test_llama import assert_prefill_then_decode_match_hf

TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=256,
            num_local_experts=4, num_experts_per_tok=2, initializer_range=0.1)


def make_pair(seed: int = 0, **overrides):
    torch.manual_seed(seed)
    hf = tf.MixtralForCausalLM(tf.MixtralConfig(**{**TINY, **overrides})).eval()
    d = hf.config.to_dict()
    d["architectures"] = ["MixtralForCausalLM"]
    ours = MixtralForCausalLM(ModelConfig.from_hf_dict(d))
    ours.load_weights(hf.state_dict().items())      # transformers-5 stacked expert tensors
    return hf, ours


def test_prefill_and_decode_logits_match_hf():
    hf, ours = make_pair()
    assert_prefill_then_decode_match_hf(hf, ours)


def test_legacy_per_expert_checkpoint_names_load_the_same(tmp_path):
    hf, ours = make_pair(num_hidden_layers=1)
    hf.save_pretrained(tmp_path)          # writes block_sparse_moe.experts.e.w1/w2/w3 names
    from kvforge.loader.source import load_model_source
    src = load_model_source(str(tmp_path))
    names = [n for n, _ in src.iter_weights()]
    assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in names
    fresh = MixtralForCausalLM(src.config)
    fresh.load_weights(src.iter_weights())
    for name, p in ours.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], p), name
    moe = fresh.model.layers[0].mlp.experts
    assert isinstance(moe, FusedMoE) and tuple(moe.w13.shape) == (4, 2 * 96, 64)


def test_missing_expert_is_reported():
    hf, ours = make_pair(num_hidden_layers=1)
    state = dict(hf.state_dict())
    # legacy names with one expert's up projection (w3) missing
    legacy = {}
    for k, v in state.items():
        if k.endswith("mlp.experts.gate_up_proj"):
            base = k.removesuffix("gate_up_proj").replace(".mlp.", ".block_sparse_moe.")
            for e in range(4):
                legacy[f"{base}{e}.w1.weight"] = v[e, :96]
                if e != 2:
                    legacy[f"{base}{e}.w3.weight"] = v[e, 96:]
        elif k.endswith("mlp.experts.down_proj"):
            base = k.removesuffix("down_proj").replace(".mlp.", ".block_sparse_moe.")
            for e in range(4):
                legacy[f"{base}{e}.w2.weight"] = v[e]
        else:
            legacy[k] = v
    with pytest.raises(ValueError, match=r"\(2, 'up'\)"):
        MixtralForCausalLM(ours.config).load_weights(legacy.items())
    with pytest.raises(ValueError, match="expert id 9 out of range"):
        MixtralForCausalLM(ours.config).load_weights(
            [*state.items(), ("model.layers.0.block_sparse_moe.experts.9.w1.weight",
                              torch.zeros(96, 64))])


@pytest.mark.slow
def test_engine_greedy_matches_hf(tiny_model_factory):
    path, hf_model = tiny_model_factory("mixtral", num_local_experts=4, num_experts_per_tok=2,
                                        initializer_range=0.1)
    check_engine_matches_hf(path, hf_model, "mixtral")
