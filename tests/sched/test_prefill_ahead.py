"""Prefill ahead (SchedulerConfig.prefill_ahead): requests without a sequence slot get their
prompt prefilled and first token sampled, then wait holding their KV ("parked")."""
import numpy as np
import pytest

from kvforge import LLM, SamplingParams
from kvforge.engine.request import RequestStatus
from kvforge.sched.config import SchedulerConfig
from tests.sched import test_scheduler
from tests.sched.test_scheduler import BLOCK, make_request, scheduled, step

WAITING, RUNNING, PREEMPTED = (RequestStatus.WAITING, RequestStatus.RUNNING,
                               RequestStatus.PREEMPTED)


def make_scheduler(num_blocks=20, max_num_seqs=1, prefill_ahead=1, policy="fcfs"):
    """test_scheduler's, with one sequence slot and room for requests to grow."""
    return test_scheduler.make_scheduler(num_blocks=num_blocks, max_num_seqs=max_num_seqs,
                                         max_model_len=64, policy=policy,
                                         prefill_ahead=prefill_ahead)


def test_config_rejects_bad_prefill_ahead():
    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="prefill_ahead"):
            SchedulerConfig(prefill_ahead=bad)


@pytest.mark.parametrize("policy", ["fcfs", "priority", "mlfq"])
def test_parked_request_gets_its_first_token_then_resumes_without_recompute(policy):
    sched = make_scheduler(policy=policy)
    a, b, c = make_request("a", 6), make_request("bb", 5), make_request("ccc", 3)
    for r in (a, b, c):
        sched.add_request(r)
    out = step(sched)
    # a takes the only slot; b is prefilled ahead (room for one); c waits untouched
    assert scheduled(out) == [("a", 6), ("bb", 5)]
    assert b.status is WAITING and "bb" in sched.parked and b.output_token_ids == [7]
    assert b.num_computed_tokens == 5 and b.first_token_time is not None
    assert c.num_computed_tokens == 0 and c.first_token_time is None
    assert [r.request_id for r in sched.waiting] == ["bb", "ccc"]
    out = step(sched, token=8)
    assert scheduled(out) == [("a", 1)]                  # nothing new: the ahead room is used
    sched.finish_request("a", RequestStatus.FINISHED_STOPPED)
    out = step(sched, token=9)
    # b resumes at its second token (no recompute); c is prefilled ahead in b's place
    assert scheduled(out) == [("bb", 1), ("ccc", 3)]
    assert b.status is RUNNING and b.output_token_ids == [7, 9] and not sched.num_running - 1
    assert "bb" not in sched.parked and "ccc" in sched.parked
    assert c.output_token_ids == [9]


def test_parked_requests_give_back_their_blocks_before_a_running_one_is_preempted():
    sched = make_scheduler(num_blocks=8, max_num_seqs=1, prefill_ahead=2)
    a, b, c = make_request("a", 8), make_request("bb", 3), make_request("ccc", 3)
    for r in (a, b, c):
        sched.add_request(r)
    out = step(sched)
    # a: 2 blocks + reserve 1 for its next token; b and c: 1 block each
    assert scheduled(out) == [("a", 8), ("bb", 3), ("ccc", 3)]
    assert set(sched.parked) == {"bb", "ccc"} and sched.kv_manager.num_free_blocks == 4
    for token in range(6 * BLOCK):                       # a grows until the pool runs out
        step(sched, token=token)
        if not sched.parked:
            break
    # the last parked (c), then b, gave back their blocks; a was never preempted
    assert a.status is RUNNING and a.num_preemptions == 0
    assert b.status is PREEMPTED and c.status is PREEMPTED
    assert b.num_computed_tokens == 0 and b.output_token_ids == [7]   # recomputes later
    assert [r.request_id for r in sched.waiting] == ["bb", "ccc"]     # queue order kept
    sched.finish_request("a", RequestStatus.FINISHED_STOPPED)
    out = step(sched, token=5)
    assert scheduled(out)[0] == ("bb", 4)                # prompt + its first token


def test_abort_parked_and_in_flight_ahead_requests_frees_their_blocks():
    sched = make_scheduler(max_num_seqs=1, prefill_ahead=2)
    for r in (make_request("a", 6), make_request("bb", 5), make_request("ccc", 3)):
        sched.add_request(r)
    step(sched)
    sched.abort_request("bb")                            # parked
    assert not sched.kv_manager.has_blocks("bb") and "bb" not in sched.parked
    sched.check_integrity()
    sched.add_request(make_request("dddd", 4))
    out = sched.schedule()
    assert ("dddd", 4) in scheduled(out)
    sched.abort_request("dddd")                          # while its ahead prefill "runs"
    sched.update_from_output(out, {"a": [1]})
    sched.check_integrity()
    assert "dddd" not in sched.parked and not sched.kv_manager.has_blocks("dddd")


