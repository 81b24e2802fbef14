"""Greedy output never depends on the queue policy (fcfs | priority | mlfq), on staggered
arrivals, on the preemptions a tiny KV pool and MLFQ's slot yielding force, on multi-step
decoding under that pressure, or on whether swap copies run inline or on the copy worker (with
proactive swap-in) while the model runs; integrity is checked after every step, with copies in
flight."""
from __future__ import annotations

import random

import pytest

from kvforge import LLM, SamplingParams
from kvforge.sched.mlfq import MLFQConfig

BLOCK = 4
PROMPT_LENS = (5, 33, 18, 2, 47, 9, 3, 26)
MAX_TOKENS = (24, 6, 30, 4, 12, 20, 8, 16)


def _prompts() -> list[list[int]]:
    rng = random.Random(11)
    return [[rng.randrange(3, 49152) for _ in range(n)] for n in PROMPT_LENS]


def _replay(path, policy: str, mlfq: MLFQConfig | None = None, **engine_kwargs):
    """Request i arrives before step 2 * i; returns ({id: greedy tokens}, {id: metrics},
    the engine's SwapStats or None)."""
    # one token a step unless a case turns multi-step decoding on: arrivals count in steps
    engine_kwargs.setdefault("num_decode_steps", 1)
    llm = LLM(path, block_size=BLOCK, scheduling_policy=policy, **engine_kwargs)
    engine = llm.engine
    if mlfq is not None:
        engine.scheduler.waiting.config = mlfq
    prompts = _prompts()
    tokens, metrics = {}, {}
    step = 0
    while len(tokens) < len(prompts):
        for i, prompt in enumerate(prompts):
            if 2 * i == step:
                params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS[i], ignore_eos=True)
                engine.add_request(str(i), prompt, params, priority=-i if i % 3 == 0 else 0)
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = out.outputs[0].token_ids
                metrics[out.request_id] = out.metrics
        engine.check_integrity()
        step += 1
        assert step < 2000, "requests were lost"
    assert not engine.has_unfinished_requests()
    assert engine.num_free_blocks == engine.runner.num_blocks, "leaked KV blocks"
    if policy == "mlfq":
        assert not engine.scheduler.waiting._ranks, "MLFQ kept state of finished requests"
    return tokens, metrics, engine.swap_stats


@pytest.fixture(scope="module")
def tiny(tiny_model_factory):
    path, _ = tiny_model_factory("llama", num_hidden_layers=3)
    baseline, _, _ = _replay(path, "fcfs", num_kv_blocks=256)
    return path, baseline


SMALL_QUANTA = MLFQConfig(num_levels=3, base_quantum=8, quantum_growth=2, starvation_steps=6)


