"""benchmarks/sched.py helpers: the workload shape and the metric summary (no timing)."""
from __future__ import annotations

import argparse

import pytest

from benchmarks.sched import JobResult, make_jobs, set_poisson_arrivals, summarize


def _args(**kw):
    base = dict(seed=0, num_requests=200, min_prompt=4, max_prompt=24, pareto_alpha=1.1,
                pareto_scale=6.0, max_output=400, long_fraction=0.05, workload="pareto",
                num_long=8, long_output=160, num_short=32, short_output=8, load=1.5)
    base.update(kw)
    return argparse.Namespace(**base)


def test_workload_is_seeded_heavy_tailed_and_bounded():
    jobs = make_jobs(_args(), vocab_size=1000)
    assert [j.output_len for j in jobs] == [j.output_len for j in make_jobs(_args(), 1000)]
    lengths = sorted(j.output_len for j in jobs)
    assert all(1 <= n <= 400 for n in lengths)
    assert all(4 <= len(j.prompt_token_ids) <= 24 for j in jobs)
    assert lengths[len(lengths) // 2] < 20                 # most jobs are short
    assert sum(n >= 200 for n in lengths) >= 3             # a few very long ones


def test_head_of_line_workload_queues_the_long_jobs_first_all_at_once():
    args = _args(workload="head-of-line")
    jobs = make_jobs(args, vocab_size=1000)
    assert [j.output_len for j in jobs] == [160] * 8 + [8] * 32
    assert all(4 <= len(j.prompt_token_ids) <= 24 for j in jobs)
    set_poisson_arrivals(args, jobs, capacity_jobs_per_s=1.0)
    assert all(j.arrival == 0.0 for j in jobs)
    pareto = make_jobs(_args(), vocab_size=1000)
    set_poisson_arrivals(_args(), pareto, capacity_jobs_per_s=1.0)
    arrivals = [j.arrival for j in pareto]
    assert arrivals[0] == 0.0 and arrivals == sorted(arrivals) and arrivals[-1] > 0


def test_summary_means_percentiles_and_throughput():
    results = [JobResult(arrival=0.0, output_len=10, first_token=1.0, finished=2.0,
                         num_preemptions=1),
               JobResult(arrival=1.0, output_len=30, first_token=2.0, finished=5.0,
                         num_preemptions=0)]
    s = summarize(results, makespan=5.0)
    assert s["mean_jct"] == pytest.approx(3.0) and s["mean_ttft"] == pytest.approx(1.0)
    assert s["throughput"] == pytest.approx(8.0) and s["preemptions"] == 1
    assert s["mean_jct_longest5"] == pytest.approx(4.0)
