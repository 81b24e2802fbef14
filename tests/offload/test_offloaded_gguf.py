"""Offloading a GGUF file in its own blocks: the store keeps the file's block rows (layers,
embedding, head), the streamed layers multiply them with the kernels the in-memory native run
uses, and greedy tokens equal that run's; the store is the blocks' size, not fp32's."""
from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf import quants

import transformers as tf
from kvforge import LLM, SamplingParams
from kvforge.quant.gguf import GGUFLinearMethod
from tests.distributed.test_tp_gguf import kquant_gguf  # noqa: F401  (fixture)
from tests.helpers.hf_oracle import TINY_BASE
from tests.kernels.test_cpu_kernels import needs_kernels
from tests.loader.gguf_factory import gpt2_bpe_tokenizer, write_hf_model_gguf
from tests.models.test_moe_gguf import moe_gguf  # noqa: F401  (fixture)

PROMPTS = [[5, 6, 7, 100, 2000], list(range(10, 47)), [300 + 7 * i for i in range(19)],
           [11, 12, 13, 14] * 4, [900, 901]]
PARAMS = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
ENGINE = dict(max_model_len=128, max_num_batched_tokens=24, enable_prefix_caching=False)


def _legacy(name: str, arr):
    """Llama-style: projections Q4_0 / Q4_1, an untied head in Q8_0, the embedding Q4_1."""
    if arr.ndim != 2:
        return arr, QT.F32
    if name.startswith("output."):
        qtype = QT.Q8_0
    elif name.startswith("token_embd") or "ffn" in name:
        qtype = QT.Q4_1
    else:
        qtype = QT.Q4_0
    return quants.quantize(arr, qtype), qtype


@pytest.fixture(scope="module")
def llama_legacy_gguf(tmp_path_factory, tokenizer_dir) -> str:
    """A Llama file as llama.cpp writes it (q/k rows in its rotary order), untied head."""
    torch.manual_seed(1)
    hf = tf.LlamaForCausalLM(tf.LlamaConfig(**{**TINY_BASE, "num_hidden_layers": 3,
                                               "tie_word_embeddings": False,
                                               "initializer_range": 0.1})).eval()
    path = str(tmp_path_factory.mktemp("llama_legacy") / "tiny-llama-q4.gguf")
    write_hf_model_gguf(path, hf, "llama", encode=_legacy, tokenizer=gpt2_bpe_tokenizer(
        tf.AutoTokenizer.from_pretrained(tokenizer_dir), pre="smollm"))
    return path


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


@needs_kernels
@pytest.mark.parametrize("file_fixture, policy", [
    ("kquant_gguf", "w=0,kv=0"),            # Q4_K / Q6_K layers, tied Q8_0 embedding = head
    ("llama_legacy_gguf", "w=0,kv=0"),      # Q4_0 / Q4_1 layers, untied Q8_0 head
    ("llama_legacy_gguf", "w=50,kv=50"),    # some layers resident, bound once
])
def test_greedy_identical_to_the_in_memory_native_run(request, file_fixture, policy, tmp_path):
    path = request.getfixturevalue(file_fixture)
    reference = _tokens(LLM(path, kv_cache_memory="16MiB", **ENGINE))
    assert len({t for seq in reference for t in seq}) > 5     # not a model stuck on one token
    llm = LLM(path, offload_dir=str(tmp_path), offload_memory_budget="64MiB",
              offload_policy=policy, offload_batch_size=2, offload_block_batches=3, **ENGINE)
    try:
        assert llm.engine.config.quantization == "gguf"
        assert _tokens(llm) == reference
        model = llm.engine.runner.model
        store = model.store
        assert store.head.get("gguf_type") in ("Q8_0", "Q6_K")
        assert store.embedding["gguf_type"] in ("Q8_0", "Q4_1")
        assert store.bytes_read > 0
        # the layers stream block rows: a layer file holds ~1/4-1/7 of its fp32 size
        fp32_bytes = 4 * sum(e["params"] for e in store.layers[0]["tensors"])
        assert store.layers[0]["nbytes"] < fp32_bytes / 3
        layer = model.inner.model.layers[0]
        method = layer.mlp.gate_up_proj.method
        assert isinstance(method, GGUFLinearMethod)
        llm.engine.check_integrity()
        assert llm.engine.num_free_blocks == llm.engine.runner.num_blocks
    finally:
        llm.engine.shutdown()


@needs_kernels
def test_moe_experts_stream_as_fp32_rows_or_are_refused_as_blocks(moe_gguf, tmp_path):
    """GGUF MoE experts keep their blocks outside the layers' tensors, so the store cannot
    stream them: auto streams the model's fp32 rows instead, an explicit 'gguf' is an error."""
    _, _, q8 = moe_gguf
    reference = _tokens(LLM(q8, quantization="none", kv_cache_memory="16MiB", **ENGINE))
    offload = dict(offload_dir=str(tmp_path), offload_memory_budget="64MiB",
                   offload_policy="w=0,kv=0", offload_batch_size=2, offload_block_batches=2)
    llm = LLM(q8, **offload, **ENGINE)
    try:
        assert llm.engine.config.quantization == "none"
        assert _tokens(llm) == reference
    finally:
        llm.engine.shutdown()
    with pytest.raises(ValueError, match="MoE experts"):
        LLM(q8, quantization="gguf", **offload, **ENGINE)


def test_families_the_streamed_layers_do_not_run_are_refused(tiny_model_factory, tmp_path):
    path, _ = tiny_model_factory("gpt2")          # learned positions, no RoPE: not streamed
    with pytest.raises(ValueError, match="GPT2LMHeadModel is not supported"):
        LLM(path, quantization="none", offload_dir=str(tmp_path),
            offload_memory_budget="64MiB", **ENGINE)
    assert not list(tmp_path.iterdir())          # refused before any store was built


def test_quantization_other_than_gguf_or_none_is_refused(tmp_path):
    from kvforge.config import EngineConfig
    with pytest.raises(ValueError, match="quantization='int4'"):
        EngineConfig(offload_memory_budget="64MiB", offload_dir=str(tmp_path),
                     quantization="int4")
