"""FusedMoE: routing and grouped expert GEMMs against HF Mixtral's MoE block and a per-token loop."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import transformers as tf
from kvforge.layers.moe import FusedMoE, select_experts

E, K, H, I = 6, 2, 16, 24


# ------------------------------------------------------------------------------ factories
def make_moe(renormalize: bool = True, seed: int = 0, **kw) -> FusedMoE:
    """A FusedMoE with random experts, loaded one HF per-expert tensor at a time."""
    g = torch.Generator().manual_seed(seed)
    moe = FusedMoE(kw.pop("num_experts", E), kw.pop("top_k", K), H, I, renormalize=renormalize, **kw)
    for e in range(moe.num_experts):
        moe.load_expert_weight(e, "gate", torch.randn(I, H, generator=g) * 0.3)
        moe.load_expert_weight(e, "up", torch.randn(I, H, generator=g) * 0.3)
        moe.load_expert_weight(e, "down", torch.randn(H, I, generator=g) * 0.3)
    moe.check_loaded()
    return moe


def per_token_reference(moe: FusedMoE, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """The definition, one token and one chosen expert at a time."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        probs = torch.softmax(logits[t].double(), -1)
        top = torch.topk(probs, moe.top_k)
        weights = top.values / top.values.sum() if moe.renormalize else top.values
        for w, e in zip(weights, top.indices.tolist()):
            gate = x[t] @ moe.w13[e, :I].T
            up = x[t] @ moe.w13[e, I:].T
            out[t] += float(w) * ((F.silu(gate) * up) @ moe.w2[e].T)
    return out


# ---------------------------------------------------------------------------------- tests
def test_select_experts_renormalises_only_when_asked():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    w, ids = select_experts(logits, 2, renormalize=False)
    probs = torch.softmax(logits, -1)[0]
    assert ids.tolist() == [[0, 1]] and ids.dtype == torch.int64
    torch.testing.assert_close(w[0], probs[:2])               # share of the full softmax
    w, _ = select_experts(logits, 2, renormalize=True)
    torch.testing.assert_close(w[0], probs[:2] / probs[:2].sum())
    assert w.dtype == torch.float32


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("num_tokens", [1, 7, 40])
def test_fused_moe_matches_per_token_loop(renormalize, num_tokens):
    moe = make_moe(renormalize)
    g = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, H, generator=g)
    logits = torch.randn(num_tokens, E, generator=g) * 2
    torch.testing.assert_close(moe(x, logits), per_token_reference(moe, x, logits),
                               atol=1e-5, rtol=1e-5)


def test_fused_moe_matches_hf_mixtral_block():
    torch.manual_seed(0)
    config = tf.MixtralConfig(hidden_size=H, intermediate_size=I, num_local_experts=E,
                              num_experts_per_tok=K)
    hf = tf.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock(config).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.3)
    moe = FusedMoE(E, K, H, I, renormalize=True)
    moe.load_stacked("gate_up_proj", hf.experts.gate_up_proj.data)
    moe.load_stacked("down_proj", hf.experts.down_proj.data)
    moe.check_loaded()
    x = torch.randn(1, 23, H)
    router = hf.gate.weight.data
    with torch.no_grad():
        expected = hf(x)[0]
    torch.testing.assert_close(moe(x[0], x[0] @ router.T), expected, atol=1e-5, rtol=1e-5)


def test_unrouted_experts_are_skipped_and_all_tokens_to_one_expert_work():
    moe = make_moe(num_experts=4, top_k=1)
    x = torch.randn(9, H)
    logits = torch.full((9, 4), -10.0)
    logits[:, 2] = 10.0                                        # every token picks expert 2
    expected = (F.silu(x @ moe.w13[2, :I].T) * (x @ moe.w13[2, I:].T)) @ moe.w2[2].T
    torch.testing.assert_close(moe(x, logits), expected, atol=1e-5, rtol=1e-5)


def test_loading_rejects_bad_input():
    moe = FusedMoE(E, K, H, I)
    with pytest.raises(ValueError, match="expert id 6"):
        moe.load_expert_weight(6, "gate", torch.zeros(I, H))
    with pytest.raises(ValueError, match="shape"):
        moe.load_expert_weight(0, "down", torch.zeros(I, H))
    with pytest.raises(ValueError, match="unknown expert shard"):
        moe.load_expert_weight(0, "w1", torch.zeros(I, H))
    moe.load_expert_weight(0, "gate", torch.zeros(I, H))
    with pytest.raises(ValueError, match=r"never loaded.*\(0, 'up'\)"):
        moe.check_loaded()
    with pytest.raises(ValueError, match="top_k 7"):
        FusedMoE(E, 7, H, I)
    with pytest.raises(ValueError, match="router_logits shape"):
        make_moe()(torch.zeros(3, H), torch.zeros(3, E + 1))
