"""Weight-only INT8 / INT4 MoE experts: the packed per-expert kernels match a dequantize-then-
matmul reference, only routed experts run, and quantized tiny MoE models stay close to fp32."""
from __future__ import annotations

import pytest
import torch

from kvforge import LLM, SamplingParams
from kvforge.layers.linear import UnquantizedLinearMethod
from kvforge.layers.moe import FusedMoE, select_experts
from kvforge.loader.source import load_model_source
from kvforge.quant.loading import load_model
from kvforge.quant.moe_experts import Int4ExpertsMethod, Int8ExpertsMethod
from kvforge.quant.serialize import save_quantized
from tests.quant.factories import rel_err
from tests.quant.test_weight_only_models import _logits

E, H, I, TOP_K = 6, 96, 80, 2      # I = 80: INT4 pads the down projection's input to groups
MOE_MODELS = {"mixtral": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=96),
              "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                                shared_expert_intermediate_size=96),
              "deepseek_v2": dict(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                                  v_head_dim=16, q_lora_rank=None, n_routed_experts=6,
                                  num_experts_per_tok=2, n_shared_experts=1,
                                  first_k_dense_replace=1, moe_intermediate_size=32)}


def expert_weights(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(E, 2 * I, H, generator=g) * 0.05, torch.randn(E, H, I, generator=g) * 0.05)


def build_moe(method, w13, w2) -> FusedMoE:
    moe = FusedMoE(E, TOP_K, H, I, method=method)
    for e in range(E):
        moe.load_expert_weight(e, "gate", w13[e, :I])
        moe.load_expert_weight(e, "up", w13[e, I:])
        moe.load_expert_weight(e, "down", w2[e])
    moe.check_loaded()
    moe.process_weights_after_loading()
    return moe


def reference_moe(hidden, weights, ids, w13, w2):
    """Per token, per chosen expert, written out with float matmuls (bf16-rounded inputs, as
    the kernels take)."""
    out = torch.zeros_like(hidden)
    for t in range(hidden.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate_up = hidden[t].to(torch.bfloat16).float() @ w13[e].t()
            act = torch.nn.functional.silu(gate_up[:I]) * gate_up[I:]
            out[t] += weights[t, j] * (act.to(torch.bfloat16).float() @ w2[e].t())
    return out


@pytest.mark.parametrize("method", [Int8ExpertsMethod(), Int4ExpertsMethod(32),
                                    Int4ExpertsMethod(64), Int4ExpertsMethod(128)],
                         ids=["int8", "int4-g32", "int4-g64", "int4-g128"])
def test_quantized_experts_match_dequantize_then_matmul_reference(method):
    w13, w2 = expert_weights()
    moe = build_moe(method, w13, w2)
    assert all(p.dtype in (torch.int8, torch.uint8, torch.bfloat16) for p in moe.parameters())
    deq13, deq2 = method.dequantize(moe)
    assert rel_err(deq13, w13) < (0.01 if isinstance(method, Int8ExpertsMethod) else 0.15)
    g = torch.Generator().manual_seed(1)
    hidden, logits = torch.randn(9, H, generator=g), torch.randn(9, E, generator=g)
    weights, ids = select_experts(logits, TOP_K, renormalize=True)
    out = moe(hidden, logits)
    assert out.dtype == torch.float32 and out.shape == (9, H)
    # the kernels' bf16 outputs: ~1% of the output's scale
    assert rel_err(out, reference_moe(hidden, weights, ids, deq13, deq2)) < 1e-2


@pytest.mark.parametrize("method", [Int8ExpertsMethod(), Int4ExpertsMethod(64)],
                         ids=["int8", "int4"])
def test_only_routed_experts_run(method, monkeypatch):
    w13, w2 = expert_weights()
    moe = build_moe(method, w13, w2)
    called = []
    real = method.expert_forward
    monkeypatch.setattr(method, "expert_forward",
                        lambda layer, e, x: called.append(e) or real(layer, e, x))
    logits = torch.full((5, E), -10.0)
    logits[:, 1] = logits[:, 4] = 5.0                       # every token picks experts 1 and 4
    moe(torch.randn(5, H), logits)
    assert sorted(called) == [1, 4]


@pytest.mark.parametrize("kind", sorted(MOE_MODELS))
@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_moe_model_greedy_close_to_fp32(tiny_model_factory, kind, quantization):
    """Same tokens as fp32, or where they part, each side's token is in the other's top 5."""
    hf_dir, _ = tiny_model_factory(kind, **MOE_MODELS[kind])
    kw = dict(kv_cache_memory="8MiB")
    quant = LLM(hf_dir, quantization=quantization,
                quantization_args={"group_size": 32} if quantization == "int4" else None, **kw)
    model = quant.engine.runner.model
    moe = next(m for m in model.modules() if isinstance(m, FusedMoE))
    assert type(moe.method).__name__.lower().startswith(quantization)
    routers = [m for n, m in model.named_modules() if n.endswith("mlp.gate")]
    assert routers and all(type(getattr(r, "method", UnquantizedLinearMethod())) is
                           UnquantizedLinearMethod for r in routers)     # routers stay float
    prompts = [[1, 504, 3458, 282, 4649, 314], [1, 1780, 253, 1115, 314, 253, 7089, 30]]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=5)
    ours = quant.generate(prompts, params, use_tqdm=False)
    quant.engine.check_integrity()
    assert quant.engine.num_free_blocks == quant.engine.runner.num_blocks
    ref = LLM(hf_dir, **kw).generate(prompts, params, use_tqdm=False)
    for a, b in zip(ours, ref):
        qa, fa = a.outputs[0], b.outputs[0]
        for i, (tq, tf) in enumerate(zip(qa.token_ids, fa.token_ids)):
            if tq != tf:
                assert tf in qa.logprobs[i] and tq in fa.logprobs[i], (i, tq, tf)
                break


