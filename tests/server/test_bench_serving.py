"""The serving benchmark client against a real server: every request completes with its exact
output length, latencies come from really streamed chunks, summary and plot are produced."""
from __future__ import annotations

import asyncio
import math

import pytest

from kvforge.bench.serving import (arrival_delays, parse_slos, plot_runs, random_requests,
                                   run_benchmark, summarize)


def test_arrival_delays():
    assert arrival_delays(3, math.inf, 1.0, 0) == [0.0, 0.0, 0.0]
    d = arrival_delays(4000, 4.0, 1.0, 0)
    assert sum(d) / len(d) == pytest.approx(0.25, rel=0.1)      # mean gap = 1 / rate
    bursty = arrival_delays(4000, 4.0, 0.25, 0)
    assert sum(bursty) / len(bursty) == pytest.approx(0.25, rel=0.15)
    assert max(bursty) > max(d)                                  # same mean, heavier tail
    with pytest.raises(ValueError):
        arrival_delays(3, 0.0, 1.0, 0)
    with pytest.raises(ValueError):
        parse_slos(["latency:5"])


@pytest.mark.slow
def test_benchmark_against_real_server(server, tmp_path):
    reqs = random_requests(49152, 6, 8, 12, 0.5, seed=1)
    results, duration = asyncio.run(run_benchmark(server.url, "tiny", reqs, request_rate=50.0,
                                                  max_concurrency=3))
    assert all(r.ok for r in results), [r.error for r in results]
    assert [r.output_len for r in results] == [r.output_len for r in reqs]
    for r in results:
        assert 1 < len(r.chunk_times) <= r.output_len          # streamed, not one blob
        assert 0 < r.ttft <= r.e2el and len(r.itl) == len(r.chunk_times) - 1
    s = summarize(results, duration, parse_slos(["ttft:100000", "tpot:0.000001"]))
    assert s["completed"] == 6 and s["total_output_tokens"] == sum(r.output_len for r in reqs)
    assert s["goodput"] == 0.0                        # nobody meets a 1 ns TPOT
    plot_runs({"x": results}, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").stat().st_size > 1000
    server.assert_clean()


@pytest.mark.slow
def test_priority_by_output_length_reaches_a_priority_server(tiny_path):
    """``--priority output-len``: each request asks for priority = its max_tokens, so a
    one-slot priority server runs the queued requests shortest first."""
    from tests.server.conftest import TINY_ENGINE, ServerThread
    server = ServerThread(tiny_path, engine_kwargs={**TINY_ENGINE, "max_num_seqs": 1,
                                                    "scheduling_policy": "priority"})
    try:
        reqs = random_requests(49152, 4, 8, 12, 0.0, seed=2)
        for req, length in zip(reqs, (30, 24, 12, 3)):     # sent longest first
            req.output_len = length
        results, _ = asyncio.run(run_benchmark(server.url, "tiny", reqs,
                                               request_rate=math.inf, priority_by_length=True))
        assert all(r.ok for r in results), [r.error for r in results]
        # whichever arrived first took the slot; the rest finish shortest first
        by_finish = sorted(results, key=lambda r: r.start + r.e2el)
        later = [r.output_len for r in by_finish[1:]]
        assert later == sorted(later), [r.output_len for r in by_finish]
        server.assert_clean()
    finally:
        server.stop()
