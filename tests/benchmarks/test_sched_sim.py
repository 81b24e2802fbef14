"""The model-free scheduling replay: its policies behave as queueing theory says they must on
workloads whose answer is known."""
from __future__ import annotations

from benchmarks.sched_sim import Job, gittins_index, simulate


def _head_of_line() -> list[Job]:
    """8 jobs of 160 tokens ahead of 32 of 8, all at once (tests/sched/test_mlfq_engine.py)."""
    return [Job(0.0, 10, 160) for _ in range(8)] + [Job(0.0, 10, 8) for _ in range(32)]


def test_bimodal_lengths_favour_mlfq_and_gittins_finds_it():
    jobs = _head_of_line()
    fcfs, _ = simulate(jobs, "fcfs", 4)
    mlfq, _ = simulate(jobs, "mlfq", 4)
    srpt, _ = simulate(jobs, "srpt", 4)
    index = gittins_index([j.output for j in jobs], 512)
    gittins, _ = simulate(jobs, "gittins", 4, index)
    assert fcfs / mlfq > 2.5                       # the head-of-line target
    assert srpt <= gittins <= mlfq * 1.01          # the length-aware bound beats both
    # Gittins on this law: finish the 8-token jobs first, i.e. the index drops after 8 tokens
    assert index[0] > index[8]


def test_lengths_at_a_cap_make_fcfs_optimal_among_blind_policies():
    """Every job has the same length: attained service only brings a job nearer its end, so
    the Gittins index grows with it, the policy never preempts (it is FCFS), and least-
    attained-service sharing (MLFQ) only delays everyone."""
    jobs = [Job(float(i), 10, 100) for i in range(12)]
    index = gittins_index([100] * 50, 512)
    assert all(a <= b for a, b in zip(index[:99], index[1:100]))
    fcfs, _ = simulate(jobs, "fcfs", 4)
    assert simulate(jobs, "gittins", 4, index)[0] == fcfs
    assert simulate(jobs, "mlfq", 4)[0] > fcfs
