"""The engine on an accelerator, against HF transformers on the CPU (the oracle) and against
itself on the CPU.

CPU is the tested path (CI has no GPU); these run on ``KVFORGE_TEST_DEVICE`` (default ``cuda``)
wherever torch has it, and are skipped elsewhere. They cover what moves data between devices: every model family's forward
and sampling on the device, chunked prefill and recompute preemption (three schedules each),
swap preemption through the CUDA copy stream, the prefix cache, n-gram speculation, weight
quantizers and the fp8 KV cache (lossy: compared with the same method on the CPU), grammar
masks, and GGUF files (which run dequantized off the CPU: the block kernels are CPU code).
"""
from __future__ import annotations

import json
import os
import random

import pytest
import torch

from kvforge import LLM, SamplingParams
from tests.helpers.engine_vs_hf import check_engine_matches_hf
from tests.helpers.hf_oracle import check_greedy_close, hf_greedy
from tests.models.test_deepseek_v2 import ENGINE_OVERRIDES as DEEPSEEK_OVERRIDES
from tests.models.test_gemma3 import gemma_files  # noqa: F401  (fixture)
from tests.models.test_qwen2_gguf import qwen_gguf  # noqa: F401  (fixture)

CUDA = os.environ.get("KVFORGE_TEST_DEVICE", "cuda")


def _device_present(name: str) -> bool:
    kind = torch.device(name).type
    return kind == "cpu" or bool(getattr(torch, kind, None) and getattr(torch, kind).is_available())


pytestmark = pytest.mark.skipif(not _device_present(CUDA), reason=f"no {CUDA} device")
FAMILIES = {
    "llama": {},
    "qwen2": {"tie_word_embeddings": True},
    "mistral": {"sliding_window": None},
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, initializer_range=0.1),
    "qwen2_moe": dict(moe_intermediate_size=32, shared_expert_intermediate_size=96,
                      num_experts=4, num_experts_per_tok=2, initializer_range=0.1),
    "gpt2": dict(initializer_range=0.1),
    "deepseek_v2": DEEPSEEK_OVERRIDES,
}
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=4)


def prompts(seed: int, lengths=(5, 33, 18, 47), vocab: int = 49152) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def generate(llm: LLM, prompt_ids, params=GREEDY):
    return [o.outputs[0] for o in llm.generate(prompt_ids, params, use_tqdm=False)]


def assert_clean(llm: LLM) -> None:
    llm.engine.check_integrity()
    assert llm.engine.num_free_blocks == llm.engine.runner.num_blocks, "leaked KV blocks"


def test_kv_cache_and_weights_live_on_the_device(tiny_model_factory):
    path, _ = tiny_model_factory("llama")
    llm = LLM(path, device=CUDA, num_kv_blocks=32, block_size=4)
    runner = llm.engine.runner
    want = torch.device(CUDA).type
    assert all(c.device.type == want for c in runner.kv_caches)
    assert all(p.device.type == want for p in runner.model.parameters())


@pytest.mark.parametrize("kind", list(FAMILIES))
def test_family_greedy_matches_hf(kind, tiny_model_factory):
    """One batch, chunked prefill and a pool that preempts (tests/helpers/engine_vs_hf.py)."""
    path, hf_model = tiny_model_factory(kind, **FAMILIES[kind])
    check_engine_matches_hf(path, hf_model, f"{kind}-cuda", device=CUDA)


def test_gguf_files_run_dequantized(qwen_gguf, gemma_files):  # noqa: F811
    hf, path = qwen_gguf
    check_engine_matches_hf(path, hf, "qwen2-gguf-cuda", device=CUDA)
    hf, path, _ = gemma_files
    check_engine_matches_hf(path, hf, "gemma3-gguf-cuda", vocab_size=hf.config.vocab_size,
                            device=CUDA)


@pytest.mark.parametrize("copy_mode", ["sync", "async"])
def test_swap_preemption_through_host_memory(copy_mode, tiny_model_factory):
    """A pool too small for the batch: preempted KV goes to host memory and back (the CUDA side
    stream when async) and the tokens are HF's."""
    path, hf_model = tiny_model_factory("llama")
    ids = prompts(1)
    refs = [hf_greedy(hf_model, p, GREEDY.max_tokens) for p in ids]
    llm = LLM(path, device=CUDA, block_size=4, num_kv_blocks=20, preemption_mode="swap",
              swap_copy_mode=copy_mode)
    outs = llm.generate(ids, GREEDY, use_tqdm=False)
    for p, out, (tokens, lps) in zip(ids, outs, refs):
        check_greedy_close(out.outputs[0].token_ids, out.outputs[0].logprobs, tokens, lps,
                           name=f"swap-{copy_mode} len={len(p)}")
    assert sum(o.metrics.num_preemptions for o in outs) > 0, "the pool was meant to preempt"
    assert_clean(llm)


