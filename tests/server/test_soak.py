"""The soak benchmark (benchmarks/soak.py) at ~100 requests on the tiny model: the same code,
so every check it makes (no 5xx, every kept stream finished, idle metrics at 0 with a warm
prefix cache, engine integrity, RSS) holds in the suite too."""
from __future__ import annotations

import pytest

from kvforge.bench.soak import SoakConfig, make_workload, run_soak
from tests.server.conftest import TINY_ENGINE, ServerThread


def test_workload_mixes_every_kind():
    cfg = SoakConfig(num_requests=400)
    reqs = make_workload(cfg, 49152, 400, seed=0)
    dropped = [r for r in reqs if r.drop_after is not None]
    assert 0.15 < len(dropped) / 400 < 0.25
    assert 0.02 < sum(r.wrong_key for r in reqs) / 400 < 0.09
    assert not any(r.wrong_key and r.drop_after is not None for r in reqs)
    assert {r.path for r in reqs} == {"/v1/completions", "/v1/chat/completions"}
    assert {r.body["temperature"] for r in reqs} == {0.0, 0.8}
    # a dropped request is still running when its client hangs up
    assert all(r.body["max_tokens"] >= r.drop_after + 16 and r.body["ignore_eos"] for r in dropped)
    lengths = {len(r.body["prompt"]) for r in reqs if "prompt" in r.body}
    assert min(lengths) < 16 and max(lengths) > 64                   # mixed lengths
    assert make_workload(cfg, 49152, 400, seed=0) == reqs             # reproducible
    with pytest.raises(ValueError, match="drop_fraction"):
        SoakConfig(drop_fraction=1.5)


@pytest.mark.slow
def test_soak_100_requests(tiny_path):
    key = "soak-key"
    server = ServerThread(tiny_path, engine_kwargs=TINY_ENGINE, api_key=key)
    try:
        report = run_soak(server, SoakConfig(num_requests=100, warmup_requests=16,
                                              max_output_tokens=24), key)
    finally:
        server.stop()
    print(report.table())
    assert report.failures == []
    assert report.num_requests == 100 and report.server_errors == 0
    assert report.dropped > 10 and report.unauthorized > 0 and report.kept > 60
    assert report.aborted > 0                     # dropped streams really were cut short
    assert report.prefix_cache_blocks > 0 and report.prefix_cache_hit_rate > 0
    assert report.rss_growth <= 0.05
