"""Prefix cache in the engine: greedy outputs identical ON vs OFF under KV pressure, exact hit
counts, stats, and every block back (free or evictable, no lock left) at the end."""
from __future__ import annotations

import random

import pytest

from kvforge import LLM, SamplingParams

BLOCK = 4


def _workload() -> list[list[int]]:
    rng = random.Random(11)
    tok = lambda n: [rng.randrange(3, 49152) for _ in range(n)]   # noqa: E731
    system, fewshot = tok(22), tok(9)           # 22 = 5.5 blocks: shared prefix ends mid-block
    prompts = [system + tok(n) for n in (3, 11, 6)]
    prompts += [fewshot + tok(n) for n in (1, 8)]
    prompts += [prompts[1], prompts[1]]         # identical prompts
    prompts += [prompts[0][:13]]                # a prompt that is a prefix of another
    prompts += [system + fewshot + tok(5), tok(17), system[:8]]   # block-aligned prefix
    return prompts


def _run(path, prompts, **kwargs):
    kwargs.setdefault("num_kv_blocks", 256)
    llm = LLM(path, block_size=BLOCK, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    _assert_all_returned(llm)
    return llm, [o.outputs[0].token_ids for o in outs], outs


def _assert_all_returned(llm):
    engine = llm.engine
    engine.check_integrity()
    # free capacity counts cached-but-unused blocks; no request may still lock any of them
    assert engine.num_free_blocks == engine.runner.num_blocks, "leaked KV blocks"
    cache = engine.kv_manager.prefix_cache
    if cache is not None:
        assert all(n.lock_ref == 0 for n in cache.tree.nodes()), "a finished request kept a lock"
        assert cache.num_evictable_blocks == cache.tree.num_cached_blocks


@pytest.fixture(scope="module")
def tiny(tiny_model_factory):
    path, _ = tiny_model_factory("llama", num_hidden_layers=3)
    _, baseline, _ = _run(path, _workload(), enable_prefix_caching=False)
    return path, baseline


def test_on_equals_off_with_hits(tiny):
    path, baseline = tiny
    llm, tokens, _ = _run(path, _workload())
    assert tokens == baseline
    stats = llm.engine.prefix_cache_stats
    assert stats.queries == len(_workload()) and stats.hit_tokens > 0
    assert 0.0 < stats.hit_rate < 1.0


@pytest.mark.slow
def test_on_equals_off_under_kv_pressure_with_evictions(tiny):
    path, baseline = tiny
    # the longest request needs ceil((41 + 12) / 4) = 14 blocks; 18 cannot cache much
    llm, tokens, outs = _run(path, _workload(), num_kv_blocks=18)
    assert tokens == baseline
    assert llm.engine.prefix_cache_stats.evicted_blocks > 0, "pool was meant to force evictions"


@pytest.mark.slow
def test_on_equals_off_with_small_budget_preemption_and_lpm(tiny):
    path, baseline = tiny
    _, tokens, outs = _run(path, _workload(), num_kv_blocks=16, max_num_batched_tokens=9,
                           max_num_seqs=4, scheduling_policy="lpm")
    assert tokens == baseline
    assert sum(o.metrics.num_preemptions for o in outs) > 0, "pool was meant to force preemption"


def test_n_forks_with_cache_match_greedy(tiny):
    path, baseline = tiny
    llm = LLM(path, block_size=BLOCK, num_kv_blocks=64)
    params = SamplingParams(n=3, temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = llm.generate(_workload()[:4], params, use_tqdm=False)
    for out, expected in zip(outs, baseline[:4]):
        assert [c.token_ids for c in out.outputs] == [expected] * 3
    _assert_all_returned(llm)


def test_exact_hit_counts_and_multi_turn_reuse(tiny):
    path, _ = tiny
    prompt = _workload()[0]                                 # 25 tokens
    llm = LLM(path, block_size=BLOCK, num_kv_blocks=64)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    first = llm.generate([prompt], params, use_tqdm=False)[0]
    stats = llm.engine.prefix_cache_stats
    assert (stats.queries, stats.hit_tokens) == (1, 0)
    again = llm.generate([prompt], params, use_tqdm=False)[0]
    # 24 of the 25 tokens may be matched (the last is always computed): 6 whole blocks
    assert (stats.queries, stats.query_tokens, stats.hit_tokens) == (2, 50, 24)
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    # next turn re-sends prompt + reply: the reply's KV was cached while it was generated
    history = prompt + first.outputs[0].token_ids            # 33 tokens, 32 computed
    llm.generate([history + [5, 6, 7]], params, use_tqdm=False)
    assert stats.hit_tokens == 24 + 32
    _assert_all_returned(llm)


def test_prompt_logprobs_requests_bypass_the_cache(tiny):
    path, _ = tiny
    prompt = _workload()[0]
    llm = LLM(path, block_size=BLOCK, num_kv_blocks=64)
    plain = SamplingParams(temperature=0.0, max_tokens=2)
    llm.generate([prompt], plain, use_tqdm=False)
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=1),
                       use_tqdm=False)[0]
    assert len(out.prompt_logprobs) == len(prompt)           # every position scored
    assert llm.engine.prefix_cache_stats.queries == 1
    _assert_all_returned(llm)


def test_identical_prompts_arriving_together_compute_the_prefix_once(tiny_model_factory):
    """Nothing is cached when both arrive: the second waits a step for the first's blocks
    instead of prefilling the same 40 tokens again (hit = the 9 full blocks below token 39)."""
    path, _ = tiny_model_factory("llama")
    rng = random.Random(5)
    prompt = [rng.randrange(3, 49152) for _ in range(40)]
    llm, tokens, _ = _run(path, [prompt, list(prompt)])
    assert tokens[0] == tokens[1]
    stats = llm.engine.prefix_cache_stats
    assert stats.hit_tokens == 36, stats.as_dict()
