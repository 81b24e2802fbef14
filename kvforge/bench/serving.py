"""Serving benchmark (``kvforge bench serve``): stream requests to a running OpenAI-compatible
server at a request rate and measure what users see, like vLLM's ``benchmark_serving``.

    arrivals: Poisson (burstiness 1), gamma (burstiness < 1 burstier, > 1 smoother), or all at
    once (rate inf); optional --max-concurrency caps requests in flight.
    per request, from the streamed chunks:
      TTFT  first chunk - send          ITL  gaps between chunks
      E2EL  last chunk - send           TPOT (E2EL - TTFT) / (output tokens - 1)
    goodput: completed requests per second that meet every SLO given with --goodput.

Requests are token-id prompts with ``ignore_eos`` and ``max_tokens`` = the target output length,
so every run (and the offline engine in benchmarks/serving.py) does the same work.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path


def add_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="served model name (default: the server's first)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--dataset", choices=["sharegpt", "random"], default="sharegpt")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--sharegpt-max-prompt-len", type=int, default=512)
    p.add_argument("--sharegpt-max-output-len", type=int, default=128)
    p.add_argument("--random-input-len", type=int, default=128)
    p.add_argument("--random-output-len", type=int, default=64)
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths drawn uniformly in [len*(1-r), len*(1+r)]")
    p.add_argument("--request-rate", type=float, default=float("inf"), help="req/s; inf = all at once")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--goodput", nargs="*", default=[], metavar="KEY:MS",
                   help="SLOs, e.g. ttft:2000 tpot:200 e2el:20000 (milliseconds)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--priority", choices=["none", "output-len"], default="none",
                   help="output-len: each request asks for priority = its max_tokens (a server "
                        "with --scheduling-policy priority then runs shortest-job-first)")
    p.add_argument("--result-json", default=None)
    p.add_argument("--plot", default=None, help="PNG path: latency CDFs and tokens over time")


# ---------------------------------------------------------------------------- workload
@dataclass
class ServeRequest:
    prompt_token_ids: list[int]
    output_len: int


def random_requests(vocab_size: int, num: int, input_len: int, output_len: int,
                    range_ratio: float, seed: int) -> list[ServeRequest]:
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"random_range_ratio must be in [0, 1), got {range_ratio}")
    rng = random.Random(seed)
    lo_hi = lambda n: (max(1, int(n * (1 - range_ratio))), max(1, int(n * (1 + range_ratio))))
    (ilo, ihi), (olo, ohi) = lo_hi(input_len), lo_hi(output_len)
    # ids from the middle of the vocabulary: ordinary tokens, no specials at the low end
    return [ServeRequest([rng.randrange(1000, vocab_size) for _ in range(rng.randint(ilo, ihi))],
                         rng.randint(olo, ohi)) for _ in range(num)]


def sharegpt_requests(encode, num: int, max_prompt_len: int, max_output_len: int,
                      seed: int) -> list[ServeRequest]:
    from kvforge.bench.sharegpt import sample_sharegpt_requests
    return [ServeRequest(r.prompt_token_ids, r.output_len) for r in sample_sharegpt_requests(
        encode, num, seed=seed, max_output_len=max_output_len, max_prompt_len=max_prompt_len)]


def arrival_delays(num: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Gaps before each request: gamma(shape=burstiness, mean=1/rate); all zero for rate inf."""
    if rate <= 0 or burstiness <= 0:
        raise ValueError(f"request rate and burstiness must be > 0, got {rate}, {burstiness}")
    if math.isinf(rate):
        return [0.0] * num
    rng = random.Random(seed)
    return [rng.gammavariate(burstiness, 1.0 / (rate * burstiness)) for _ in range(num)]


# ---------------------------------------------------------------------------- client
@dataclass
class RequestResult:
    prompt_len: int
    output_len: int = 0
    ok: bool = False
    error: str = ""
    start: float = 0.0
    ttft: float = 0.0
    e2el: float = 0.0
    itl: list[float] = field(default_factory=list)
    chunk_times: list[float] = field(default_factory=list)   # seconds since benchmark start

    @property
    def tpot(self) -> float | None:
        return (self.e2el - self.ttft) / (self.output_len - 1) if self.output_len > 1 else None