@pytest.mark.parametrize("kind", sorted(MOE_MODELS))
@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_moe_model_saves_and_reloads_identically(tiny_model_factory, tmp_path, kind,
                                                          quantization):
    hf_dir, _ = tiny_model_factory(kind, **MOE_MODELS[kind])
    source = load_model_source(hf_dir)
    model = load_model(source, quantization=quantization)
    out = save_quantized(model, source, str(tmp_path / "q"))
    reloaded = load_model(load_model_source(out))
    params, again = dict(model.named_parameters()), dict(reloaded.named_parameters())
    assert params.keys() == again.keys()
    for name, p in params.items():
        assert torch.equal(p, again[name]), name
    assert torch.equal(_logits(model, [1, 504, 3458, 282]), _logits(reloaded, [1, 504, 3458, 282]))


def test_float_moe_model_saved_with_quantized_linears_reloads(tiny_model_factory, tmp_path):
    """awq keeps experts float: they are saved as per-expert HF shards and load back."""
    hf_dir, _ = tiny_model_factory("mixtral", **MOE_MODELS["mixtral"])
    source = load_model_source(hf_dir)
    model = load_model(source, quantization="smoothquant")
    out = save_quantized(model, source, str(tmp_path / "sq"))
    reloaded = load_model(load_model_source(out))
    moe, moe2 = model.model.layers[1].mlp.experts, reloaded.model.layers[1].mlp.experts
    assert type(moe.method).__name__ == "UnquantizedExpertsMethod"
    assert torch.equal(moe.w13, moe2.w13) and torch.equal(moe.w2, moe2.w2)
    assert torch.equal(_logits(model, [1, 504, 3458, 282]), _logits(reloaded, [1, 504, 3458, 282]))


def test_int4_experts_missing_a_partner_shard_is_reported():
    w13, _ = expert_weights()
    moe = FusedMoE(E, TOP_K, H, I, method=Int4ExpertsMethod(32))
    moe.load_expert_weight(0, "gate", w13[0, :I])
    with pytest.raises(ValueError, match=r"partner shard .*\(0, 'gate'\)"):
        moe.process_weights_after_loading()


def test_bad_int4_experts_group_rejected():
    with pytest.raises(ValueError, match="group_size must be one of"):
        Int4ExpertsMethod(48)
