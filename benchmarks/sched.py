"""FCFS vs skip-join MLFQ (vs priority) through the engine: two workloads, two clocks.

Workloads (``--workload``):
- ``pareto`` (default): ``--num-requests`` requests with short prompts (uniform in [--min-prompt,
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
- ``head-of-line``: ``--num-long`` requests of ``--long-output`` tokens submitted ahead of
  ``--num-short`` of ``--short-output`` tokens, all at once (offline ``LLM.generate``), prompts
  as above, ``max_num_seqs`` 4 unless given: the case where FCFS makes every short job wait for
  the long ones.

Real clock (``--real-clock``; both workloads unless ``--workload`` picks one): requests are
added to the engine when their arrival time has passed on ``time.perf_counter`` (head-of-line:
all before the first step, as ``LLM.generate`` does) and each job's JCT and TTFT come from its
``RequestOutput.metrics`` (finished / first token - arrival). fcfs, mlfq and priority
(``priority`` = the job's output length: a non-preemptive shortest-job-first that knows every
length, a reference) run in turn for ``--rounds`` rounds, so slow drift on a shared machine hits
each alike; round r draws its jobs with seed + r (fresh prompts: the engines' prefix caches
hold the earlier rounds'). Outputs are compared with fcfs's, job by job (the count of jobs
whose tokens differ is printed). Also printed: model steps (a k-step multi-step decode counts
k), the machine-independent clock of tests/sched/test_mlfq_engine.py. Preemption by swap unless
given (recompute recomputes a preempted job's last partial block through another kernel path
than the one that first computed it, which on GGUF weights can change a greedy token); the
engine's mlfq quanta and prefill weight unless given. One table per workload, then one
SUMMARY line for both.

Clock (simulated, stated in the output): each engine step advances the clock by the calibrated
cost of its batch, ``c0 + c1 * scheduled_tokens`` seconds, with c0 and c1 fitted once at start
from a real prefill and real decode steps of this model on this machine, plus the real seconds
the step waited on swap copies (``--preemption-mode swap``: the exposed part of the copies;
what the copy worker overlapped with the forward is free, as it is on a core of its own). So
both policies are charged the same price for the same work and noise from other processes on a
shared box favours neither; idle gaps jump to the next arrival. The real wall time of each
replay is printed too.

MLFQ's work measure: the engine's default prefill weight unless given; ``--mlfq-prefill-weight
auto`` charges a prompt token c1 / (c0 + c1) of a decode step, the calibrated ratio (FastServe
measures service in time).

Metrics per policy: mean / p99 job completion time (JCT = finish - arrival) and TTFT, mean JCT
of the shorter half and of the longest 5% of jobs (where MLFQ is expected to lose), throughput
(output tokens per simulated second over the makespan), preemptions, swaps and swap copy time;
then the fcfs / mlfq ratios.

    .venv/bin/python benchmarks/sched.py --threads 1          # defaults: ~3 minutes, 2 cores
    .venv/bin/python benchmarks/sched.py --threads 1 --load 0.95
    .venv/bin/python benchmarks/sched.py --real-clock          # both workloads, ~6 minutes
    .venv/bin/python benchmarks/sched.py --real-clock --workload head-of-line --rounds 3
    .venv/bin/python benchmarks/sched.py --real-clock --workload pareto --load 0.95
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
    if args.workload == "head-of-line":
        return make_head_of_line_jobs(args, vocab_size)
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


def make_head_of_line_jobs(args, vocab_size: int) -> list[Job]:
    """The long jobs first, then the short ones; every arrival at 0."""
    rng = np.random.default_rng(args.seed)
    lengths = [args.long_output] * args.num_long + [args.short_output] * args.num_short
    jobs = []
    for output_len in lengths:
        prompt_len = int(rng.integers(args.min_prompt, args.max_prompt + 1))
        jobs.append(Job([int(t) for t in rng.integers(100, vocab_size, prompt_len)], output_len))
    return jobs


def set_poisson_arrivals(args, jobs: list[Job], capacity_jobs_per_s: float) -> float:
    """Arrival times at ``--load`` x capacity (pareto); head-of-line: all at 0. Returns the rate."""
    if args.workload == "head-of-line":
        return float("inf")
    rate = args.load * capacity_jobs_per_s
    gaps = np.random.default_rng(args.seed + 1).exponential(1.0 / rate, len(jobs))
    for job, t in zip(jobs, np.cumsum(gaps) - gaps[0]):
        job.arrival = float(t)
    return rate


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


def workload_line(args, jobs: list[Job], rate: float) -> str:
    lengths = sorted(j.output_len for j in jobs)
    prompts = f"prompts {args.min_prompt}-{args.max_prompt} tokens"
    if args.workload == "head-of-line":
        return (f"workload: head-of-line, {args.num_long} x {args.long_output} output tokens "
                f"submitted ahead of {args.num_short} x {args.short_output}, all at once, "
                f"{prompts}, greedy, ignore_eos, seed {args.seed}")
    return (f"workload: {len(jobs)} requests, Poisson {rate:.2f} req/s over "
            f"{jobs[-1].arrival:.1f} s (load {args.load}), {prompts}, outputs Pareto(alpha "
            f"{args.pareto_alpha}, scale {args.pareto_scale}) capped {args.max_output}, "
            f"{args.long_fraction:.0%} long in [{args.max_output // 2}, {args.max_output}]: "
            f"median {lengths[len(lengths) // 2]}, mean {np.mean(lengths):.1f}, max "
            f"{lengths[-1]}, seed {args.seed}")


def mlfq_line(cfg) -> str:
    return (f"mlfq: quanta {','.join(map(str, cfg.quanta))} + unbounded tokens of work, "
            f"prefill weight {cfg.prefill_weight:.3f}, starvation bound "
            f"{cfg.starvation_steps} steps")


def prefill_weight(arg: str, c0: float, c1: float) -> float:
    """``auto``: a prompt token costs c1, a one-token decode step c0 + c1."""
    return min(1.0, c1 / (c0 + c1)) if arg == "auto" else float(arg)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="GGUF file or HF dir (default: SmolLM2-135M GGUF)")
    p.add_argument("--workload", default=None, choices=["pareto", "head-of-line"],
                   help="default: pareto on the simulated clock, both on the real clock")
    p.add_argument("--real-clock", action="store_true",
                   help="measure on time.perf_counter, fcfs / mlfq / priority in turn")
    p.add_argument("--rounds", type=int, default=2,
                   help="--real-clock: rounds of all policies (round r draws its jobs with "
                        "seed + r, so no round finds an earlier one's prompts in the prefix cache)")
    p.add_argument("--num-requests", type=int, default=120)
    p.add_argument("--min-prompt", type=int, default=4)
    p.add_argument("--max-prompt", type=int, default=24)
    p.add_argument("--pareto-alpha", type=float, default=1.1)
    p.add_argument("--pareto-scale", type=float, default=4.0)
    p.add_argument("--max-output", type=int, default=400)
    p.add_argument("--long-fraction", type=float, default=0.05,
                   help="share of jobs whose output is uniform in [max_output/2, max_output]")
    p.add_argument("--num-long", type=int, default=8, help="head-of-line: long jobs (first)")
    p.add_argument("--long-output", type=int, default=160)
    p.add_argument("--num-short", type=int, default=32, help="head-of-line: short jobs (after)")
    p.add_argument("--short-output", type=int, default=8)
    p.add_argument("--load", type=float, default=1.5,
                   help="offered decode load / capacity (1.5: a burst above capacity)")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="default: 4 for head-of-line, 2 for pareto")
    p.add_argument("--mlfq-quanta", default=None,
                   help="bounded levels' quanta in tokens of work (default: the engine's)")
    p.add_argument("--mlfq-starvation-steps", type=int, default=256)
    p.add_argument("--mlfq-prefill-weight", default=None,
                   help="'auto' = calibrated prefill-token / decode-step cost, or a number "
                        "(default: the engine's)")
    p.add_argument("--preemption-mode", default="swap", choices=["recompute", "swap", "auto"],
                   help="default swap: it keeps a preempted job's KV bit for bit, so greedy "
                        "outputs match FCFS's exactly; recompute recomputes the last partial "
                        "block, through another kernel path than the one that first computed "
                        "it (on GGUF weights that can change a greedy token)")
    p.add_argument("--swap-copy-mode", default="auto", choices=["auto", "async", "sync"])
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if not 0 < args.load:
        raise SystemExit(f"--load must be > 0, got {args.load}")
    if args.rounds < 1:
        raise SystemExit(f"--rounds must be >= 1, got {args.rounds}")
    for name in ("num_long", "num_short", "long_output", "short_output"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.workload is None and not args.real_clock:
        args.workload = "pareto"
    if args.workload is not None:
        args.max_num_seqs = workload_max_num_seqs(args, args.workload)
    if args.threads:
        torch.set_num_threads(args.threads)
    return args


def workload_max_num_seqs(args, workload: str) -> int:
    if args.max_num_seqs is not None:
        return args.max_num_seqs
    return 4 if workload == "head-of-line" else 2


def mlfq_options(args, c0: float, c1: float) -> dict:
    """The engine's mlfq options the command line sets (the rest stay the engine's defaults)."""
    options = {"mlfq_starvation_steps": args.mlfq_starvation_steps}
    if args.mlfq_quanta is not None:
        options["mlfq_quanta"] = args.mlfq_quanta
    if args.mlfq_prefill_weight is not None:
        options["mlfq_prefill_weight"] = prefill_weight(args.mlfq_prefill_weight, c0, c1)
    return options


def main() -> None:
    args = parse_args()
    if args.real_clock:
        main_real_clock(args)
    else:
        main_simulated(args)


def build_engines(args, policies: tuple[str, ...]) -> tuple[dict[str, LLM], int, float, float]:
    """One engine per policy (fcfs first: it calibrates the step cost c0 + c1 x tokens that the
    simulated clock, pareto's arrival rate and ``--mlfq-prefill-weight auto`` use)."""
    engine_kwargs = dict(max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                         preemption_mode=args.preemption_mode, swap_copy_mode=args.swap_copy_mode,
                         num_threads=args.threads or torch.get_num_threads())
    fcfs = LLM(args.model, scheduling_policy="fcfs", **engine_kwargs)
    vocab = fcfs.engine.model_config.vocab_size
    c0, c1 = calibrate_step_cost(fcfs, vocab)
    llms = {"fcfs": fcfs}
    for policy in policies:
        if policy != "fcfs":
            extra = mlfq_options(args, c0, c1) if policy == "mlfq" else {}
            llms[policy] = LLM(args.model, scheduling_policy=policy, **extra, **engine_kwargs)
    return llms, vocab, c0, c1


def main_simulated(args) -> None:
    llms, vocab, c0, c1 = build_engines(args, ("fcfs", "mlfq"))
    weight = llms["mlfq"].engine.scheduler.waiting.config.prefill_weight

    jobs = make_jobs(args, vocab)
    mean_out = float(np.mean([j.output_len for j in jobs]))
    # a full batch of decodes serves max_num_seqs tokens per (c0 + c1 * max_num_seqs) seconds
    capacity_jobs_per_s = args.max_num_seqs / ((c0 + c1 * args.max_num_seqs) * mean_out)
    rate = set_poisson_arrivals(args, jobs, capacity_jobs_per_s)

    print(hardware_line())
    print(f"model: {llms['fcfs'].engine.model_config.architecture}, max_num_seqs "
          f"{args.max_num_seqs}; clock: simulated, step = {c0 * 1e3:.2f} ms + "
          f"{c1 * 1e6:.1f} us x scheduled tokens (calibrated here) + exposed swap copy time")
    print(workload_line(args, jobs, rate))
    mlfq_cfg = llms["mlfq"].engine.scheduler.waiting.config
    swapper = llms["mlfq"].engine.scheduler.swapper
    print(f"preemption mode: {args.preemption_mode}"
          f"{f' ({swapper.copier.mode} copies)' if swapper is not None else ''}; "
          f"{mlfq_line(mlfq_cfg)}")

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
    load = "offline burst" if args.workload == "head-of-line" else f"load {args.load}"
    print(f"SUMMARY sched ({args.workload}, simulated clock): mlfq vs fcfs at {load}: "
          f"mean JCT {s['mean_jct']:.2f}x lower, "
          f"mean TTFT {s['mean_ttft']:.2f}x lower, p99 JCT {s['p99_jct']:.2f}x, longest-5% JCT "
          f"{s['mean_jct_longest5']:.2f}x (below 1 = mlfq loses), throughput ratio "
          f"{1 / s['throughput']:.2f} (mlfq/fcfs), preemptions {stats['mlfq']['preemptions']}, "
          f"swaps {stats['mlfq']['swaps']}")

# ---- real clock ------------------------------------------------------------------------------
REAL_POLICIES = ("fcfs", "mlfq", "priority")


def replay_real_clock(llm: LLM, jobs: list[Job], use_priority: bool
                      ) -> tuple[list[JobResult], float, int, list[list[int]]]:
    """Add each job once ``time.perf_counter`` passes its arrival (head-of-line: all before the
    first step) and step until all finish. Returns (results in job order, wall seconds from the
    first arrival to the last finish, model steps, output token ids in job order). Times come
    from ``RequestOutput.metrics`` (``time.monotonic``), relative to each job's arrival."""
    engine = llm.engine
    results: dict[str, JobResult] = {}
    tokens: dict[str, list[int]] = {}
    steps_before, next_job = engine.num_model_steps_total, 0
    start = time.perf_counter()
    while len(results) < len(jobs):
        now = time.perf_counter() - start
        if not engine.has_unfinished_requests() and jobs[next_job].arrival > now:
            time.sleep(jobs[next_job].arrival - now)           # idle until the next arrival
            now = time.perf_counter() - start
        while next_job < len(jobs) and jobs[next_job].arrival <= now:
            job = jobs[next_job]
            engine.add_request(str(next_job), job.prompt_token_ids,
                               SamplingParams(temperature=0.0, max_tokens=job.output_len,
                                              ignore_eos=True),
                               priority=job.output_len if use_priority else 0)
            next_job += 1
        for out in engine.step():
            if out.finished:
                m = out.metrics
                job = jobs[int(out.request_id)]
                results[out.request_id] = JobResult(
                    0.0, job.output_len, m.first_token_time - m.arrival_time,
                    m.finished_time - m.arrival_time, m.num_preemptions, m.num_swaps)
                tokens[out.request_id] = list(out.outputs[0].token_ids)
    wall = time.perf_counter() - start
    model_steps = engine.num_model_steps_total - steps_before
    engine.check_integrity()
    assert engine.num_free_blocks == engine.runner.num_blocks, "leaked KV blocks"
    order = [str(i) for i in range(len(jobs))]
    return [results[i] for i in order], wall, model_steps, [tokens[i] for i in order]


def main_real_clock(args) -> None:
    workloads = [args.workload] if args.workload else ["head-of-line", "pareto"]
    print(hardware_line())
    results = {}
    for workload in workloads:
        run_args = argparse.Namespace(**{**vars(args), "workload": workload,
                                         "max_num_seqs": workload_max_num_seqs(args, workload)})
        results[workload] = real_clock_workload(run_args)
    if args.json:
        write_json(args.json, {"args": vars(args), "workloads": results})
    parts = []
    for workload, r in results.items():
        f, m, pr = (r["stats"][p] for p in REAL_POLICIES)
        load = "offline burst" if workload == "head-of-line" else f"load {args.load}"
        parts.append(
            f"{workload} ({load}): mean JCT {f['mean_jct'] / m['mean_jct']:.2f}x lower "
            f"({f['mean_jct']:.2f} -> {m['mean_jct']:.2f} s), short jobs' mean JCT "
            f"{f['mean_jct_short50'] / m['mean_jct_short50']:.2f}x lower, mean TTFT "
            f"{f['mean_ttft'] / m['mean_ttft']:.2f}x lower, p99 JCT "
            f"{f['p99_jct'] / m['p99_jct']:.2f}x, wall {m['wall_s'] / f['wall_s']:.3f} of fcfs, "
            f"{m['preemptions']:.0f} preemptions, priority (SJF oracle) mean JCT "
            f"{f['mean_jct'] / pr['mean_jct']:.2f}x lower, outputs "
            f"{'identical' if not r['diverged_jobs'] else 'DIFFER in %d jobs' % r['diverged_jobs']}")
    print(f"SUMMARY sched (real clock, {hardware_line()}, preemption {args.preemption_mode}): "
          f"mlfq vs fcfs: " + "; ".join(parts))


def real_clock_workload(args) -> dict:
    """fcfs, mlfq and priority in turn for ``--rounds`` rounds on one workload; prints its
    table and returns the per-round runs, the means and how many jobs' outputs differed."""
    llms, vocab, c0, c1 = build_engines(args, REAL_POLICIES)
    print(f"model: {llms['fcfs'].engine.model_config.architecture}, max_num_seqs "
          f"{args.max_num_seqs}; clock: real (time.perf_counter; JCT and TTFT from "
          f"RequestOutput.metrics), {args.rounds} round(s) of {', '.join(REAL_POLICIES)} in turn")
    print(f"preemption mode: {args.preemption_mode}; "
          f"{mlfq_line(llms['mlfq'].engine.scheduler.waiting.config)}; priority = the job's "
          f"output length (non-preemptive shortest-job-first that knows every length)")
    runs: dict[str, list[dict]] = {policy: [] for policy in REAL_POLICIES}
    diverged = 0
    for round_ in range(args.rounds):
        # fresh prompts each round: the engines' prefix caches hold the earlier rounds' ones
        round_args = argparse.Namespace(**{**vars(args), "seed": args.seed + round_})
        jobs = make_jobs(round_args, vocab)
        mean_out = float(np.mean([j.output_len for j in jobs]))
        rate = set_poisson_arrivals(
            round_args, jobs, args.max_num_seqs / ((c0 + c1 * args.max_num_seqs) * mean_out))
        print(workload_line(round_args, jobs, rate))
        reference = None
        for policy in REAL_POLICIES:
            results, wall, model_steps, tokens = replay_real_clock(
                llms[policy], jobs, use_priority=policy == "priority")
            stats = summarize(results, wall)
            stats.update(wall_s=wall, model_steps=model_steps)
            runs[policy].append(stats)
            if reference is None:
                reference = tokens
            differ = sum(a != b for a, b in zip(reference, tokens))
            diverged += differ
            print(f"round {round_ + 1} {policy}: mean JCT {stats['mean_jct']:.2f} s, wall "
                  f"{wall:.2f} s, {model_steps} model steps, {stats['preemptions']} preemptions"
                  f"{f', {differ} jobs output other tokens than fcfs' if differ else ''}",
                  flush=True)
    # per policy: the mean over rounds (the rounds alternate, so drift is shared)
    stats = {policy: {k: float(np.mean([r[k] for r in rs])) for k in rs[0]}
             for policy, rs in runs.items()}
    keys = ["mean_jct", "p99_jct", "mean_ttft", "p99_ttft", "mean_jct_short50",
            "mean_jct_longest5", "throughput", "wall_s", "model_steps", "preemptions"]
    rows = [[k, *(stats[p][k] for p in REAL_POLICIES),
             stats["fcfs"][k] / stats["mlfq"][k] if stats["mlfq"][k] else float("nan")]
            for k in keys]
    print(format_table([f"{args.workload} (real s; mean of rounds)", *REAL_POLICIES,
                        "fcfs/mlfq"], rows))
    print(f"outputs: {'identical to fcfs for every policy and round (greedy)' if not diverged else f'{diverged} job outputs differ from fcfs'}")
    for llm in llms.values():
        llm.engine.shutdown()
    return {"c0": c0, "c1": c1, "runs": runs, "stats": stats, "diverged_jobs": diverged}


if __name__ == "__main__":
    main()
