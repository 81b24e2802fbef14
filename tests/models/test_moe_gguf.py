"""Mixture-of-experts GGUF files written as llama.cpp writes them: Qwen2-MoE (``qwen2moe``:
experts stacked in ``ffn_{gate,up,down}_exps`` [E, out, in], the router ``ffn_gate_inp``, a
shared expert and its gate ``*_shexp``) and Mixtral (a ``llama`` file with ``expert_count``),
against HF transformers; and experts run natively from the file's blocks."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf import quants

import transformers as tf
from kvforge.loader import load_model_source
from kvforge.quant.gguf_experts import GGUFExpertsMethod
from kvforge.quant.loading import load_model
from tests.helpers.engine_vs_hf import check_engine_matches_hf
from tests.helpers.hf_oracle import TINY_BASE, load_hf_gguf
from tests.kernels.test_cpu_kernels import needs_kernels
from tests.loader.gguf_factory import gpt2_bpe_tokenizer, write_hf_model_gguf

# transformers' GGUF reader ignores the expert widths in the metadata and takes its defaults
# (Qwen1.5-MoE's 1408 and 5632): the tiny model uses them so it can read the file back
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=1408,
           shared_expert_intermediate_size=5632, tie_word_embeddings=False, norm_topk_prob=False)


def _tiny_qwen2_moe() -> tf.Qwen2MoeForCausalLM:
    torch.manual_seed(0)
    hf = tf.Qwen2MoeForCausalLM(tf.Qwen2MoeConfig(**{**TINY_BASE, **MOE})).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("bias"):        # HF starts them at zero: make them matter
                p.normal_(0, 0.5)
            elif "experts" in name:          # HF starts stacked experts small: like the rest
                p.normal_(0, 0.2)
    return hf


@pytest.fixture(scope="module")
def moe_gguf(tmp_path_factory, tokenizer_dir):
    """(HF Qwen2-MoE model, its F32 GGUF path, a Q8_0 GGUF path of the same weights)."""
    hf = _tiny_qwen2_moe()
    tokenizer = gpt2_bpe_tokenizer(tf.AutoTokenizer.from_pretrained(tokenizer_dir), pre="qwen2")
    folder = tmp_path_factory.mktemp("qwen2moe_gguf")
    f32, q8 = str(folder / "tiny-qwen2moe.gguf"), str(folder / "tiny-qwen2moe-q8_0.gguf")
    write_hf_model_gguf(f32, hf, "qwen2moe", tokenizer=tokenizer)

    def q8_0(name, arr):            # projections and experts (2-D and 3-D) in Q8_0 blocks
        if arr.ndim < 2 or name.startswith("token_embd") or "gate_inp" in name:
            return arr, QT.F32
        return quants.quantize(arr, QT.Q8_0), QT.Q8_0
    write_hf_model_gguf(q8, hf, "qwen2moe", tokenizer=tokenizer, encode=q8_0)
    return hf, f32, q8


def test_config_and_per_expert_weights_from_the_stacked_tensors(moe_gguf):
    hf, path, _ = moe_gguf
    c = load_model_source(path).config
    assert c.architecture == "Qwen2MoeForCausalLM"
    assert (c.hf_config["num_experts"], c.hf_config["num_experts_per_tok"]) == (4, 2)
    assert c.hf_config["moe_intermediate_size"] == 1408
    assert c.hf_config["shared_expert_intermediate_size"] == 5632
    weights = dict(load_model_source(path).iter_weights())
    state = hf.state_dict()
    gate_up = state["model.layers.1.mlp.experts.gate_up_proj"]
    torch.testing.assert_close(weights["model.layers.1.mlp.experts.2.gate_proj.weight"],
                               gate_up[2, :1408], rtol=0, atol=0)
    torch.testing.assert_close(weights["model.layers.1.mlp.experts.3.up_proj.weight"],
                               gate_up[3, 1408:], rtol=0, atol=0)
    torch.testing.assert_close(weights["model.layers.0.mlp.experts.1.down_proj.weight"],
                               state["model.layers.0.mlp.experts.down_proj"][1], rtol=0, atol=0)
    for name in ("model.layers.0.mlp.gate.weight", "model.layers.0.mlp.shared_expert_gate.weight",
                 "model.layers.1.mlp.shared_expert.down_proj.weight"):
        torch.testing.assert_close(weights[name], state[name], rtol=0, atol=0)


def test_factory_gguf_reads_back_in_transformers(moe_gguf):
    """transformers' own GGUF loader reads the file as the same model (the names and keys are
    llama.cpp's, not just ours)."""
    hf, path, _ = moe_gguf
    ids = torch.randint(0, 49152, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        torch.testing.assert_close(load_hf_gguf(path)(ids).logits, hf(ids).logits,
                                   rtol=1e-5, atol=1e-5)


def test_engine_greedy_matches_hf(moe_gguf):
    """The default path (the file's F32 blocks, experts included) against HF, token for token."""
    hf, path, _ = moe_gguf
    check_engine_matches_hf(path, hf, "qwen2moe-gguf")


@needs_kernels
def test_q8_0_experts_run_from_the_file_blocks(moe_gguf):
    """Q8_0 experts stay in the file mapping (views per expert) and multiply by the block
    kernels; the model is near the dequantized reference (8-bit activations)."""
    _, _, path = moe_gguf
    source = load_model_source(path)
    native, reference = load_model(source, quantization="gguf"), load_model(source)
    experts = native.model.layers[0].mlp.experts
    assert isinstance(experts.method, GGUFExpertsMethod) and not hasattr(experts, "w13")
    blocks = experts._gguf_expert_blocks[(2, "up")]
    assert blocks.type_name == "Q8_0" and blocks.raw.shape == (1408, 64 // 32 * 34)
    w13, w2 = experts.method.dequantize(experts)
    ref_experts = reference.model.layers[0].mlp.experts
    torch.testing.assert_close(w13, ref_experts.w13, rtol=0, atol=0)
    torch.testing.assert_close(w2, ref_experts.w2, rtol=0, atol=0)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(3))
    logits = torch.randn(5, 4, generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        a, b = experts(x, logits), ref_experts(x, logits)
    assert (a - b).norm() <= 0.02 * b.norm()
    assert not torch.equal(a, b)                      # really the 8-bit kernels, not fp32


def test_mixtral_as_a_llama_file_with_experts(tmp_path, tokenizer_dir):
    """llama.cpp writes Mixtral as ``llama`` plus expert keys (q/k rows permuted as Llama's)."""
    torch.manual_seed(0)
    hf = tf.MixtralForCausalLM(tf.MixtralConfig(**{**TINY_BASE, "num_local_experts": 4,
                                                   "num_experts_per_tok": 2})).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "experts" in name:
                p.normal_(0, 0.2)
    path = str(tmp_path / "tiny-mixtral.gguf")
    write_hf_model_gguf(path, hf, "llama", tokenizer=gpt2_bpe_tokenizer(
        tf.AutoTokenizer.from_pretrained(tokenizer_dir), pre="smollm"))
    c = load_model_source(path).config
    assert c.architecture == "MixtralForCausalLM" and c.hf_config["num_local_experts"] == 4
    check_engine_matches_hf(path, hf, "mixtral-gguf")