async def send_one(client, model: str, req: ServeRequest, t0: float,
                   priority_by_length: bool = False) -> RequestResult:
    res = RequestResult(prompt_len=len(req.prompt_token_ids))
    body = {"model": model, "prompt": req.prompt_token_ids, "max_tokens": req.output_len,
            "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    if priority_by_length:
        body["priority"] = req.output_len
    start = time.perf_counter()
    res.start = start - t0
    last = start
    try:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                now = time.perf_counter()
                if chunk.get("usage"):
                    res.output_len = chunk["usage"]["completion_tokens"]
                if chunk.get("choices"):
                    if not res.chunk_times:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    res.chunk_times.append(now - t0)
                    last = now
        res.e2el = last - start
        res.ok = res.output_len > 0
        if not res.ok:
            res.error = "no usage chunk"
    except Exception as e:                     # noqa: BLE001 - a failed request is a result
        res.error = f"{type(e).__name__}: {e}"
    return res


async def run_benchmark(base_url: str, model: str, requests: list[ServeRequest], *,
                        request_rate: float, burstiness: float = 1.0,
                        max_concurrency: int | None = None, seed: int = 0,
                        api_key: str | None = None, priority_by_length: bool = False
                        ) -> tuple[list[RequestResult], float]:
    import httpx
    delays = arrival_delays(len(requests), request_rate, burstiness, seed)
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=base_url, timeout=None, limits=limits,
                                 headers=headers) as client:
        t0 = time.perf_counter()

        async def guarded(req):
            if limit is None:
                return await send_one(client, model, req, t0, priority_by_length)
            async with limit:
                return await send_one(client, model, req, t0, priority_by_length)
        tasks = []
        for req, delay in zip(requests, delays):
            await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(guarded(req)))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - t0


# ---------------------------------------------------------------------------- summary
def percentile(xs: list[float], q: float) -> float:
    """The q-th percentile of ``xs`` with linear interpolation (NaN when empty)."""
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = (len(xs) - 1) * q / 100.0
    lo = math.floor(k)
    return xs[lo] + (xs[min(lo + 1, len(xs) - 1)] - xs[lo]) * (k - lo)


def parse_slos(items: list[str]) -> dict[str, float]:
    slos = {}
    for item in items:
        key, _, ms = item.partition(":")
        if key not in ("ttft", "tpot", "e2el") or not ms:
            raise ValueError(f"goodput SLO {item!r} must be ttft|tpot|e2el:MILLISECONDS")
        slos[key] = float(ms) / 1000.0
    return slos


def summarize(results: list[RequestResult], duration: float,
              slos: dict[str, float] | None = None) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_len for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    s = {"completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
         "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
         "request_throughput": len(ok) / duration, "output_throughput": out_tokens / duration,
         "total_token_throughput": (in_tokens + out_tokens) / duration}
    series = {"ttft": [r.ttft for r in ok], "tpot": [r.tpot for r in ok if r.tpot is not None],
              "itl": [x for r in ok for x in r.itl], "e2el": [r.e2el for r in ok]}
    for name, xs in series.items():
        s[f"mean_{name}_ms"] = 1000 * sum(xs) / len(xs) if xs else float("nan")
        s[f"median_{name}_ms"] = 1000 * percentile(xs, 50)
        s[f"p99_{name}_ms"] = 1000 * percentile(xs, 99)
    if slos:
        good = [r for r in ok if all((getattr(r, k) or 0.0) <= v for k, v in slos.items())]
        s["goodput"] = len(good) / duration
        s["slos_ms"] = {k: v * 1000 for k, v in slos.items()}
    errors = [r.error for r in results if not r.ok]
    if errors:
        s["first_error"] = errors[0]
    return s


