"""benchmarks/sched.py helpers: the workload shape and the metric summary (no timing)."""
from __future__ import annotations

import argparse

import pytest

from benchmarks.sched import JobResult, make_jobs, summarize


def _args(**kw):
    base = dict(seed=0, num_requests=200, min_prompt=4, max_prompt=24, pareto_alpha=1.1,
                pareto_scale=6.0, max_output=400, long_fraction=0.05)
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


def test_summary_means_percentiles_and_throughput():
    results = [JobResult(arrival=0.0, output_len=10, first_token=1.0, finished=2.0,
                         num_preemptions=1),
               JobResult(arrival=1.0, output_len=30, first_token=2.0, finished=5.0,
                         num_preemptions=0)]
    s = summarize(results, makespan=5.0)
    assert s["mean_jct"] == pytest.approx(3.0) and s["mean_ttft"] == pytest.approx(1.0)
    assert s["throughput"] == pytest.approx(8.0) and s["preemptions"] == 1
    assert s["mean_jct_longest5"] == pytest.approx(4.0)
