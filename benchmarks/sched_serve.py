"""FCFS vs MLFQ vs priority through the server: ``kvforge serve`` once per policy, the same
ShareGPT requests streamed by ``kvforge bench serve``'s client at a Poisson rate near capacity.

    python benchmarks/sched_serve.py --policies fcfs fcfs+ahead mlfq+ahead mlfq

    python benchmarks/sched_serve.py                       # defaults: ~10 minutes on 2 cores
    python benchmarks/sched_serve.py --load 0.9 --num-prompts 64 --rounds 2

1. Capacity: one ``--scheduling-policy fcfs`` server gets every request at once (rate inf);
   capacity = the output tokens it streams while every slot is busy (up to the last request's
   first token) per second, over the mean output length, in requests / s. (Completed requests
   / duration would count the drain at the end, where fewer requests than slots are left, and
   understate capacity: a "0.9" load would run well below it.) The measured rate is ``--load``
   x capacity.
2. Each round starts one server per policy in turn (``--scheduling-policy fcfs | mlfq |
   priority``, ``--max-num-seqs`` slots, ``--preemption-mode``), warms it up, sends the same
   requests with the same Poisson arrival times, and stops it. Under ``priority`` every request
   asks for priority = its max_tokens (``kvforge bench serve --priority output-len``): a
   non-preemptive shortest-job-first that knows every length, a reference. ``POLICY+ahead``
   runs POLICY with ``--prefill-ahead N`` (``--prefill-ahead``, default 32): requests without
   a sequence slot get their prompt prefilled and first token streamed, then wait holding
   their KV (kvforge/sched/scheduler.py).
3. Per policy (mean over rounds): mean / p99 JCT (end-to-end latency of the stream) and TTFT,
   median TPOT, output tok/s; then fcfs / policy for each other policy (> 1: better than
   FCFS) and one SUMMARY line.

Requests are greedy with ``ignore_eos`` and max_tokens = the ShareGPT answer's length (capped at
``--sharegpt-max-output-len``), so every policy does the same work.
"""
from __future__ import annotations

import argparse
import asyncio
import signal
import socket
import sys
from pathlib import Path

if __package__ in (None, ""):                       # run as a script: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.hardware import hardware_line, physical_cores  # noqa: E402
from benchmarks.report import format_table, write_json  # noqa: E402
from benchmarks.serving import launch_server  # noqa: E402
from kvforge.bench.serving import (build_requests, run_benchmark, server_model,  # noqa: E402
                                   summarize)

POLICIES = ("fcfs", "mlfq", "priority")
AHEAD = "+ahead"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine-model", default=None, help="model path (default: SmolLM2-135M GGUF)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--sharegpt-max-prompt-len", type=int, default=256)
    p.add_argument("--sharegpt-max-output-len", type=int, default=512)
    p.add_argument("--load", type=float, default=0.9, help="request rate / measured capacity")
    p.add_argument("--rounds", type=int, default=1, help="rounds of all policies, alternated")
    p.add_argument("--max-num-seqs", type=int, default=4)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--kv-cache-memory", default="1GiB")
    p.add_argument("--preemption-mode", default="swap", choices=["recompute", "swap", "auto"])
    p.add_argument("--policies", nargs="+", default=list(POLICIES),
                   help="fcfs (always run first, the baseline), mlfq, priority, each optionally "
                        f"with {AHEAD!r}")
    p.add_argument("--prefill-ahead", type=int, default=32,
                   help=f"--prefill-ahead of the servers whose policy ends in {AHEAD!r}")
    p.add_argument("--mlfq-starvation-steps", type=int, default=None,
                   help="passed to the mlfq server (default: the engine's)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: cores)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if not 0 < args.load:
        raise SystemExit(f"--load must be > 0, got {args.load}")
    for policy in args.policies:
        if policy.removesuffix(AHEAD) not in POLICIES:
            raise SystemExit(f"unknown policy {policy!r}: {', '.join(POLICIES)}, each optionally "
                             f"with {AHEAD!r}")
    args.policies = ["fcfs", *(p for p in dict.fromkeys(args.policies) if p != "fcfs")]
    if args.rounds < 1 or args.num_prompts < 1:
        raise SystemExit(f"--rounds and --num-prompts must be >= 1, got {args.rounds}, "
                         f"{args.num_prompts}")
    # fields launch_server and build_requests read
    args.threads = args.threads or physical_cores()
    args.dataset, args.api_key = "sharegpt", None
    return args


class PolicyServer:
    """``kvforge serve --scheduling-policy POLICY`` on a free port, for one ``with`` block."""

    def __init__(self, args, policy: str) -> None:
        self.args, self.policy = args, policy

    def __enter__(self) -> str:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        policy = self.policy.removesuffix(AHEAD)
        flags = ["--scheduling-policy", policy, "--preemption-mode", self.args.preemption_mode]
        if self.policy.endswith(AHEAD):
            flags += ["--prefill-ahead", str(self.args.prefill_ahead)]
        if policy == "mlfq" and self.args.mlfq_starvation_steps is not None:
            flags += ["--mlfq-starvation-steps", str(self.args.mlfq_starvation_steps)]
        self.proc = launch_server(self.args, port, tuple(flags))
        return f"http://127.0.0.1:{port}"

    def __exit__(self, *exc) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=120)


