"""Scheduling policies without a model: where MLFQ's mean JCT goes on ShareGPT-like traffic.

A queueing replay in decode steps: ``--max-num-seqs`` slots, each running job gets one token
per step (prefill and batch-size effects left out: the same for every policy), jobs arrive as
a Poisson process at ``--load`` of the slots' capacity, with the prompt and output lengths of
``benchmarks/sched_serve.py`` (ShareGPT, outputs capped at ``--max-output``). Policies:

- ``fcfs``: by arrival, never preempted;
- ``mlfq``: the engine's skip-join MLFQ rules (kvforge/sched/mlfq.py: its default quanta and
  prefill weight, preempted jobs to the front of their level, a job with at most the first
  quantum left never yields);
- ``srpt``: shortest remaining output first, preemptive: knows every length (a bound);
- ``gittins``: the Gittins index of attained service (the mean-JCT-optimal policy that does not
  know lengths, for a known length distribution), computed from the other seeds' lengths.

Per seed: mean JCT and mean TTFT of each policy as FCFS / policy (> 1: better than FCFS).
Runs in seconds; the real engine's numbers are ``benchmarks/sched_serve.py``'s.

    .venv/bin/python benchmarks/sched_sim.py --seeds 8
"""
from __future__ import annotations

import argparse
import itertools
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.report import format_table
from kvforge.bench.serving import arrival_delays
from kvforge.sched.mlfq import MLFQConfig

POLICIES = ("fcfs", "mlfq", "srpt", "gittins")


@dataclass
class Job:
    arrival: float        # in decode steps
    prompt: int
    output: int


def gittins_index(lengths: list[int], cap: int) -> list[float]:
    """Index of a job that has produced ``a`` tokens, for a = 0 .. cap - 1: the best, over
    horizons d, of P(it finishes within d more | not done) / E[steps it uses of those d]."""
    counts = [0] * (cap + 1)
    for n in lengths:
        counts[min(n, cap)] += 1
    index = []
    for a in range(cap):
        alive = sum(counts[a + 1:])
        if alive == 0:
            index.append(float("inf"))
            continue
        best = finished = used = 0.0
        left = alive
        for d in range(1, cap - a + 1):
            used += left / alive           # every job still going at d - 1 uses step d
            finished += counts[a + d] / alive
            left -= counts[a + d]
            best = max(best, finished / used)
        index.append(best)
    return index


def simulate(jobs: list[Job], policy: str, slots: int, index: list[float] | None = None,
             mlfq: MLFQConfig | None = None) -> tuple[float, float]:
    """(mean JCT, mean TTFT) in steps."""
    mlfq = mlfq or MLFQConfig()
    n = len(jobs)
    left = [j.output for j in jobs]
    done_tokens = [0] * n
    level = [mlfq.join_level(mlfq.prefill_weight * j.prompt) for j in jobs]
    work = [0.0] * n
    place = list(range(n))                 # position within the level (mlfq)
    front = -1
    first, finish = [None] * n, [None] * n
    waiting: list[int] = []
    running: list[int] = []
    arrived, step = 0, 0.0
    order = sorted(range(n), key=lambda i: jobs[i].arrival)
    next_place = n
    while arrived < n or waiting or running:
        while arrived < n and jobs[order[arrived]].arrival <= step:
            waiting.append(order[arrived])
            arrived += 1
        if not waiting and not running:
            step = jobs[order[arrived]].arrival
            continue
        if policy == "fcfs":
            waiting.sort(key=lambda i: jobs[i].arrival)
        elif policy in ("srpt", "gittins"):
            key = (lambda i: left[i]) if policy == "srpt" else \
                (lambda i: (-index[min(done_tokens[i], len(index) - 1)], jobs[i].arrival))
            pool = sorted(waiting + running, key=key)
            running, waiting = pool[:slots], pool[slots:]
        else:
            key = lambda i: (level[i], place[i])            # noqa: E731
            waiting.sort(key=key)
        while waiting and len(running) < slots:
            running.append(waiting.pop(0))
        if policy == "mlfq":
            while waiting:
                victim = max(running, key=key)
                candidate = waiting[0]
                if level[candidate] >= level[victim] or left[victim] <= mlfq.quanta[0]:
                    break
                running.remove(victim)
                running.append(waiting.pop(0))
                place[victim], front = front, front - 1
                waiting.append(victim)
                waiting.sort(key=key)
        for i in list(running):
            if first[i] is None:
                first[i] = step + 1
            left[i] -= 1
            done_tokens[i] += 1
            work[i] += 1
            if policy == "mlfq" and work[i] >= mlfq.quantum(level[i]):
                level[i], work[i] = level[i] + 1, 0.0
                place[i], next_place = next_place, next_place + 1
            if left[i] == 0:
                finish[i] = step + 1
                running.remove(i)
        step += 1
    return (statistics.mean(finish[i] - jobs[i].arrival for i in range(n)),
            statistics.mean(first[i] - jobs[i].arrival for i in range(n)))