def test_a_request_that_ends_at_its_first_token_leaves_nothing_behind():
    sched = make_scheduler(max_num_seqs=1, prefill_ahead=1)
    sched.add_request(make_request("a", 6))
    b = make_request("bb", 5)
    sched.add_request(b)
    out = sched.schedule()
    for r in sched.update_from_output(out, {"a": [1], "bb": [2]}):
        if r is b:                                       # the engine's stop check (EOS)
            sched.finish_request("bb", RequestStatus.FINISHED_STOPPED)
    sched.check_integrity()
    assert b.status is RequestStatus.FINISHED_STOPPED and not sched.kv_manager.has_blocks("bb")
    assert not sched.parked and sched.num_waiting == 0


def run_arrivals(path, prefill_ahead):
    """Jobs arriving over time (a new one every 3 model steps), max_num_seqs 2: per job the
    model step of its first token and of its end, and its tokens."""
    llm = LLM(path, num_kv_blocks=256, max_num_seqs=2, prefill_ahead=prefill_ahead)
    engine = llm.engine
    rng = np.random.default_rng(0)
    lengths = [40, 6, 30, 4, 12, 36, 5, 8, 20, 3]
    jobs = [(f"job{i}", [int(t) for t in rng.integers(100, 40000, int(rng.integers(6, 30)))], n)
            for i, n in enumerate(lengths)]
    first, done, tokens, arrival = {}, {}, {}, {}
    while jobs or engine.has_unfinished_requests():
        clock = engine.num_model_steps_total
        while jobs and clock >= 3 * (len(lengths) - len(jobs)):
            name, prompt, n = jobs.pop(0)
            arrival[name] = clock
            engine.add_request(name, prompt, SamplingParams(temperature=0.0, max_tokens=n,
                                                            ignore_eos=True))
        for out in engine.step():
            first.setdefault(out.request_id, engine.num_model_steps_total)
            if out.finished:
                done[out.request_id] = engine.num_model_steps_total
                tokens[out.request_id] = out.outputs[0].token_ids
        engine.check_integrity()
    assert engine.num_free_blocks == 256
    ttft = np.mean([first[k] - arrival[k] for k in arrival])
    jct = np.mean([done[k] - arrival[k] for k in arrival])
    return ttft, jct, engine.num_model_steps_total, tokens


def test_engine_prefill_ahead_same_tokens_first_tokens_at_arrival(tiny_model_factory):
    path, _ = tiny_model_factory("llama")
    ttft_off, jct_off, steps_off, tokens_off = run_arrivals(path, 0)
    ttft_on, jct_on, steps_on, tokens_on = run_arrivals(path, 8)
    assert tokens_on == tokens_off                        # greedy: scheduling-invariant
    # an arrival waits at most for the running multi-step decode call (<= 4 model steps)
    assert ttft_off > 10 and ttft_on <= 4, (ttft_off, ttft_on)
    # the prefills ride in decode steps: no more model steps, no later completions
    assert steps_on <= steps_off and jct_on <= jct_off, (steps_on, steps_off, jct_on, jct_off)


@pytest.mark.parametrize("options", [
    dict(preemption_mode="swap", num_kv_blocks=12),          # parked KV swapped out when short
    dict(preemption_mode="recompute", num_kv_blocks=12, enable_prefix_caching=False),
    dict(speculative_method="ngram", num_speculative_tokens=3, num_kv_blocks=64),
    dict(scheduling_policy="mlfq", preemption_mode="swap", num_kv_blocks=64),
])
def test_prefill_ahead_under_kv_pressure_speculation_and_mlfq_keeps_outputs(tiny_model_factory,
                                                                          options):
    """The same greedy tokens as without prefill ahead, every block back at the end."""
    path, _ = tiny_model_factory("llama")
    rng = np.random.default_rng(1)
    prompts = [[int(t) for t in rng.integers(100, 40000, int(rng.integers(4, 40)))]
               for _ in range(10)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    outputs = {}
    for ahead in (0, 6):
        llm = LLM(path, max_num_seqs=2, prefill_ahead=ahead, **options)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        llm.engine.check_integrity()
        assert llm.engine.num_free_blocks == llm.engine.kv_manager.num_blocks
        outputs[ahead] = [o.outputs[0].token_ids for o in outs]
    assert outputs[6] == outputs[0]
