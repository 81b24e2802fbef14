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
