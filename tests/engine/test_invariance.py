"""Greedy output never depends on chunking, token budget, preemption, n > 1 forks or multi-step
decoding."""
from __future__ import annotations

import random

import pytest

from kvforge import LLM, SamplingParams

NUM_BLOCKS = 256
BLOCK = 4


def _prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(3, 49152) for _ in range(n)] for n in (5, 33, 18, 1, 47, 9)]


def _run(path, **engine_kwargs):
    engine_kwargs.setdefault("num_kv_blocks", NUM_BLOCKS)
    llm = LLM(path, block_size=BLOCK, **engine_kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    outs = llm.generate(_prompts(), params, use_tqdm=False)
    llm.engine.check_integrity()
    assert llm.engine.num_free_blocks == llm.engine.runner.num_blocks, "leaked KV blocks"
    return [o.outputs[0].token_ids for o in outs], outs


@pytest.fixture(scope="module")
def tiny(tiny_model_factory):
    path, _ = tiny_model_factory("llama", num_hidden_layers=3)
    # one token a step; the variants below run with the default multi-step decoding on
    baseline, _ = _run(path, num_decode_steps=1)
    return path, baseline


def test_chunked_prefill_off_equals_on(tiny):
    path, baseline = tiny
    tokens, _ = _run(path, enable_chunked_prefill=False)
    assert tokens == baseline


def test_tiny_token_budget_forces_chunks(tiny):
    path, baseline = tiny
    tokens, _ = _run(path, max_num_batched_tokens=7, max_num_seqs=3)
    assert tokens == baseline


def test_small_kv_pool_forces_preemption(tiny):
    path, baseline = tiny
    # the longest request needs (47 + 20) / 4 = 17 blocks; 20 blocks cannot hold two of them
    tokens, outs = _run(path, num_kv_blocks=20)
    assert tokens == baseline
    assert sum(o.metrics.num_preemptions for o in outs) > 0, "pool was meant to force preemption"


def test_n_forks_share_prompt_and_match(tiny):
    path, baseline = tiny
    llm = LLM(path, block_size=BLOCK, num_kv_blocks=NUM_BLOCKS)
    params = SamplingParams(n=3, temperature=0.0, max_tokens=20, ignore_eos=True)
    outs = llm.generate(_prompts(), params, use_tqdm=False)
    for out, expected in zip(outs, baseline):
        assert [c.index for c in out.outputs] == [0, 1, 2]
        for c in out.outputs:
            assert c.token_ids == expected
    llm.engine.check_integrity()
    assert llm.engine.num_free_blocks == NUM_BLOCKS


def test_n_forks_sampled_are_independent_and_seeded(tiny):
    path, _ = tiny
    llm = LLM(path, block_size=BLOCK, num_kv_blocks=NUM_BLOCKS)
    params = SamplingParams(n=4, temperature=1.0, max_tokens=8, seed=123, ignore_eos=True)
    a = llm.generate([_prompts()[1]], params, use_tqdm=False)[0]
    b = llm.generate([_prompts()[0], _prompts()[1]], params, use_tqdm=False)[1]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert len({tuple(c.token_ids) for c in a.outputs}) > 1, "forks should sample differently"
    llm.engine.check_integrity()
    assert llm.engine.num_free_blocks == NUM_BLOCKS
