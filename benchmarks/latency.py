"""Batch-1 decode latency (ms per output token) of kvforge and HF, against the memory bound.

    python benchmarks/latency.py                         # defaults: under a few minutes
    python -m benchmarks.latency --output-len 32 --reps 2 --skip-hf

One request of ``--prompt-len`` tokens (a fixed English text, repeated to length) is run with
1 output token (prefill + first sample) and right after with 1 + ``--output-len`` output
tokens, greedy with EOS ignored; decode ms/token = difference / output-len, so prefill is
subtracted out. ``--reps`` such pairs per system after a warm-up.

Memory-bandwidth bound, measured in the same process with the same ``--threads``:
  bytes per decode token = 4 * (every matmul weight incl. the LM head + RMSNorm weights + one
                           embedding row) + fp32 K/V of the average context (prompt + half the
                           output), i.e. what one batch-1 step must stream from memory
  read bandwidth         = repeated ``t.sum()`` over a ``--bandwidth-gib`` fp32 tensor (in huge
                           pages when the machine grants them, like kvforge's weights), one
                           sample of ``--bandwidth-sample-s`` (1 s, about one timed run) before
                           the first rep and after every rep
  bound                  = bytes / bandwidth  (ms/token no fp32 implementation can beat)

Paired, because this VM's read bandwidth flips between ~30 and ~50-60 GB/s over seconds: each rep
is held against the mean of the two samples around it (the bandwidth while it ran), and
"% of bound" is the median over reps of bound / measured (100% = running at memory speed).
Decode ms/token is the median over reps. The table also lists the best and worst rep.

Other flags: --model, --threads (default physical cores), --skip-hf, --skip-kvforge,
--engine-arg KEY=VALUE, --json PATH. Ends with one ``SUMMARY latency:`` line.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):                       # run as a script: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import add_common_args, build_systems, model_config_of, setup_threads
from benchmarks.hardware import ReadBandwidthSampler, hardware_line
from benchmarks.model_cost import ModelShape
from benchmarks.report import format_table, percent, write_json
from benchmarks.workload import synthetic_requests

_PROMPT_TEXT = ("Write a short story about a lighthouse keeper who finds a message in a bottle. "
                "The story should be warm, a little mysterious, and end with a surprise.")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--bandwidth-gib", type=float, default=1.0)
    p.add_argument("--bandwidth-sample-s", type=float, default=1.0,
                   help="seconds per bandwidth sample (about one timed decode run)")
    add_common_args(p)
    return p.parse_args(argv)


def timed_generate(system, requests) -> float:
    t0 = time.perf_counter()
    system.generate(requests)
    return time.perf_counter() - t0


def measure_system(system, prompt_ids: list[int], output_len: int, reps: int,
                   sample_bandwidth, bytes_per_token: float) -> dict:
    """``reps`` (prefill + 1 token, prefill + 1 + output_len tokens) pairs, each held against
    the bandwidth sampled just before and just after it."""
    first = synthetic_requests(prompt_ids, 1, len(prompt_ids), 1)
    full = synthetic_requests(prompt_ids, 1, len(prompt_ids), 1 + output_len)
    system.generate(full)                              # warm-up
    before = sample_bandwidth()
    runs = []
    for _ in range(reps):
        t_first = timed_generate(system, first)
        t_full = timed_generate(system, full)
        after = sample_bandwidth()
        decode_ms = (t_full - t_first) / output_len * 1e3
        bandwidth = (before + after) / 2
        bound_ms = bytes_per_token / bandwidth * 1e3
        runs.append({"prefill_s": t_first, "decode_ms_per_token": decode_ms,
                     "bandwidth_bytes_per_s": bandwidth, "bound_ms_per_token": bound_ms,
                     "fraction_of_bound": bound_ms / decode_ms if decode_ms > 0 else 0.0})
        before = after
    fractions = [r["fraction_of_bound"] for r in runs]
    return {"system": system.name, "prefill_s": min(r["prefill_s"] for r in runs),
            "decode_ms_per_token": statistics.median(r["decode_ms_per_token"] for r in runs),
            "bandwidth_bytes_per_s": statistics.median(r["bandwidth_bytes_per_s"] for r in runs),
            "bound_ms_per_token": statistics.median(r["bound_ms_per_token"] for r in runs),
            "fraction_of_bound": statistics.median(fractions),
            "fraction_of_bound_min": min(fractions), "fraction_of_bound_max": max(fractions),
            "runs": runs}


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.prompt_len < 1 or args.output_len < 1 or args.reps < 1:
        raise SystemExit("--prompt-len, --output-len and --reps must be >= 1")
    threads = setup_threads(args.threads)
    sampler = ReadBandwidthSampler(int(args.bandwidth_gib * (1 << 30)), args.bandwidth_sample_s)
    kv, hf, encode = build_systems(args, hf_batch_size=1)
    shape = ModelShape.from_config(model_config_of(kv, hf))
    prompt_ids = synthetic_requests(encode(_PROMPT_TEXT), 1, args.prompt_len, 1)[0].prompt_token_ids

    avg_context = args.prompt_len + args.output_len // 2
    bytes_per_token = shape.decode_bytes_per_token(avg_context)

    rows = [measure_system(s, prompt_ids, args.output_len, args.reps, sampler.sample,
                           bytes_per_token) for s in (kv, hf) if s is not None]
    bandwidth = statistics.median(r["bandwidth_bytes_per_s"] for r in rows)
    bound_ms = bytes_per_token / bandwidth * 1e3

    print(format_table(["system", "prefill+1st ms", "decode ms/token", "tok/s", "read GB/s",
                        "% of mem bound", "worst..best rep"],
                       [[r["system"], r["prefill_s"] * 1e3, r["decode_ms_per_token"],
                         1e3 / r["decode_ms_per_token"] if r["decode_ms_per_token"] > 0 else float("nan"),
                         r["bandwidth_bytes_per_s"] / 1e9, percent(r["fraction_of_bound"]),
                         f"{percent(r['fraction_of_bound_min'])}..{percent(r['fraction_of_bound_max'])}"]
                        for r in rows]
                       + [["memory bound", "", bound_ms, 1e3 / bound_ms, bandwidth / 1e9,
                           "100.0%", ""]]))
    print()
    print(hardware_line())
    print(f"read bandwidth: t.sum over {args.bandwidth_gib:g} GiB fp32 "
          f"({'2 MiB' if sampler.huge_pages else '4 KiB'} pages), samples of "
          f"{args.bandwidth_sample_s:g} s around each rep (median {bandwidth / 1e9:.1f} GB/s); "
          f"bytes per decode token {bytes_per_token / 1e6:.1f} MB (weights + KV of {avg_context} "
          f"tokens); % of bound: median over {args.reps} reps of each rep against its own samples")

    by_name = {r["system"]: r for r in rows}
    k = by_name.get(kv.name) if kv else None
    h = by_name.get(hf.name) if hf else None
    parts = []
    if k:
        parts.append(f"kvforge {k['decode_ms_per_token']:.2f} ms/tok")
    if h:
        parts.append(f"{'vs ' if k else ''}HF {h['decode_ms_per_token']:.2f} ms/tok")
    if k and h and k["decode_ms_per_token"] > 0:
        parts[-1] += f" ({h['decode_ms_per_token'] / k['decode_ms_per_token']:.2f}x kvforge speedup)"
    main_row = k or h
    summary = " ".join(parts) + (
        f", bound {main_row['bound_ms_per_token']:.2f} ms/tok "
        f"({main_row['system']} at {percent(main_row['fraction_of_bound'])} of bound, paired "
        f"median; reps {percent(main_row['fraction_of_bound_min'])}.."
        f"{percent(main_row['fraction_of_bound_max'])})")
    print(f"SUMMARY latency: {summary}")

    payload = {"args": vars(args), "threads": threads, "hardware": hardware_line(),
               "read_bandwidth_bytes_per_s": bandwidth, "bytes_per_decode_token": bytes_per_token,
               "bound_ms_per_token": bound_ms, "results": rows, "summary": summary}
    if args.json:
        write_json(args.json, payload)
    return payload


if __name__ == "__main__":
    main()