def full_batch_capacity(results) -> float:
    """Requests / s while every slot is busy, from a rate-inf run (see the module doc)."""
    busy_until = max(r.start + r.ttft for r in results)       # the last admission
    tokens = 0.0
    for r in results:                  # a chunk may carry several tokens: share them evenly
        per_chunk = r.output_len / max(1, len(r.chunk_times))
        tokens += per_chunk * sum(1 for t in r.chunk_times if t <= busy_until)
    mean_output = sum(r.output_len for r in results) / len(results)
    return tokens / busy_until / mean_output


def measure(base: str, requests, rate: float, seed: int, priority_by_length: bool,
            capacity: bool = False) -> dict:
    model, _ = server_model(base, None)
    # a short untimed run: the first measured request does not pay for warm-up
    asyncio.run(run_benchmark(base, model, requests[:2], request_rate=float("inf")))
    results, duration = asyncio.run(run_benchmark(
        base, model, requests, request_rate=rate, seed=seed,
        priority_by_length=priority_by_length))
    summary = summarize(results, duration)
    if summary["failed"]:
        raise SystemExit(f"{summary['failed']} requests failed: {summary.get('first_error')}")
    if capacity:
        summary["full_batch_capacity"] = full_batch_capacity(results)
    return summary


def main(argv=None) -> dict:
    args = parse_args(argv)
    with PolicyServer(args, "fcfs") as base:
        requests = build_requests(args, base)
        capacity_run = measure(base, requests, float("inf"), args.seed, False, capacity=True)
    capacity = capacity_run["full_batch_capacity"]
    rate = args.load * capacity
    print(hardware_line())
    print(f"workload: ShareGPT, {len(requests)} requests, prompts <= "
          f"{args.sharegpt_max_prompt_len} tokens ({sum(len(r.prompt_token_ids) for r in requests)}"
          f" in all), outputs <= {args.sharegpt_max_output_len} "
          f"({sum(r.output_len for r in requests)} in all), greedy, ignore_eos; max_num_seqs "
          f"{args.max_num_seqs}, preemption {args.preemption_mode}")
    print(f"capacity (fcfs, all at once, every slot busy): {capacity:.3f} req/s (completed / "
          f"duration: {capacity_run['request_throughput']:.3f}); Poisson rate {rate:.3f} req/s "
          f"(load {args.load}), seed {args.seed}", flush=True)
    policies = args.policies
    runs: dict[str, list[dict]] = {p: [] for p in policies}
    for round_ in range(args.rounds):
        for policy in policies:
            with PolicyServer(args, policy) as base:
                s = measure(base, requests, rate, args.seed,
                            policy.removesuffix(AHEAD) == "priority")
            runs[policy].append(s)
            print(f"round {round_ + 1} {policy}: mean JCT {s['mean_e2el_ms'] / 1e3:.2f} s, mean "
                  f"TTFT {s['mean_ttft_ms'] / 1e3:.2f} s, duration {s['duration_s']:.1f} s",
                  flush=True)
    keys = ["mean_e2el_ms", "p99_e2el_ms", "mean_ttft_ms", "p99_ttft_ms", "median_tpot_ms",
            "output_throughput", "duration_s"]
    stats = {p: {k: sum(r[k] for r in rs) / len(rs) for k in keys} for p, rs in runs.items()}
    names = {"mean_e2el_ms": "mean JCT (ms)", "p99_e2el_ms": "p99 JCT (ms)",
             "mean_ttft_ms": "mean TTFT (ms)", "p99_ttft_ms": "p99 TTFT (ms)",
             "median_tpot_ms": "median TPOT (ms)", "output_throughput": "output tok/s",
             "duration_s": "duration (s)"}
    others = policies[1:]
    rows = [[names[k], *(stats[p][k] for p in policies),
             *(stats["fcfs"][k] / stats[p][k] for p in others)] for k in keys]
    print(format_table(["metric (mean of rounds)", *policies, *(f"fcfs/{p}" for p in others)],
                       rows))
    if args.json:
        write_json(args.json, {"args": vars(args), "capacity_req_s": capacity, "rate": rate,
                               "runs": runs, "stats": stats})
    f = stats["fcfs"]
    print(f"SUMMARY sched_serve (ShareGPT, {hardware_line()}): load {args.load} of capacity "
          f"({rate:.3f} req/s), max_num_seqs {args.max_num_seqs}, vs fcfs: " + "; ".join(
              f"{p} mean TTFT {f['mean_ttft_ms'] / stats[p]['mean_ttft_ms']:.2f}x lower, mean "
              f"JCT {f['mean_e2el_ms'] / stats[p]['mean_e2el_ms']:.2f}x lower, p99 JCT "
              f"{f['p99_e2el_ms'] / stats[p]['p99_e2el_ms']:.2f}x" for p in others))
    return stats


if __name__ == "__main__":
    main()
