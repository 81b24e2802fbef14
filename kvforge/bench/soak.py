"""Soak test of the OpenAI server: many streamed requests of every kind, some dropped by the
client mid-stream, some with a wrong API key; then the server must be exactly as it started.

    workload   completions (token-id prompts) and chats (text), each request opening with one of
               a few shared prefixes (so the prefix cache fills up) or none; greedy or sampled;
               mixed prompt and output lengths; N requests, C in flight at a time
    dropped    the client closes the stream after a few chunks (the server must abort them)
    wrong key  answered 401 with the OpenAI error body, nothing queued

Checks (every failure is listed, none stops the others): no response >= 500 and no transport
error; every kept request streams to ``[DONE]`` with each choice finished by ``stop`` or
``length``; then, idle, /metrics shows 0 running, 0 waiting and 0 KV usage while the prefix
cache still holds blocks; the engine's ``check_integrity()`` holds with every block free; RSS
grew at most ``max_rss_growth`` over the run (measured after a warm-up round).

``benchmarks/soak.py`` runs it on the default model (1,000 requests); the test suite runs the
same code with ~100 requests on a tiny model.
"""
from __future__ import annotations

import asyncio
import gc
import json
import os
import random
import time
from dataclasses import dataclass, field

from kvforge.bench.serving import percentile

WORDS = ("river stone light garden paper window orange music silver winter forest cloud "
         "engine table market letter island mirror candle bridge").split()
SYSTEM_PROMPTS = ("You are a careful assistant who answers in one sentence.",
                  "You are a poet. Reply with a short verse about the question.",
                  "You are a travel guide for small mountain towns.",
                  "You summarise whatever the user writes in plain words.")


@dataclass
class SoakConfig:
    num_requests: int = 1000
    concurrency: int = 16
    drop_fraction: float = 0.2           # closed by the client after a few chunks
    wrong_key_fraction: float = 0.05     # sent with a wrong API key (401)
    chat_fraction: float = 0.25          # /v1/chat/completions, the rest /v1/completions
    sampled_fraction: float = 0.5        # temperature 0.8 / top_p 0.95, the rest greedy
    shared_prefix_fraction: float = 0.8  # prompts that open with one of the shared prefixes
    prefix_tokens: int = 32              # length of a shared completion prefix
    max_suffix_tokens: int = 64          # own prompt part: 1..this many tokens
    max_output_tokens: int = 48          # kept requests: 1..this many
    warmup_requests: int = 32            # run first, not counted, before RSS is read
    max_rss_growth: float = 0.05
    settle_timeout_s: float = 60.0       # for the server to show idle after the last request
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_requests", "concurrency", "prefix_tokens", "max_suffix_tokens",
                     "max_output_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("drop_fraction", "wrong_key_fraction", "chat_fraction", "sampled_fraction",
                     "shared_prefix_fraction"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if self.drop_fraction + self.wrong_key_fraction > 1.0:
            raise ValueError("drop_fraction + wrong_key_fraction must be <= 1, got "
                             f"{self.drop_fraction + self.wrong_key_fraction}")
        if self.warmup_requests < 0 or self.max_rss_growth < 0 or self.settle_timeout_s <= 0:
            raise ValueError("warmup_requests and max_rss_growth must be >= 0 and "
                             "settle_timeout_s > 0")


# ---------------------------------------------------------------------------- workload
@dataclass
class SoakRequest:
    path: str                   # /v1/completions or /v1/chat/completions
    body: dict
    drop_after: int | None      # chunks to read before hanging up; None = read to the end
    wrong_key: bool


def make_workload(cfg: SoakConfig, vocab_size: int, num: int, seed: int) -> list[SoakRequest]:
    rng = random.Random(seed)
    lo, hi = min(1000, vocab_size // 2), vocab_size        # ordinary tokens, no specials
    prefixes = [[rng.randrange(lo, hi) for _ in range(cfg.prefix_tokens)]
                for _ in range(len(SYSTEM_PROMPTS))]
    out = []
    for _ in range(num):
        r = rng.random()
        wrong_key = r < cfg.wrong_key_fraction
        drop_after = (rng.randint(1, 4) if not wrong_key and r < cfg.wrong_key_fraction
                      + cfg.drop_fraction else None)
        shared = rng.random() < cfg.shared_prefix_fraction
        group = rng.randrange(len(SYSTEM_PROMPTS))
        if drop_after is None:
            max_tokens = rng.randint(1, cfg.max_output_tokens)
        else:                   # long enough to be still running when the client hangs up
            max_tokens = rng.randint(drop_after + 16, drop_after + 16 + cfg.max_output_tokens)
        body = {"max_tokens": max_tokens, "stream": True,
                # a dropped one runs to max_tokens; kept ones may stop early at EOS
                "ignore_eos": drop_after is not None or rng.random() < 0.5}
        if rng.random() < cfg.sampled_fraction:
            body.update(temperature=0.8, top_p=0.95, seed=rng.randrange(1 << 30))
        else:
            body["temperature"] = 0.0
        if rng.random() < cfg.chat_fraction:
            user = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, cfg.max_suffix_tokens)))
            messages = [{"role": "user", "content": user}]
            if shared:
                messages.insert(0, {"role": "system", "content": SYSTEM_PROMPTS[group]})
            out.append(SoakRequest("/v1/chat/completions", {**body, "messages": messages},
                                   drop_after, wrong_key))
        else:
            suffix = [rng.randrange(lo, hi) for _ in range(rng.randint(1, cfg.max_suffix_tokens))]
            prompt = (prefixes[group] if shared else []) + suffix
            out.append(SoakRequest("/v1/completions", {**body, "prompt": prompt}, drop_after,
                                   wrong_key))
    return out


