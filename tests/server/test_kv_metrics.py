"""/metrics tells KV that requests use apart from KV the prefix cache keeps: after a burst of
requests with shared prefixes, some dropped by the client, kv_cache_usage_perc is back to exactly
0 while the prefix cache still holds blocks; the engine's stats say the same."""
from __future__ import annotations

import asyncio

import httpx

from kvforge.bench.soak import scrape_metrics, wait_until_idle
from tests.server.test_disconnect_concurrency import read_stream


def test_usage_returns_to_zero_while_prefix_cache_stays_warm(server):
    prefixes = [[1000 + 37 * g + i for i in range(24)] for g in range(3)]     # 6 blocks each
    prompts = [prefixes[i % 3] + [20000 + i, 20001 + i] for i in range(12)]
    before = scrape_metrics(server.url)
    seen_usage: list[float] = []

    async def burst():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
            async def one(i: int):
                body = {"model": "tiny", "prompt": prompts[i], "temperature": 0,
                        "ignore_eos": True, "max_tokens": 300 if i % 4 == 3 else 12}
                return await read_stream(c, body, stop_after=2 if i % 4 == 3 else None)

            async def sample():         # while requests run, usage is really > 0
                for _ in range(400):
                    text = (await c.get("/metrics")).text
                    gauges = {l.split("{")[0]: float(l.split()[-1]) for l in text.splitlines()
                              if l.startswith("kvforge:")}
                    if gauges.get("kvforge:num_requests_running", 0) > 0:
                        seen_usage.append(gauges["kvforge:kv_cache_usage_perc"])
                        return
                    await asyncio.sleep(0.02)
            results = await asyncio.gather(*(one(i) for i in range(12)), sample())
            return results[:12]

    texts = asyncio.run(burst())
    assert sum(t is None for t in texts) == 3                       # three dropped mid-stream
    m = wait_until_idle(server.url, timeout=30)
    assert m["num_requests_running"] == 0 and m["num_requests_waiting"] == 0
    assert m["kv_cache_usage_perc"] == 0.0                          # exactly, not ~0.99
    assert m["prefix_cache_blocks"] >= 3 * 6                        # the three shared prefixes
    assert m["prefix_cache_evictable_blocks"] == m["prefix_cache_blocks"]     # nobody uses them
    hits = m["prefix_cache_hits_total"] - before.get("prefix_cache_hits_total", 0.0)
    queries = m["prefix_cache_queries_total"] - before.get("prefix_cache_queries_total", 0.0)
    # requests of a group admitted in the same step as its first one find nothing cached yet;
    # with 64 tokens of prefill per step most come later and find their 24-token prefix
    assert hits >= 4 * 24 and queries >= 12 * 26 and 0 < m["prefix_cache_hit_rate"] < 1
    assert max(seen_usage) > 0.0

    # the engine's own numbers agree with the gauges
    def engine_view(e):
        e.check_integrity()
        s = e.prefix_cache_stats
        return e.kv_cache_usage, s.cached_blocks, s.evictable_blocks, e.num_free_blocks, \
            e.kv_manager.num_blocks
    usage, cached, evictable, free, total = server.in_engine(engine_view)
    assert usage == 0.0 and cached == m["prefix_cache_blocks"] and evictable == cached
    assert free == total
    stats = server.engine.stats
    assert stats.kv_cache_usage == 0.0 and stats.prefix_cache_blocks == cached
    assert stats.num_running == 0 and stats.prefix_cache_hit_rate == m["prefix_cache_hit_rate"]
    server.assert_clean()