def poisson_jobs(lengths: list[tuple[int, int]], load: float, slots: int, seed: int) -> list[Job]:
    """The jobs at the Poisson gaps ``kvforge bench serve``'s client draws for ``seed`` (the
    server benchmark's own arrivals), in decode steps: ``load`` of what ``slots`` serve."""
    rate = load * slots / statistics.mean(out for _, out in lengths)   # jobs per step
    arrivals = itertools.accumulate(arrival_delays(len(lengths), rate, 1.0, seed))
    return [Job(t, prompt, out) for t, (prompt, out) in zip(arrivals, lengths)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, default=8)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-prompt", type=int, default=256)
    p.add_argument("--max-output", type=int, default=512)
    p.add_argument("--max-num-seqs", type=int, default=4)
    p.add_argument("--load", type=float, default=0.9)
    args = p.parse_args(argv)
    from kvforge.bench.sharegpt import sample_sharegpt_requests
    from kvforge.loader.source import load_model_source
    encode = load_model_source(None).load_tokenizer().encode
    samples = {s: [(len(r.prompt_token_ids), r.output_len) for r in sample_sharegpt_requests(
        encode, args.num_prompts, seed=s, max_output_len=args.max_output,
        max_prompt_len=args.max_prompt)] for s in range(args.seeds)}
    rows, ratios = [], {p: [] for p in POLICIES[1:]}
    for seed, lengths in samples.items():
        others = [out for s, ls in samples.items() if s != seed for _, out in ls]
        index = gittins_index(others or [out for _, out in lengths], args.max_output)
        jobs = poisson_jobs(lengths, args.load, args.max_num_seqs, seed)
        result = {pol: simulate(jobs, pol, args.max_num_seqs, index) for pol in POLICIES}
        fcfs_jct, fcfs_ttft = result["fcfs"]
        row = [seed, fcfs_jct, fcfs_ttft]
        for pol in POLICIES[1:]:
            jct, ttft = result[pol]
            ratios[pol].append((fcfs_jct / jct, fcfs_ttft / max(ttft, 1e-9)))
            row += [fcfs_jct / jct, fcfs_ttft / max(ttft, 1e-9)]
        rows.append(row)
    print(f"ShareGPT, {args.num_prompts} jobs a seed, outputs <= {args.max_output}, "
          f"{args.max_num_seqs} slots, load {args.load}; FCFS / policy (> 1: better than FCFS)")
    headers = ["seed", "fcfs JCT steps", "fcfs TTFT steps"]
    for pol in POLICIES[1:]:
        headers += [f"{pol} JCT", f"{pol} TTFT"]
    print(format_table(headers, rows))
    print("SUMMARY sched_sim: " + " | ".join(
        f"{pol} mean JCT {min(j for j, _ in v):.2f}-{max(j for j, _ in v):.2f}x, "
        f"TTFT {min(t for _, t in v):.1f}-{max(t for _, t in v):.1f}x"
        for pol, v in ratios.items()) + " of FCFS")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
