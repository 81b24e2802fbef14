"""Prefix caching: the same shared-prefix workload with the cache off, on (FCFS) and on (LPM).

    python benchmarks/prefix.py                     # defaults finish in a few minutes on 2 cores
    python -m benchmarks.prefix --groups 4 --per-group 16 --json out.json

Workloads (random token ids, so no tokenizer or dataset is needed; greedy, EOS ignored):
  shared-prefix  ``--groups`` x ``--per-group`` requests; each group shares a ``--prefix-len``
                 system / few-shot prefix, each request adds ``--suffix-len`` own tokens
                 (default 450 + 50: the shared prefix is 90% of the prompt). Arrivals interleave
                 the groups (g0, g1, g0, g1, ...), all at t = 0 (offline batch).
  multi-turn     ``--conversations`` chats of ``--turns`` rounds; each round re-sends the whole
                 history (previous prompt + the model's reply) plus ``--turn-len`` new tokens.

Per configuration (a fresh engine each, so every run starts with a cold cache): prefix-cache hit
rate (hit tokens / queried tokens), mean TTFT (arrival -> first token, queueing included), and
throughput (prompt + output tokens / wall time). Ratios are against cache-off in the same run.
Ends with one ``SUMMARY prefix:`` line.
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

if __package__ in (None, ""):                       # run as a script: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import parse_engine_args, setup_threads
from benchmarks.hardware import hardware_line
from benchmarks.report import format_table, percent, write_json

CONFIGS = [("cache off", False, "fcfs"), ("cache on, fcfs", True, "fcfs"),
           ("cache on, lpm", True, "lpm")]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="GGUF file or HF dir (default: SmolLM2-135M)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--groups", type=int, default=2)
    p.add_argument("--per-group", type=int, default=8)
    p.add_argument("--prefix-len", type=int, default=450)
    p.add_argument("--suffix-len", type=int, default=50)
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--conversations", type=int, default=4)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--turn-len", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="extra kvforge LLM kwarg, e.g. num_kv_blocks=200")
    p.add_argument("--json", default=None, metavar="PATH")
    return p.parse_args(argv)


def shared_prefix_prompts(args, vocab: int) -> list[list[int]]:
    rng = random.Random(args.seed)
    tok = lambda n: [rng.randrange(100, vocab) for _ in range(n)]   # noqa: E731
    prefixes = [tok(args.prefix_len) for _ in range(args.groups)]
    return [prefixes[g] + tok(args.suffix_len)
            for _ in range(args.per_group) for g in range(args.groups)]   # interleaved groups


def run_config(args, enable: bool, policy: str, vocab_out: list) -> dict:
    from kvforge import LLM, SamplingParams
    kwargs = parse_engine_args(args.engine_arg)
    kwargs.setdefault("num_threads", args.threads)
    llm = LLM(args.model, enable_prefix_caching=enable, scheduling_policy=policy, **kwargs)
    vocab = llm.model_config.vocab_size
    vocab_out[:] = [vocab]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate([[7] * 32], params, use_tqdm=False)                 # warm-up, unrelated tokens
    stats0 = _stats(llm)

    prompts = shared_prefix_prompts(args, vocab)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    shared_s = time.perf_counter() - t0
    shared = _summary(outs, shared_s, _stats(llm), stats0)

    # the same kind of workload arriving one request at a time (a lightly loaded server): TTFT
    # is then the request's own prefill, without queueing behind the others
    args_seq = argparse.Namespace(**{**vars(args), "seed": args.seed + 7})
    stats_seq, seq_outs, t0 = _stats(llm), [], time.perf_counter()
    for prompt in shared_prefix_prompts(args_seq, vocab):
        seq_outs += llm.generate([prompt], params, use_tqdm=False)
    sequential = _summary(seq_outs, time.perf_counter() - t0, _stats(llm), stats_seq)

    rng = random.Random(args.seed + 1)
    histories = [[rng.randrange(100, vocab) for _ in range(args.turn_len)]
                 for _ in range(args.conversations)]
    stats1, all_outs, t0 = _stats(llm), [], time.perf_counter()
    for _ in range(args.turns):
        outs = llm.generate(histories, params, use_tqdm=False)
        all_outs += outs
        histories = [h + o.outputs[0].token_ids + [rng.randrange(100, vocab)
                                                   for _ in range(args.turn_len)]
                     for h, o in zip(histories, outs)]
    chat = _summary(all_outs, time.perf_counter() - t0, _stats(llm), stats1)
    llm.engine.check_integrity()
    return {"shared_prefix": shared, "shared_prefix_one_at_a_time": sequential,
            "multi_turn": chat}


def _stats(llm) -> tuple[int, int]:
    s = llm.engine.prefix_cache_stats
    return (s.query_tokens, s.hit_tokens) if s is not None else (0, 0)


def _summary(outs, seconds: float, stats, before) -> dict:
    ttfts = [o.metrics.first_token_time - o.metrics.arrival_time for o in outs]
    tokens = sum(len(o.prompt_token_ids) + len(o.outputs[0].token_ids) for o in outs)
    queried, hits = stats[0] - before[0], stats[1] - before[1]
    return {"requests": len(outs), "seconds": seconds, "mean_ttft_s": sum(ttfts) / len(ttfts),
            "tok_per_s": tokens / seconds, "hit_rate": hits / queried if queried else 0.0}


def main(argv=None) -> dict:
    args = parse_args(argv)
    args.threads = setup_threads(args.threads)
    vocab: list = []
    results = {name: run_config(args, enable, policy, vocab) for name, enable, policy in CONFIGS}
    print(hardware_line())
    prompt_len = args.prefix_len + args.suffix_len
    print(f"shared-prefix: {args.groups} groups x {args.per_group} requests, prompt {prompt_len} "
          f"tokens ({percent(args.prefix_len / prompt_len)} shared), {args.output_len} output; "
          f"multi-turn: {args.conversations} chats x {args.turns} turns (+{args.turn_len} tokens)")
    base = results["cache off"]
    summary = []
    for workload in ("shared_prefix", "shared_prefix_one_at_a_time", "multi_turn"):
        rows = []
        b = base[workload]
        for name, _, _ in CONFIGS:
            r = results[name][workload]
            rows.append([name, percent(r["hit_rate"]), r["mean_ttft_s"], r["tok_per_s"],
                         b["mean_ttft_s"] / r["mean_ttft_s"], r["tok_per_s"] / b["tok_per_s"]])
        print(f"\n{workload}")
        print(format_table(["config", "hit rate", "mean TTFT s", "tok/s", "TTFT off/x",
                            "tok/s x/off"], rows))
        on = results["cache on, fcfs"][workload]
        summary.append(f"{workload} TTFT {b['mean_ttft_s'] / on['mean_ttft_s']:.1f}x lower, "
                       f"throughput {on['tok_per_s'] / b['tok_per_s']:.1f}x "
                       f"(hit {percent(on['hit_rate'])}, lpm hit "
                       f"{percent(results['cache on, lpm'][workload]['hit_rate'])})")
    if args.json:
        write_json(args.json, {"args": vars(args), "results": results})
    print("\nSUMMARY prefix: cache on vs off: " + "; ".join(summary))
    return results


if __name__ == "__main__":
    main()
