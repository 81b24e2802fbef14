"""FCFS vs skip-join MLFQ on a heavy-tailed Poisson workload, replayed through the engine.

Workload: ``--num-requests`` requests with short prompts (uniform in [--min-prompt,
--max-prompt]) and output lengths from a Pareto law (shape ``--pareto-alpha``, scale
``--pareto-scale`` tokens, capped at ``--max-output``), except a ``--long-fraction`` of jobs
whose output is uniform in [max_output / 2, max_output]: many short jobs, a few very long ones
(in every sample, not only when the Pareto draw happens to produce them).
Arrivals are a Poisson process whose rate puts the decode load at ``--load`` of what
``max_num_seqs`` slots can serve. The default, 1.5, is a burst 50% above capacity for as long
as the requests take to arrive (printed): the regime where queueing, not a job's own decode,
dominates its completion time, and where FastServe reports its gains; ``--load 0.95`` shows the
steady, just-below-capacity case. Both policies get the same requests at the same
arrival times (same seed).

Clock (simulated, stated in the output): each engine step advances the clock by the calibrated
cost of its batch, ``c0 + c1 * scheduled_tokens`` seconds, with c0 and c1 fitted once at start
from a real prefill and real decode steps of this model on this machine, plus the real seconds
the step waited on swap copies (``--preemption-mode swap``: the exposed part of the copies;
what the copy worker overlapped with the forward is free, as it is on a core of its own). So
both policies are charged the same price for the same work and noise from other processes on a
shared box favours neither; idle gaps jump to the next arrival. The real wall time of each
replay is printed too.

MLFQ's work measure: ``--mlfq-prefill-weight auto`` charges a prompt token c1 / (c0 + c1) of a
decode step, the calibrated ratio (FastServe measures service in time).

Metrics per policy: mean / p99 job completion time (JCT = finish - arrival) and TTFT, mean JCT
of the shorter half and of the longest 5% of jobs (where MLFQ is expected to lose), throughput
(output tokens per simulated second over the makespan), preemptions, swaps and swap copy time;
then the fcfs / mlfq ratios.

    .venv/bin/python benchmarks/sched.py --threads 1          # defaults: ~3 minutes, 2 cores
    .venv/bin/python benchmarks/sched.py --threads 1 --load 0.95
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.hardware import hardware_line  # noqa: E402
from benchmarks.report import format_table, write_json  # noqa: E402
from kvforge import LLM, SamplingParams  # noqa: E402


@dataclass
class Job:
    prompt_token_ids: list[int]
    output_len: int
    arrival: float = 0.0


@dataclass
class JobResult:
    arrival: float
    output_len: int
    first_token: float
    finished: float
    num_preemptions: int
    num_swaps: int = 0

    @property
    def jct(self) -> float:
        return self.finished - self.arrival

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrival


def make_jobs(args, vocab_size: int) -> list[Job]:
    rng = np.random.default_rng(args.seed)
    jobs = []
    for _ in range(args.num_requests):
        prompt_len = int(rng.integers(args.min_prompt, args.max_prompt + 1))
        prompt = [int(t) for t in rng.integers(100, vocab_size, prompt_len)]
        # numpy's pareto is Lomax (support from 0): scale * (1 + X) is Pareto from ``scale``
        out_len = int(args.pareto_scale * (1.0 + rng.pareto(args.pareto_alpha)))
        if rng.random() < args.long_fraction:          # the few very long jobs
            out_len = int(rng.integers(args.max_output // 2, args.max_output + 1))
        jobs.append(Job(prompt, max(1, min(out_len, args.max_output))))
    return jobs


def calibrate_step_cost(llm: LLM, vocab_size: int) -> tuple[float, float]:
    """(c0, c1): seconds of a step = c0 + c1 * scheduled tokens, from one 192-token prefill
    and the median of 12 single-token decode steps (best of 3 rounds each)."""
    engine = llm.engine
    rng = np.random.default_rng(0)
    prefill, decode = [], []
    for round_ in range(3):
        prompt = [int(t) for t in rng.integers(100, vocab_size, 192)]
        engine.add_request(f"calib{round_}", prompt,
                           SamplingParams(temperature=0.0, max_tokens=13, ignore_eos=True))
        times = []
        while engine.has_unfinished_requests():
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
        prefill.append(times[0])
        decode.append(float(np.median(times[1:])))
    t_prefill, t_decode = min(prefill), min(decode)
    c1 = max(0.0, (t_prefill - t_decode) / 191)
    return t_decode - c1, c1


def replay(llm: LLM, jobs: list[Job], c0: float, c1: float) -> tuple[list[JobResult], float, int]:
    """Returns (results in job order, makespan on the simulated clock, real seconds)."""
    engine = llm.engine
    copier = engine.scheduler.swapper.copier if engine.scheduler.swapper is not None else None
    scheduled_tokens = [0]
    schedule = engine.scheduler.schedule

    def counting_schedule():
        out = schedule()
        scheduled_tokens[0] = out.total_num_scheduled_tokens
        return out

    engine.scheduler.schedule = counting_schedule
    first_token: dict[str, float] = {}
    results: dict[str, JobResult] = {}
    clock, next_job = 0.0, 0
    wall_start = time.perf_counter()
    try:
        while len(results) < len(jobs):
            if not engine.has_unfinished_requests() and jobs[next_job].arrival > clock:
                clock = jobs[next_job].arrival                    # idle: jump to the next arrival
            while next_job < len(jobs) and jobs[next_job].arrival <= clock:
                job = jobs[next_job]
                engine.add_request(str(next_job), job.prompt_token_ids,
                                   SamplingParams(temperature=0.0, max_tokens=job.output_len,
                                                  ignore_eos=True))
                next_job += 1
            exposed = copier.stats.exposed_seconds if copier is not None else 0.0
            outputs = engine.step()
            if copier is not None:                  # real time the step waited on swap copies
                exposed = copier.stats.exposed_seconds - exposed
            clock += c0 + c1 * scheduled_tokens[0] + exposed
            for out in outputs:
                if out.outputs[0].token_ids and out.request_id not in first_token:
                    first_token[out.request_id] = clock
                if out.finished:
                    job = jobs[int(out.request_id)]
                    results[out.request_id] = JobResult(
                        job.arrival, job.output_len, first_token[out.request_id], clock,
                        out.metrics.num_preemptions, out.metrics.num_swaps)
    finally:
        engine.scheduler.schedule = schedule
    engine.check_integrity()
    assert engine.num_free_blocks == engine.runner.num_blocks, "leaked KV blocks"
    ordered = [results[str(i)] for i in range(len(jobs))]
    return ordered, clock, time.perf_counter() - wall_start


def summarize(results: list[JobResult], makespan: float) -> dict[str, float]:
    jct = np.array([r.jct for r in results])
    ttft = np.array([r.ttft for r in results])
    lengths = np.array([r.output_len for r in results])
    longest = lengths >= np.quantile(lengths, 0.95)
    shorter = lengths <= np.median(lengths)
    return {
        "mean_jct": float(jct.mean()), "p99_jct": float(np.quantile(jct, 0.99)),
        "mean_ttft": float(ttft.mean()), "p99_ttft": float(np.quantile(ttft, 0.99)),
        "mean_jct_short50": float(jct[shorter].mean()),
        "mean_jct_longest5": float(jct[longest].mean()),
        "throughput": float(lengths.sum() / makespan),
        "preemptions": int(sum(r.num_preemptions for r in results)),
        "swaps": int(sum(r.num_swaps for r in results)),
    }


def prefill_weight(arg: str, c0: float, c1: float) -> float:
    """``auto``: a prompt token costs c1, a one-token decode step c0 + c1."""
    return min(1.0, c1 / (c0 + c1)) if arg == "auto" else float(arg)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="GGUF file or HF dir (default: SmolLM2-135M GGUF)")
    p.add_argument("--num-requests", type=int, default=120)
    p.add_argument("--min-prompt", type=int, default=4)
    p.add_argument("--max-prompt", type=int, default=24)
    p.add_argument("--pareto-alpha", type=float, default=1.1)
    p.add_argument("--pareto-scale", type=float, default=4.0)
    p.add_argument("--max-output", type=int, default=400)
    p.add_argument("--long-fraction", type=float, default=0.05,
                   help="share of jobs whose output is uniform in [max_output/2, max_output]")
    p.add_argument("--load", type=float, default=1.5,
                   help="offered decode load / capacity (1.5: a burst above capacity)")
    p.add_argument("--max-num-seqs", type=int, default=2)
    p.add_argument("--mlfq-quanta", default="16,64,256",
                   help="bounded levels' quanta in tokens of work (prompts here are short)")
    p.add_argument("--mlfq-starvation-steps", type=int, default=256)
    p.add_argument("--mlfq-prefill-weight", default="auto",
                   help="'auto' = calibrated prefill-token / decode-step cost, or a number")
    p.add_argument("--preemption-mode", default="swap", choices=["recompute", "swap", "auto"])
    p.add_argument("--swap-copy-mode", default="auto", choices=["auto", "async", "sync"])
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if not 0 < args.load:
        raise SystemExit(f"--load must be > 0, got {args.load}")
    if args.threads:
        torch.set_num_threads(args.threads)

    engine_kwargs = dict(max_num_seqs=args.max_num_seqs, max_model_len=1024,
                         preemption_mode=args.preemption_mode, swap_copy_mode=args.swap_copy_mode,
                         num_threads=args.threads or torch.get_num_threads())
    fcfs = LLM(args.model, scheduling_policy="fcfs", **engine_kwargs)
    vocab = fcfs.engine.model_config.vocab_size
    c0, c1 = calibrate_step_cost(fcfs, vocab)
    weight = prefill_weight(args.mlfq_prefill_weight, c0, c1)
    llms = {"fcfs": fcfs,
            "mlfq": LLM(args.model, scheduling_policy="mlfq", mlfq_quanta=args.mlfq_quanta,
                        mlfq_starvation_steps=args.mlfq_starvation_steps,
                        mlfq_prefill_weight=weight, **engine_kwargs)}

    jobs = make_jobs(args, vocab)
    mean_out = float(np.mean([j.output_len for j in jobs]))
    # a full batch of decodes serves max_num_seqs tokens per (c0 + c1 * max_num_seqs) seconds
    capacity_jobs_per_s = args.max_num_seqs / ((c0 + c1 * args.max_num_seqs) * mean_out)
    rate = args.load * capacity_jobs_per_s
    gaps = np.random.default_rng(args.seed + 1).exponential(1.0 / rate, len(jobs))
    for job, t in zip(jobs, np.cumsum(gaps) - gaps[0]):
        job.arrival = float(t)

    print(hardware_line())
    print(f"model: {fcfs.engine.model_config.architecture}, max_num_seqs "
          f"{args.max_num_seqs}; clock: simulated, step = {c0 * 1e3:.2f} ms + "
          f"{c1 * 1e6:.1f} us x scheduled tokens (calibrated here) + exposed swap copy time")
    lengths = sorted(j.output_len for j in jobs)
    print(f"workload: {len(jobs)} requests, Poisson {rate:.2f} req/s over "
          f"{jobs[-1].arrival:.1f} s (load {args.load}), prompts {args.min_prompt}-"
          f"{args.max_prompt} tokens, outputs Pareto(alpha {args.pareto_alpha}, scale "
          f"{args.pareto_scale}) capped {args.max_output}, {args.long_fraction:.0%} long in "
          f"[{args.max_output // 2}, {args.max_output}]: median {lengths[len(lengths) // 2]}, "
          f"mean {mean_out:.1f}, max {lengths[-1]}, seed {args.seed}")
    mlfq_cfg = llms["mlfq"].engine.scheduler.waiting.config
    swapper = llms["mlfq"].engine.scheduler.swapper
    print(f"preemption mode: {args.preemption_mode}"
          f"{f' ({swapper.copier.mode} copies)' if swapper is not None else ''}; mlfq: quanta "
          f"{','.join(map(str, mlfq_cfg.quanta))} + unbounded tokens of work, prefill weight "
          f"{mlfq_cfg.prefill_weight:.3f}, starvation bound {mlfq_cfg.starvation_steps} steps")

    stats = {}
    for policy, llm in llms.items():
        results, makespan, wall = replay(llm, jobs, c0, c1)
        stats[policy] = summarize(results, makespan)
        stats[policy]["wall_s"] = wall
        swap = llm.engine.swap_stats
        stats[policy]["swap_copy_s"] = swap.copy_seconds if swap is not None else 0.0
        stats[policy]["swap_exposed_s"] = swap.exposed_seconds if swap is not None else 0.0
    queue = llms["mlfq"].engine.scheduler.waiting
    stats["mlfq"]["demotions"] = queue.num_demotions
    stats["mlfq"]["promotions"] = queue.num_promotions
    keys = ["mean_jct", "p99_jct", "mean_ttft", "p99_ttft", "mean_jct_short50",
            "mean_jct_longest5", "throughput", "preemptions", "swaps", "swap_copy_s",
            "swap_exposed_s", "wall_s"]
    rows = [[k, stats["fcfs"][k], stats["mlfq"][k],
             stats["fcfs"][k] / stats["mlfq"][k] if stats["mlfq"][k] else float("nan")]
            for k in keys]
    print(format_table(["metric (simulated s)", "fcfs", "mlfq", "fcfs/mlfq"], rows))
    print(f"mlfq: {stats['mlfq']['demotions']} demotions, {stats['mlfq']['promotions']} "
          f"starvation promotions")
    if args.json:
        write_json(args.json, {"args": vars(args), "c0": c0, "c1": c1, "prefill_weight": weight,
                               "stats": stats})
    s = {k: stats["fcfs"][k] / stats["mlfq"][k] for k in (
        "mean_jct", "mean_ttft", "p99_jct", "mean_jct_short50", "mean_jct_longest5",
        "throughput")}
    loses = [k for k in ("mean_jct", "p99_jct", "mean_ttft", "p99_ttft", "mean_jct_short50",
                         "mean_jct_longest5") if stats["fcfs"][k] < stats["mlfq"][k]]
    print(f"mlfq loses on: {', '.join(loses) or 'nothing measured here'}")
    print(f"SUMMARY sched: mlfq vs fcfs at load {args.load}: mean JCT {s['mean_jct']:.2f}x lower, "
          f"mean TTFT {s['mean_ttft']:.2f}x lower, p99 JCT {s['p99_jct']:.2f}x, longest-5% JCT "
          f"{s['mean_jct_longest5']:.2f}x (below 1 = mlfq loses), throughput ratio "
          f"{1 / s['throughput']:.2f} (mlfq/fcfs), preemptions {stats['mlfq']['preemptions']}, "
          f"swaps {stats['mlfq']['swaps']}")


if __name__ == "__main__":
    main()