# ---------------------------------------------------------------------------- client
@dataclass
class SoakOutcome:
    request: SoakRequest
    status: int = 0
    error: str = ""                                  # transport error or bad body
    finish_reasons: dict[int, str] = field(default_factory=dict)   # choice index -> reason
    done: bool = False                               # saw data: [DONE]
    chunks: int = 0
    latency: float = 0.0                             # send -> last byte (or hang-up)


async def send_one(client, req: SoakRequest, api_key: str | None) -> SoakOutcome:
    res = SoakOutcome(req)
    key = "wrong-" + (api_key or "key") if req.wrong_key else api_key
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    start = time.perf_counter()
    try:
        async with client.stream("POST", req.path, json=req.body, headers=headers) as resp:
            res.status = resp.status_code
            if resp.status_code != 200:
                body = json.loads(await resp.aread())
                err = body.get("error") if isinstance(body, dict) else None
                if not isinstance(err, dict) or set(err) != {"message", "type", "param", "code"}:
                    res.error = f"HTTP {resp.status_code} without the OpenAI error body: {body!r:.200}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    res.done = True
                    continue
                chunk = json.loads(line[6:])
                res.chunks += 1
                for choice in chunk.get("choices", ()):
                    if choice.get("finish_reason") is not None:
                        res.finish_reasons[choice["index"]] = choice["finish_reason"]
                if req.drop_after is not None and res.chunks >= req.drop_after:
                    break               # leaving the block closes the connection mid-stream
    except Exception as e:                  # noqa: BLE001 - a failed request is a result
        res.error = f"{type(e).__name__}: {e}"
    res.latency = time.perf_counter() - start
    return res


async def run_requests(base_url: str, requests: list[SoakRequest], concurrency: int,
                       api_key: str | None) -> tuple[list[SoakOutcome], float]:
    import httpx
    limit = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=300, limits=limits) as client:
        async def guarded(req):
            async with limit:
                return await send_one(client, req, api_key)
        t0 = time.perf_counter()
        results = await asyncio.gather(*(guarded(r) for r in requests))
        return results, time.perf_counter() - t0


# ---------------------------------------------------------------------------- server state
def scrape_metrics(base_url: str) -> dict[str, float]:
    """/metrics as {sample name: value}, summed over labels; request_success_total also per
    finished reason as ``request_success_total{reason}``."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families
    out: dict[str, float] = {}
    text = httpx.get(base_url + "/metrics", timeout=30).text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            name = s.name.removeprefix("kvforge:")
            out[name] = out.get(name, 0.0) + s.value
            if "finished_reason" in s.labels:
                key = f"{name}{{{s.labels['finished_reason']}}}"
                out[key] = out.get(key, 0.0) + s.value
    return out


def wait_until_idle(base_url: str, timeout: float) -> dict[str, float]:
    """/metrics once it shows nothing running, waiting or using KV (aborts land a moment after
    the client hangs up); the last scrape when ``timeout`` passes first."""
    deadline = time.monotonic() + timeout
    while True:
        m = scrape_metrics(base_url)
        idle = (m.get("num_requests_running") == 0 and m.get("num_requests_waiting") == 0
                and m.get("kv_cache_usage_perc") == 0)
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.1)


def rss_bytes() -> int:
    """Resident set size of this process now."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        import psutil
        return psutil.Process().memory_info().rss