def format_summary(s: dict, title: str) -> str:
    lines = [f"{'=' * 18} {title} {'=' * 18}",
             f"{'Successful requests:':<34}{s['completed']:>12}",
             f"{'Failed requests:':<34}{s['failed']:>12}",
             f"{'Benchmark duration (s):':<34}{s['duration_s']:>12.2f}",
             f"{'Total input tokens:':<34}{s['total_input_tokens']:>12}",
             f"{'Total generated tokens:':<34}{s['total_output_tokens']:>12}",
             f"{'Request throughput (req/s):':<34}{s['request_throughput']:>12.2f}",
             f"{'Output token throughput (tok/s):':<34}{s['output_throughput']:>12.2f}",
             f"{'Total token throughput (tok/s):':<34}{s['total_token_throughput']:>12.2f}"]
    if "goodput" in s:
        lines.append(f"{'Request goodput (req/s):':<34}{s['goodput']:>12.2f}")
    for name, label in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st)"),
                        ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        lines.append(f"{'-' * 14}{label}{'-' * 14}")
        for stat in ("mean", "median", "p99"):
            lines.append(f"{f'{stat.capitalize()} {name.upper()} (ms):':<34}"
                         f"{s[f'{stat}_{name}_ms']:>12.2f}")
    return "\n".join(lines)


def plot_runs(runs: dict[str, list[RequestResult]], path: str) -> None:
    """Latency CDFs (TTFT, TPOT, E2EL) and cumulative output tokens over time, one line a run."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 4, figsize=(18, 4))
    for label, results in runs.items():
        ok = [r for r in results if r.ok]
        for ax, (name, xs) in zip(axes, (("TTFT", [r.ttft for r in ok]),
                                         ("TPOT", [r.tpot for r in ok if r.tpot is not None]),
                                         ("E2E latency", [r.e2el for r in ok]))):
            xs = sorted(x * 1000 for x in xs)
            ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=label)
            ax.set_xlabel(f"{name} (ms)")
            ax.set_ylabel("fraction of requests")
            ax.set_title(f"{name} CDF")
        times = sorted(t for r in ok for t in r.chunk_times)
        axes[3].plot(times, range(1, len(times) + 1), label=label)
    axes[3].set_xlabel("seconds since start")
    axes[3].set_ylabel("output chunks received (≈ tokens)")
    axes[3].set_title("tokens over time")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---------------------------------------------------------------------------- entry
def server_model(base_url: str, api_key: str | None) -> tuple[str, int | None]:
    import httpx
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    data = httpx.get(base_url + "/v1/models", headers=headers, timeout=30).json()["data"][0]
    return data["id"], data.get("max_model_len")


def server_encoder(base_url: str, api_key: str | None):
    import httpx
    client = httpx.Client(base_url=base_url, timeout=60,
                          headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    return lambda text: client.post("/tokenize", json={"prompt": text}).json()["tokens"]


def build_requests(args, base_url: str, encode=None, vocab_size: int = 32000) -> list[ServeRequest]:
    if args.dataset == "random":
        return random_requests(vocab_size, args.num_prompts, args.random_input_len,
                               args.random_output_len, args.random_range_ratio, args.seed)
    return sharegpt_requests(encode or server_encoder(base_url, args.api_key), args.num_prompts,
                             args.sharegpt_max_prompt_len, args.sharegpt_max_output_len, args.seed)


def run_from_args(args: argparse.Namespace) -> dict:
    base = args.base_url.rstrip("/")
    model = args.model or server_model(base, args.api_key)[0]
    requests = build_requests(args, base)
    results, duration = asyncio.run(run_benchmark(
        base, model, requests, request_rate=args.request_rate, burstiness=args.burstiness,
        max_concurrency=args.max_concurrency, seed=args.seed, api_key=args.api_key,
        priority_by_length=args.priority == "output-len"))
    summary = summarize(results, duration, parse_slos(args.goodput))
    print(format_summary(summary, f"Serving benchmark, rate {args.request_rate} req/s"))
    if args.result_json:
        Path(args.result_json).write_text(json.dumps(
            {"args": {k: v for k, v in vars(args).items() if k != "func"}, "summary": summary,
             "requests": [asdict(r) for r in results]}, indent=1, default=str))
    if args.plot:
        plot_runs({f"rate {args.request_rate}": results}, args.plot)
    print(f"SUMMARY serve: rate={args.request_rate} output_tok_s={summary['output_throughput']:.1f} "
          f"median_ttft_ms={summary['median_ttft_ms']:.0f} median_tpot_ms={summary['median_tpot_ms']:.0f}")
    return summary
