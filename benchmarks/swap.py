"""KV swap copies inline (sync) vs on the copy worker (async), with and without proactive
swap-in, under MLFQ churn; real wall time on this machine.

Workload: ``--num-requests`` requests with ``--prompt-len``-token prompts (distinct, prefix
caching off, so every swap moves a request's whole KV out and back) and ``--output-len``
greedy tokens; request i arrives before engine step ``i * --arrival-gap``. ``max_num_seqs`` 2
and MLFQ quanta small enough that every arrival takes the slot of a demoted running request:
its KV is swapped out to the host pool (``--tier disk``: memory-mapped files) and back in later.

Per mode: wall seconds of the whole replay, swaps, swap-ins (of which prefetched), the time
spent inside copies, the part the scheduling thread was blocked on them (exposed) and the part
hidden behind the forward (overlapped). All modes must produce the same tokens ("same").

    .venv/bin/python benchmarks/swap.py --threads 1             # ~3 minutes on 2 cores
    .venv/bin/python benchmarks/swap.py --threads 1 --tier disk
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.hardware import hardware_line  # noqa: E402
from benchmarks.report import format_table, write_json  # noqa: E402
from kvforge import LLM, SamplingParams  # noqa: E402

MODES = {                     # name -> engine options
    "sync": dict(swap_copy_mode="sync"),
    "async": dict(swap_copy_mode="async", swap_prefetch=False),
    "async+prefetch": dict(swap_copy_mode="async", swap_prefetch=True),
}


def replay(llm: LLM, prompts: list[list[int]], output_len: int,
           gap: int) -> tuple[dict, float, int]:
    """Returns ({request id: tokens}, wall seconds, steps)."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    tokens: dict[str, list[int]] = {}
    step = 0
    start = time.perf_counter()
    while len(tokens) < len(prompts):
        for i, prompt in enumerate(prompts):
            if i * gap == step:
                engine.add_request(str(i), prompt, params)
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = out.outputs[0].token_ids
        step += 1
    wall = time.perf_counter() - start
    engine.check_integrity()
    assert engine.num_free_blocks == engine.runner.num_blocks, "leaked KV blocks"
    return tokens, wall, step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="GGUF file or HF dir (default: SmolLM2-135M GGUF)")
    p.add_argument("--num-requests", type=int, default=6)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--arrival-gap", type=int, default=12, help="engine steps between arrivals")
    p.add_argument("--tier", default="host", choices=["host", "disk"])
    p.add_argument("--modes", default=",".join(MODES), help=f"subset of {','.join(MODES)}")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise SystemExit(f"unknown mode(s) {unknown}; known: {list(MODES)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = args.threads or torch.get_num_threads()

    rng = np.random.default_rng(args.seed)
    base = dict(scheduling_policy="mlfq", max_num_seqs=2, enable_prefix_caching=False,
                preemption_mode="swap", swap_host_blocks=0 if args.tier == "disk" else None,
                mlfq_quanta=(8, 32), mlfq_prefill_weight=0.01, num_threads=threads,
                max_model_len=args.prompt_len + args.output_len + 16)
    rows, results, reference = [], {}, None
    vocab = None
    for mode in modes:
        llm = LLM(args.model, **base, **MODES[mode])
        if vocab is None:
            vocab = llm.engine.model_config.vocab_size
            prompts = [[int(t) for t in rng.integers(100, vocab, args.prompt_len)]
                       for _ in range(args.num_requests)]
            llm.generate([prompts[0][:32]], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
        tokens, wall, steps = replay(llm, prompts, args.output_len, args.arrival_gap)
        reference = reference or tokens
        s = llm.engine.swap_stats
        results[mode] = {"wall_s": wall, "steps": steps, **vars(s)}
        rows.append([mode, wall, steps, s.num_swap_outs, s.num_swap_ins, s.num_prefetch_hits,
                     s.swapped_out_bytes / 1e6, s.copy_seconds, s.exposed_seconds,
                     s.overlapped_seconds, "yes" if tokens == reference else "NO"])
        del llm

    print(hardware_line())
    print(f"workload: {args.num_requests} requests x {args.prompt_len}-token prompts, "
          f"{args.output_len} greedy tokens, one every {args.arrival_gap} steps; mlfq quanta 8,32 "
          f"+ unbounded, max_num_seqs 2, prefix caching off, swap tier {args.tier}, "
          f"{threads} torch threads")
    print(format_table(["mode", "wall s", "steps", "swaps", "swap-ins", "prefetched", "MB out",
                        "copy s", "exposed s", "overlapped s", "same"], rows))
    if args.json:
        write_json(args.json, {"args": vars(args), "results": results})
    summary = ", ".join(f"{m} wall {results[m]['wall_s']:.2f}s exposed "
                        f"{results[m]['exposed_seconds']:.3f}s" for m in modes)
    print(f"SUMMARY swap ({args.tier}): {summary}; same tokens "
          f"{all(r[-1] == 'yes' for r in rows)}")


if __name__ == "__main__":
    main()