# ---------------------------------------------------------------------------- the run
@dataclass
class SoakReport:
    num_requests: int
    kept: int
    dropped: int
    unauthorized: int
    server_errors: int
    duration_s: float
    requests_per_s: float
    p50_latency_ms: float
    p99_latency_ms: float
    rss_before_mb: float
    rss_after_mb: float
    aborted: float                        # requests the server counted as aborted
    prefix_cache_blocks: float
    prefix_cache_hit_rate: float
    failures: list[str] = field(default_factory=list)

    @property
    def rss_growth(self) -> float:
        return self.rss_after_mb / self.rss_before_mb - 1.0

    def table(self) -> str:
        rows = [("requests sent", f"{self.num_requests}"),
                ("kept / dropped / wrong key", f"{self.kept} / {self.dropped} / {self.unauthorized}"),
                ("responses >= 500", f"{self.server_errors}"),
                ("aborted by the server", f"{self.aborted:.0f}"),
                ("duration (s)", f"{self.duration_s:.1f}"),
                ("requests/s", f"{self.requests_per_s:.2f}"),
                ("latency p50 / p99 (ms)", f"{self.p50_latency_ms:.0f} / {self.p99_latency_ms:.0f}"),
                ("RSS before / after (MiB)", f"{self.rss_before_mb:.1f} / {self.rss_after_mb:.1f} "
                                             f"({100 * self.rss_growth:+.2f}%)"),
                ("prefix cache blocks / hit rate", f"{self.prefix_cache_blocks:.0f} / "
                                                   f"{self.prefix_cache_hit_rate:.3f}"),
                ("result", "PASS" if not self.failures else f"FAIL ({len(self.failures)})")]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)

    def summary(self, hardware: str) -> str:
        return (f"SUMMARY soak: {'PASS' if not self.failures else 'FAIL'} "
                f"requests={self.num_requests} kept={self.kept} dropped={self.dropped} "
                f"wrong_key={self.unauthorized} 5xx={self.server_errors} "
                f"req_s={self.requests_per_s:.2f} p50_ms={self.p50_latency_ms:.0f} "
                f"p99_ms={self.p99_latency_ms:.0f} rss_mb={self.rss_before_mb:.0f}->"
                f"{self.rss_after_mb:.0f} ({100 * self.rss_growth:+.2f}%) | {hardware}")


def check_outcomes(results: list[SoakOutcome]) -> list[str]:
    failures = []
    for i, r in enumerate(results):
        what = f"request {i} ({r.request.path}, drop_after={r.request.drop_after}, " \
               f"wrong_key={r.request.wrong_key})"
        if r.status >= 500:
            failures.append(f"{what}: HTTP {r.status}")
        elif r.request.wrong_key:
            if r.status != 401 or r.error:
                failures.append(f"{what}: expected 401 with the error body, got {r.status} {r.error}")
        elif r.error or r.status != 200:
            failures.append(f"{what}: HTTP {r.status} {r.error}")
        elif r.request.drop_after is None:
            n = r.request.body.get("n", 1)
            reasons = [r.finish_reasons.get(j) for j in range(n)]
            if not r.done or any(x not in ("stop", "length") for x in reasons):
                failures.append(f"{what}: finish reasons {reasons}, [DONE] {r.done}")
    return failures


def run_soak(server, cfg: SoakConfig, api_key: str | None) -> SoakReport:
    """Soak ``server`` (a kvforge.server.background.BackgroundServer started with ``api_key``)."""
    vocab = server.in_engine(lambda e: e.model_config.vocab_size)
    has_prefix_cache = server.in_engine(lambda e: e.prefix_cache_stats is not None)
    if cfg.warmup_requests:
        warm = make_workload(cfg, vocab, cfg.warmup_requests, cfg.seed + 1)
        asyncio.run(run_requests(server.url, warm, cfg.concurrency, api_key))
        wait_until_idle(server.url, cfg.settle_timeout_s)
    before_metrics = scrape_metrics(server.url)
    gc.collect()
    rss_before = rss_bytes()

    requests = make_workload(cfg, vocab, cfg.num_requests, cfg.seed)
    results, duration = asyncio.run(run_requests(server.url, requests, cfg.concurrency, api_key))
    failures = check_outcomes(results)

    m = wait_until_idle(server.url, cfg.settle_timeout_s)
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        if m.get(name) != 0:
            failures.append(f"/metrics {name} = {m.get(name)} after the run (expected 0)")
    if has_prefix_cache and cfg.shared_prefix_fraction > 0 and not m.get("prefix_cache_blocks"):
        failures.append("/metrics prefix_cache_blocks = 0: shared prefixes were not cached")
    try:
        server.check_clean()
    except AssertionError as e:
        failures.append(f"engine not clean: {e}")
    gc.collect()
    rss_after = rss_bytes()
    if rss_after > rss_before * (1 + cfg.max_rss_growth):
        failures.append(f"RSS grew {100 * (rss_after / rss_before - 1):.2f}% "
                        f"(limit {100 * cfg.max_rss_growth:.0f}%)")

    kept = [r for r in results if not r.request.wrong_key and r.request.drop_after is None]
    latencies = [r.latency for r in kept if r.status == 200]
    aborted = m.get("request_success_total{abort}", 0.0) - before_metrics.get(
        "request_success_total{abort}", 0.0)
    return SoakReport(
        num_requests=len(results), kept=len(kept),
        dropped=sum(r.request.drop_after is not None and not r.request.wrong_key for r in results),
        unauthorized=sum(r.request.wrong_key for r in results),
        server_errors=sum(r.status >= 500 for r in results), duration_s=duration,
        requests_per_s=len(results) / duration, p50_latency_ms=1000 * percentile(latencies, 50),
        p99_latency_ms=1000 * percentile(latencies, 99), rss_before_mb=rss_before / 2**20,
        rss_after_mb=rss_after / 2**20, aborted=aborted,
        prefix_cache_blocks=m.get("prefix_cache_blocks", 0.0),
        prefix_cache_hit_rate=m.get("prefix_cache_hit_rate", 0.0), failures=failures)