@pytest.mark.slow
@pytest.mark.parametrize("policy,kwargs", [
    ("priority", dict(num_kv_blocks=20, max_num_seqs=2)),
    # multi-step decoding: lookahead slots dropped under KV pressure before anyone is preempted
    ("fcfs", dict(num_kv_blocks=20, num_decode_steps=4)),
    ("mlfq", dict(num_kv_blocks=256, max_num_seqs=2)),                 # slot yielding only
    ("mlfq", dict(num_kv_blocks=20, max_num_seqs=3)),
    # swap preemption: host pool, disk only (0 host blocks), the cost model; cache on and off
    ("fcfs", dict(num_kv_blocks=20, preemption_mode="swap")),
    ("mlfq", dict(num_kv_blocks=20, max_num_seqs=3, preemption_mode="swap", swap_host_blocks=0,
                  enable_prefix_caching=False)),
    ("fcfs", dict(num_kv_blocks=20, preemption_mode="auto", enable_prefix_caching=False)),
    # async copies + proactive swap-in: host pool, disk only, a host pool too small for all
    ("mlfq", dict(num_kv_blocks=20, max_num_seqs=3, preemption_mode="swap",
                  swap_copy_mode="async")),
    ("mlfq", dict(num_kv_blocks=256, max_num_seqs=2, preemption_mode="swap",
                  swap_copy_mode="async")),
    ("mlfq", dict(num_kv_blocks=20, max_num_seqs=3, preemption_mode="swap", swap_host_blocks=0,
                  enable_prefix_caching=False, swap_copy_mode="async")),
    ("fcfs", dict(num_kv_blocks=20, preemption_mode="swap", swap_host_blocks=4,
                  swap_copy_mode="async")),
    ("mlfq", dict(num_kv_blocks=20, max_num_seqs=3, preemption_mode="swap",
                  swap_copy_mode="async", swap_prefetch=False)),
])
def test_greedy_identical_under_every_policy(tiny, policy, kwargs):
    path, baseline = tiny
    mlfq = SMALL_QUANTA if policy == "mlfq" else None
    tokens, metrics, swap_stats = _replay(path, policy, mlfq, **kwargs)
    assert tokens == baseline
    if kwargs.get("num_kv_blocks") == 20 or policy == "mlfq":
        assert sum(m.num_preemptions for m in metrics.values()) > 0, "meant to force preemption"
    for m in metrics.values():
        assert m.queue_time is not None and m.queue_time >= 0
        assert m.num_swaps <= m.num_preemptions
    if kwargs.get("preemption_mode") == "swap":
        assert sum(m.num_swaps for m in metrics.values()) > 0, "meant to force swaps"
        assert all((m.swapped_bytes > 0) == (m.num_swaps > 0) for m in metrics.values())
    if kwargs.get("preemption_mode") is None:
        assert all(m.num_swaps == 0 and m.swapped_bytes == 0 for m in metrics.values())
        assert swap_stats is None
    else:
        assert swap_stats.mode == kwargs.get("swap_copy_mode", swap_stats.mode)
        assert swap_stats.num_swap_outs == sum(m.num_swaps for m in metrics.values())
        assert swap_stats.copy_seconds > 0 or swap_stats.num_swap_outs == 0
        if swap_stats.mode == "sync":            # inline copies hide nothing
            assert swap_stats.exposed_seconds == swap_stats.copy_seconds
            assert swap_stats.num_prefetches == 0
        elif kwargs.get("swap_prefetch", True) and kwargs.get("max_num_seqs") == 2:
            # slot yielding leaves the pool roomy: swapped requests come back prefetched
            assert swap_stats.num_prefetch_hits > 0, swap_stats
        if kwargs.get("swap_prefetch") is False:
            assert swap_stats.num_prefetches == 0


def test_priority_from_the_api_orders_admission(tiny_model_factory):
    path, _ = tiny_model_factory("llama", num_hidden_layers=3)
    llm = LLM(path, block_size=BLOCK, num_kv_blocks=64, scheduling_policy="priority",
              max_num_seqs=1)
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    outs = llm.generate(_prompts()[:3], params, use_tqdm=False, priority=[5, 0, -2])
    started = sorted(range(3), key=lambda i: outs[i].metrics.first_scheduled_time)
    assert started == [2, 1, 0]
    with pytest.raises(ValueError, match="2 priorities for 3 prompts"):
        llm.generate(_prompts()[:3], params, use_tqdm=False, priority=[1, 2])
    llm.engine.check_integrity()
    assert llm.engine.num_free_blocks == 64

    from kvforge.server.protocol import CompletionRequest
    assert CompletionRequest(prompt="hi", priority=-3).priority == -3


def test_abort_of_a_prefetched_request_keeps_the_rest_exact(tiny):
    """A waiting request whose KV is being copied back is aborted: its copy finishes before its
    blocks are freed, the others' greedy tokens are unchanged, nothing leaks."""
    path, baseline = tiny
    llm = LLM(path, block_size=BLOCK, scheduling_policy="mlfq", num_kv_blocks=256, max_num_seqs=2,
              preemption_mode="swap", swap_copy_mode="async", mlfq_quanta=(8, 16),
              mlfq_starvation_steps=6)
    engine = llm.engine
    swapper = engine.scheduler.swapper
    prompts = _prompts()
    tokens, aborted = {}, None
    step = 0
    while len(tokens) + (aborted is not None) < len(prompts):
        for i, prompt in enumerate(prompts):
            if 2 * i == step:
                engine.add_request(str(i), prompt, SamplingParams(
                    temperature=0.0, max_tokens=MAX_TOKENS[i], ignore_eos=True))
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = out.outputs[0].token_ids
        if aborted is None and swapper.prefetched_ids():
            aborted = sorted(swapper.prefetched_ids())[0]
            engine.abort_request(aborted)
            assert not swapper.is_prefetched(aborted) and aborted not in swapper.store.handles
        engine.check_integrity()
        step += 1
        assert step < 2000, "requests were lost"
    assert aborted is not None, "meant to abort a prefetched request"
    assert tokens == {rid: t for rid, t in baseline.items() if rid != aborted}
    assert engine.num_free_blocks == engine.runner.num_blocks and not swapper.store.handles
    assert not swapper.held_block_refs()
