"""Serving benchmark: kvforge serve at several request rates vs the offline engine, same requests.

    python benchmarks/serving.py                         # default model, rates 1 and inf
    python benchmarks/serving.py --request-rates 0.5 2 inf --num-prompts 64
    python benchmarks/serving.py --base-url http://host:8000   # an already running server

Starts ``kvforge serve`` in a subprocess (unless --base-url is given), runs ``kvforge bench serve``
logic once per rate on the same ShareGPT (or random) requests, then, for the ratio, runs the same
requests through the offline ``LLM.generate`` in this process with the same engine flags and
thread count. ratio = server output tok/s at the highest rate / offline output tok/s (target >= 0.9).
Writes --result-json and a PNG plot (latency CDFs, tokens over time). Ends with one SUMMARY line.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path

if __package__ in (None, ""):                       # run as a script: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.hardware import hardware_line, physical_cores
from kvforge.bench.serving import (add_bench_args, build_requests, format_summary, parse_slos,
                                   plot_runs, run_benchmark, summarize)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_bench_args(p)
    p.set_defaults(base_url=None, result_json="docs/bench/serving_bench.json", plot="docs/bench/serving_bench.png",
                   goodput=["ttft:5000", "tpot:500"])
    p.add_argument("--request-rates", type=float, nargs="+", default=[1.0, float("inf")])
    p.add_argument("--engine-model", default=None, help="model path for the launched server")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: physical cores)")
    p.add_argument("--max-num-seqs", type=int, default=128, help="engine flag, server and offline")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="engine flag, both")
    p.add_argument("--kv-cache-memory", default="1GiB", help="engine flag, both")
    p.add_argument("--skip-offline", action="store_true")
    return p.parse_args(argv)


def launch_server(args, port: int, extra_flags: tuple[str, ...] = ()) -> subprocess.Popen:
    """``kvforge serve`` with the engine flags of ``args`` (plus ``extra_flags``), once healthy."""
    cmd = [sys.executable, "-m", "kvforge.cli", "serve", "--port", str(port),
           "--num-threads", str(args.threads), "--log-level", "warning",
           "--max-num-seqs", str(args.max_num_seqs), "--kv-cache-memory", args.kv_cache_memory,
           "--max-num-batched-tokens", str(args.max_num_batched_tokens),
           "--max-waiting-requests", "100000"]
    if args.engine_model:
        cmd += ["--model", args.engine_model]
    cmd += list(extra_flags)
    proc = subprocess.Popen(cmd, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    import httpx
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("server did not come up in 300 s")


def offline_throughput(args, requests) -> dict:
    """Same requests, same engine flags, through LLM.generate (warm-up run first, not timed)."""
    from kvforge import LLM, SamplingParams
    llm = LLM(args.engine_model, num_threads=args.threads, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens,
              kv_cache_memory=args.kv_cache_memory)
    params = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True)
              for r in requests]
    prompts = [r.prompt_token_ids for r in requests]
    # timed both on the main thread and on a worker thread (where the server's engine loop
    # runs): OpenMP thread teams behave differently in each (on a loaded CPU the main thread
    # measured 5-8x slower, on an idle one somewhat faster), so the baseline is the faster run
    runs = []

    def work():
        llm.generate(prompts[:2], params[:2], use_tqdm=False)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        runs.append((time.perf_counter() - t0, outs))
    work()
    worker = threading.Thread(target=work)
    worker.start()
    worker.join()
    elapsed, outs = min(runs, key=lambda r: r[0])
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"duration_s": elapsed, "total_output_tokens": tokens, "output_throughput": tokens / elapsed}


def main(argv=None) -> dict:
    args = parse_args(argv)
    args.threads = args.threads or physical_cores()
    import torch
    torch.set_num_threads(args.threads)
    proc = None
    base = args.base_url
    if base is None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        proc = launch_server(args, port)
        base = f"http://127.0.0.1:{port}"
    try:
        from kvforge.bench.serving import server_model
        model, _ = server_model(base, args.api_key)
        requests = build_requests(args, base)
        # one short untimed run so the first measured rate does not pay for warm-up
        asyncio.run(run_benchmark(base, model, requests[:2], request_rate=float("inf")))
        runs, summaries = {}, {}
        for rate in args.request_rates:
            results, duration = asyncio.run(run_benchmark(
                base, model, requests, request_rate=rate, burstiness=args.burstiness,
                max_concurrency=args.max_concurrency, seed=args.seed, api_key=args.api_key))
            s = summarize(results, duration, parse_slos(args.goodput))
            print(format_summary(s, f"rate {rate} req/s"))
            runs[f"rate {rate}"] = results
            summaries[str(rate)] = s
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=120)
    offline = None if args.skip_offline else offline_throughput(args, requests)

    print()
    print(hardware_line())
    print(f"workload: {args.dataset}, {len(requests)} requests, "
          f"{sum(len(r.prompt_token_ids) for r in requests)} prompt tokens, "
          f"{sum(r.output_len for r in requests)} output tokens (ignore_eos, greedy)")
    header = (f"{'run':<16}{'req/s':>8}{'out tok/s':>11}{'TTFT med':>10}{'TTFT p99':>10}"
              f"{'TPOT med':>10}{'ITL med':>9}{'E2EL med':>10}{'goodput':>9}")
    print(header)
    print("-" * len(header))
    for rate, s in summaries.items():
        print(f"{'rate ' + rate:<16}{s['request_throughput']:>8.2f}{s['output_throughput']:>11.1f}"
              f"{s['median_ttft_ms']:>10.0f}{s['p99_ttft_ms']:>10.0f}{s['median_tpot_ms']:>10.0f}"
              f"{s['median_itl_ms']:>9.0f}{s['median_e2el_ms']:>10.0f}{s.get('goodput', 0):>9.2f}")
    top = summaries[str(max(args.request_rates))]
    ratio = None
    if offline is not None:
        print(f"{'offline (best)':<16}{len(requests) / offline['duration_s']:>8.2f}"
              f"{offline['output_throughput']:>11.1f}")
        ratio = top["output_throughput"] / offline["output_throughput"]
        print(f"server / offline output tok/s at rate {max(args.request_rates)}: {ratio:.3f} "
              f"(target >= 0.9)")
    plot_runs(runs, args.plot)
    result = {"hardware": hardware_line(), "summaries": summaries, "offline": offline,
              "ratio": ratio, "args": {k: v for k, v in vars(args).items()},
              "requests": {label: [asdict(r) for r in rs] for label, rs in runs.items()}}
    Path(args.result_json).write_text(json.dumps(result, indent=1, default=str))
    print(f"wrote {args.result_json} and {args.plot}")
    print("SUMMARY serving: " + " ".join(
        f"rate{r}={s['output_throughput']:.1f}tok/s" for r, s in summaries.items())
        + (f" offline={offline['output_throughput']:.1f}tok/s ratio={ratio:.3f}" if offline else ""))
    return result


if __name__ == "__main__":
    main()
