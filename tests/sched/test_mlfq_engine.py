"""MLFQ through the engine on the head-of-line workload, on a clock of model steps.

8 long requests (160 output tokens) queued ahead of 32 short ones (8 tokens), max_num_seqs 4,
greedy, ignore_eos, short prompts. The clock is the number of model steps (a multi-step decode
call of k steps counts k), so the result does not depend on the machine or its load. FCFS gives
a mean job completion time of ~333 steps, shortest-remaining-first ~90; MLFQ must come within
reach of the latter without changing any output or adding steps.
"""
import numpy as np
import pytest

from kvforge import LLM, SamplingParams

NUM_LONG, LONG_TOKENS, NUM_SHORT, SHORT_TOKENS = 8, 160, 32, 8


def run_head_of_line(path, policy, **options):
    """(mean JCT in steps, total steps, preemptions, outputs by name)."""
    llm = LLM(path, num_kv_blocks=256, max_num_seqs=4, scheduling_policy=policy, **options)
    engine = llm.engine
    rng = np.random.default_rng(0)
    jobs = ([(f"long{i}", LONG_TOKENS) for i in range(NUM_LONG)]
            + [(f"short{i}", SHORT_TOKENS) for i in range(NUM_SHORT)])
    for name, num_tokens in jobs:
        prompt = [int(t) for t in rng.integers(100, 40000, int(rng.integers(8, 25)))]
        engine.add_request(name, prompt, SamplingParams(temperature=0.0, max_tokens=num_tokens,
                                                        ignore_eos=True))
    finished, outputs = {}, {}
    while engine.has_unfinished_requests():
        step_outputs = engine.step()
        clock = engine.num_model_steps_total
        for out in step_outputs:
            if out.finished:
                finished[out.request_id] = clock
                outputs[out.request_id] = out.outputs[0].token_ids
    engine.check_integrity()
    assert sorted(finished) == sorted(name for name, _ in jobs)
    mean_jct = float(np.mean(list(finished.values())))       # every job arrived at step 0
    return mean_jct, clock, engine.num_preemptions_total, outputs


@pytest.fixture(scope="module")
def fcfs_run(tiny_model_factory):
    path, _ = tiny_model_factory("llama")
    return path, run_head_of_line(path, "fcfs")


def test_mlfq_defaults_cut_mean_jct_with_the_same_outputs_and_work(fcfs_run):
    path, (fcfs_jct, fcfs_steps, fcfs_preemptions, fcfs_outputs) = fcfs_run
    mlfq_jct, mlfq_steps, preemptions, mlfq_outputs = run_head_of_line(path, "mlfq")
    assert fcfs_preemptions == 0 and fcfs_jct > 300
    assert mlfq_outputs == fcfs_outputs                        # greedy: scheduling-invariant
    assert fcfs_jct / mlfq_jct >= 2.5, (fcfs_jct, mlfq_jct)
    assert abs(mlfq_steps - fcfs_steps) <= 0.1 * fcfs_steps, (fcfs_steps, mlfq_steps)
    # no thrashing: a few preemptions per long job, none for the short ones
    assert preemptions <= 3 * NUM_LONG, preemptions


def finish_steps(path, policy, **options):
    """(model step at which each job finished, engine steps, outputs) on the head-of-line jobs."""
    llm = LLM(path, num_kv_blocks=256, max_num_seqs=4, scheduling_policy=policy, **options)
    engine = llm.engine
    rng = np.random.default_rng(0)
    for i in range(NUM_LONG + NUM_SHORT):
        num_tokens = LONG_TOKENS if i < NUM_LONG else SHORT_TOKENS
        prompt = [int(t) for t in rng.integers(100, 40000, int(rng.integers(8, 25)))]
        engine.add_request(str(i), prompt, SamplingParams(temperature=0.0, max_tokens=num_tokens,
                                                          ignore_eos=True))
    finished, outputs, engine_steps = {}, {}, 0
    while engine.has_unfinished_requests():
        step_outputs = engine.step()
        engine_steps += 1
        for out in step_outputs:
            if out.finished:
                finished[out.request_id] = engine.num_model_steps_total
                outputs[out.request_id] = out.outputs[0].token_ids
    engine.check_integrity()
    return finished, engine_steps, outputs


def test_multi_step_decoding_keeps_every_mlfq_decision_at_its_model_step(fcfs_run):
    """With jobs waiting, multi-step calls are bounded by the quantum left before a demotion
    lets a waiter preempt: each job ends at the model step it ends at one step at a time,
    with far fewer engine steps (each runs the engine's Python once)."""
    path, (_, _, _, fcfs_outputs) = fcfs_run
    one_finished, one_steps, one_outputs = finish_steps(path, "mlfq", num_decode_steps=1)
    finished, engine_steps, outputs = finish_steps(path, "mlfq", num_decode_steps=8)
    assert finished == one_finished
    assert engine_steps < 0.6 * one_steps, (engine_steps, one_steps)
    assert outputs == one_outputs
    assert [outputs[str(i)] for i in range(NUM_LONG + NUM_SHORT)] == [
        fcfs_outputs[name] for name in [f"long{i}" for i in range(NUM_LONG)]
        + [f"short{i}" for i in range(NUM_SHORT)]]


def test_short_arrival_is_scheduled_within_the_first_quantum(tiny_model_factory):
    """Two long jobs hold both slots, decoding 16 steps a call when nothing waits; a short job
    that arrives then is first scheduled within the first level's quantum (4 model steps),
    as the first long job to use up its quantum yields, and its output is FCFS's."""
    path, _ = tiny_model_factory("llama")
    results = {}
    for policy in ("fcfs", "mlfq"):
        llm = LLM(path, num_kv_blocks=128, max_num_seqs=2, scheduling_policy=policy,
                  mlfq_quanta="4,64", num_decode_steps=16)
        engine = llm.engine
        params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
        for name in ("long0", "long1"):
            engine.add_request(name, [11, 12, 13, 14], params)
        engine.step()                                   # both prefilled: 1 token each
        arrival = engine.num_model_steps_total
        engine.add_request("short", [21, 22, 23],
                           SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
        first_scheduled, outputs = None, {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outputs[out.request_id] = out.outputs[0].token_ids
            short = engine.scheduler.get_request("short")
            if first_scheduled is None and (short is None or short.num_computed_tokens > 0):
                first_scheduled = engine.num_model_steps_total - 1    # its prefill step
            engine.check_integrity()
        assert engine.num_free_blocks == engine.runner.num_blocks
        results[policy] = (first_scheduled - arrival, outputs)
    mlfq_wait, mlfq_outputs = results["mlfq"]
    fcfs_wait, fcfs_outputs = results["fcfs"]
    assert mlfq_wait <= 4, mlfq_wait
    assert fcfs_wait >= 50, fcfs_wait                    # FCFS: behind a whole long job
    assert mlfq_outputs == fcfs_outputs