def test_prefix_cache_and_ngram_speculation_leave_tokens_unchanged(tiny_model_factory):
    path, _ = tiny_model_factory("llama")
    shared = prompts(2, lengths=(40,))[0]
    ids = [shared + [7, 8, 9] * k for k in (1, 2, 3)] + [[11, 12, 13, 14] * 6]
    plain = LLM(path, device=CUDA, block_size=4, num_kv_blocks=128, enable_prefix_caching=False)
    want = [o.token_ids for o in generate(plain, ids)]
    cached = LLM(path, device=CUDA, block_size=4, num_kv_blocks=128)
    generate(cached, ids[:1])
    assert [o.token_ids for o in generate(cached, ids)] == want
    assert cached.engine.prefix_cache_stats.hit_tokens >= 40, "the shared prefix was not reused"
    assert_clean(cached)
    spec = LLM(path, device=CUDA, block_size=4, num_kv_blocks=128,
               speculative_method="ngram", num_speculative_tokens=3)
    assert [o.token_ids for o in generate(spec, ids)] == want
    assert_clean(spec)


def test_draft_model_speculation_with_prefix_hits_leaves_tokens_unchanged(tiny_model_factory):
    """A separate draft model on the device: its own KV caches there, drafting every step
    (cost model and speed guard off), a second turn that hits the prefix cache (the draft's
    KV reused from the blocks it filled): tokens equal to the target alone."""
    target, _ = tiny_model_factory("llama", num_hidden_layers=3)
    draft, _ = tiny_model_factory("llama", num_hidden_layers=2, seed=1)
    first = prompts(4, lengths=(37,))[0]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)  # no logprobs
    alone = LLM(target, device=CUDA, block_size=4, num_kv_blocks=128)
    answer = generate(alone, [first], params)[0].token_ids
    turns = [first, first + list(answer) + [5, 6, 7]]
    want = [generate(alone, [t], params)[0].token_ids for t in turns]
    llm = LLM(target, device=CUDA, block_size=4, num_kv_blocks=128, speculative_method="draft",
              speculative_draft_model=draft, num_speculative_tokens=3)
    spec = llm.engine.spec
    spec.cost, spec.min_acceptance, spec.guard = None, 0.0, None
    assert all(c.device.type == torch.device(CUDA).type for c in llm.engine.runner.draft_kv_caches)
    assert [generate(llm, [t], params)[0].token_ids for t in turns] == want
    assert llm.engine.runner.drafter.stats.num_model_drafts > 0
    assert_clean(llm)


# every weight quantizer but the GGUF blocks (GGUF files only); each either runs on the device
# or refuses it with a ValueError naming it (int8 / int4 and what builds on them are CPU kernels)
QUANTIZERS = ("int8", "int4", "fp8", "fp4", "smoothquant", "awq", "llm_int8", "zeroquant", "spqr")


@pytest.mark.parametrize("setting", [*(dict(quantization=q) for q in QUANTIZERS),
                                     dict(kv_cache_dtype="fp8_e4m3")],
                         ids=[*QUANTIZERS, "fp8-kv"])
def test_lossy_methods_match_the_same_method_on_the_cpu(setting, tiny_model_factory):
    path, _ = tiny_model_factory("llama")
    ids = prompts(3)
    on_cpu = generate(LLM(path, block_size=4, num_kv_blocks=128, **setting), ids)
    try:
        llm = LLM(path, device=CUDA, block_size=4, num_kv_blocks=128, **setting)
    except ValueError as refusal:
        assert "quantization" in setting and torch.device(CUDA).type in str(refusal), refusal
        print(f"{setting}: refused on {CUDA}: {refusal}")
        return
    for p, ours, ref in zip(ids, generate(llm, ids), on_cpu):
        check_greedy_close(ours.token_ids, ours.logprobs, ref.token_ids, ref.logprobs,
                           name=f"{setting} len={len(p)}")
    assert_clean(llm)
    print(f"{setting}: runs on {CUDA}")


def test_sampling_is_seeded_and_grammar_masks_apply(tiny_model_factory):
    path, _ = tiny_model_factory("llama")
    llm = LLM(path, device=CUDA, block_size=4, num_kv_blocks=128)
    ids = prompts(4)
    sampled = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, ignore_eos=True, seed=5)
    first = [o.token_ids for o in generate(llm, ids, sampled)]
    assert [o.token_ids for o in generate(llm, ids, sampled)] == first
    assert len({tuple(t) for t in first}) > 1, "seeded samples of different prompts coincide"
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    guided = SamplingParams(temperature=0.0, max_tokens=40, structured_output={"json": schema})
    for out in generate(llm, ids, guided):
        assert isinstance(json.loads(out.text)["ok"], bool), out.text
    assert_clean(llm)
