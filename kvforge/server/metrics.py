"""Prometheus metrics at /metrics, names prefixed ``kvforge:`` (vLLM-like, so dashboards carry over).

Each server owns a CollectorRegistry, so several servers in one process (tests) never clash.
Request-level numbers are observed by the server when a request ends; engine gauges are set by
the engine thread after every step (prometheus_client metrics are thread-safe).
"""
from __future__ import annotations

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram,
                               generate_latest)

from kvforge.engine.async_engine import EngineStats

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
_TPOT_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5)


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str) -> None:
        self.registry = r = CollectorRegistry()
        labels = ["model_name"]
        self._model = model_name
        self._counted = (0, 0)          # prefix-cache (query, hit) tokens already in the counters
        self.requests = Counter("kvforge:request_success", "Finished requests by finish reason",
                                labels + ["finished_reason"], registry=r)
        self.prompt_tokens = Counter("kvforge:prompt_tokens", "Prompt tokens processed", labels,
                                     registry=r)
        self.generation_tokens = Counter("kvforge:generation_tokens", "Tokens generated", labels,
                                         registry=r)
        self.ttft = Histogram("kvforge:time_to_first_token_seconds", "Time to first token",
                              labels, buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("kvforge:time_per_output_token_seconds",
                              "Mean time per output token after the first, per request", labels,
                              buckets=_TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("kvforge:e2e_request_latency_seconds", "End-to-end request latency",
                             labels, buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("kvforge:request_queue_time_seconds",
                                    "Arrival to first scheduled", labels,
                                    buckets=_LATENCY_BUCKETS, registry=r)
        self.running = Gauge("kvforge:num_requests_running", "Sequences running", labels,
                             registry=r)
        self.waiting = Gauge("kvforge:num_requests_waiting", "Sequences waiting", labels,
                             registry=r)
        self.kv_usage = Gauge("kvforge:kv_cache_usage_perc",
                              "Fraction of KV blocks referenced by running or swapped requests "
                              "(0-1; blocks only the prefix cache holds are not counted)",
                              labels, registry=r)
        # the prefix cache's own view (vLLM exports the same query/hit token counters)
        self.prefix_blocks = Gauge("kvforge:prefix_cache_blocks",
                                   "KV blocks the prefix cache holds", labels, registry=r)
        self.prefix_evictable = Gauge("kvforge:prefix_cache_evictable_blocks",
                                      "Prefix-cache blocks no request uses (reusable on demand)",
                                      labels, registry=r)
        self.prefix_hit_rate = Gauge("kvforge:prefix_cache_hit_rate",
                                     "Prompt tokens found in the prefix cache / prompt tokens "
                                     "queried, since start", labels, registry=r)
        self.prefix_queries = Counter("kvforge:prefix_cache_queries",
                                      "Prompt tokens looked up in the prefix cache", labels,
                                      registry=r)
        self.prefix_hits = Counter("kvforge:prefix_cache_hits",
                                   "Prompt tokens found in the prefix cache", labels, registry=r)
        self.preemptions = Gauge("kvforge:num_preemptions_total", "Preemptions since start",
                                 labels, registry=r)
        self.rejected = Counter("kvforge:request_rejected", "Requests refused (queue full)",
                                labels, registry=r)

    def on_step(self, stats: EngineStats) -> None:
        m = self._model
        self.running.labels(m).set(stats.num_running)
        self.waiting.labels(m).set(stats.num_waiting)
        self.kv_usage.labels(m).set(stats.kv_cache_usage)
        self.preemptions.labels(m).set(stats.num_preemptions_total)
        self.prefix_blocks.labels(m).set(stats.prefix_cache_blocks)
        self.prefix_evictable.labels(m).set(stats.prefix_cache_evictable_blocks)
        self.prefix_hit_rate.labels(m).set(stats.prefix_cache_hit_rate)
        queried, hit = self._counted
        self.prefix_queries.labels(m).inc(stats.prefix_cache_query_tokens - queried)
        self.prefix_hits.labels(m).inc(stats.prefix_cache_hit_tokens - hit)
        self._counted = (stats.prefix_cache_query_tokens, stats.prefix_cache_hit_tokens)

    def on_request_done(self, *, finish_reasons: list[str | None], prompt_tokens: int,
                        output_tokens: int, arrival: float, first_token: float | None,
                        first_scheduled: float | None, end: float) -> None:
        m = self._model
        for reason in finish_reasons:
            self.requests.labels(m, reason or "abort").inc()
        self.prompt_tokens.labels(m).inc(prompt_tokens)
        self.generation_tokens.labels(m).inc(output_tokens)
        self.e2e.labels(m).observe(end - arrival)
        if first_scheduled is not None:
            self.queue_time.labels(m).observe(max(0.0, first_scheduled - arrival))
        if first_token is not None:
            self.ttft.labels(m).observe(first_token - arrival)
            if output_tokens > 1:
                self.tpot.labels(m).observe((end - first_token) / (output_tokens - 1))

    def on_aborted(self, num_seqs: int) -> None:
        self.requests.labels(self._model, "abort").inc(num_seqs)

    def on_rejected(self) -> None:
        self.rejected.labels(self._model).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
