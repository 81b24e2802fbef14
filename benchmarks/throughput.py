"""Offline throughput: kvforge vs HF transformers ``generate`` on the same ShareGPT requests.

    python benchmarks/throughput.py                      # defaults: 32 prompts + decode run
    python -m benchmarks.throughput --num-prompts 16 --skip-hf --json out.json

Workload: ``--num-prompts`` ShareGPT conversations sampled with ``--seed``; prompt = first human
turn (at most ``--max-prompt-len`` tokens), target output = token count of the first gpt answer
capped at ``--max-output-len``. Every request is greedy with EOS ignored, so both systems do
exactly the same useful work on the same prompt token ids.

  kvforge   one ``LLM.generate`` call with all requests (continuous batching)
  HF        static batches of ``--hf-batch-size`` in arrival order, left padded, each batch
            runs to its longest target; only each request's own target counts as output

Also measured in the same process, same ``--threads`` (default: physical cores):
  fp32 GEMM peak    best of a few 2048^3 ``torch.mm``, before and after the runs
  MFU               useful FLOPs / elapsed / peak; FLOPs per request (P prompt, O output,
                    n = P + O - 1 positions): 2*W_layers*n + 2*W_head*O + 4*L*heads*hd*n(n+1)/2
  decode-heavy      ``--decode-batch`` requests (0 = skip) of ``--decode-prompt-len`` tokens,
                    timed with 1 and with ``--decode-output-len`` output tokens; the difference
                    is pure decode, giving decode tok/s and decode MFU

Other flags: --model, --skip-hf, --skip-kvforge, --engine-arg KEY=VALUE (kvforge LLM kwargs),
--json PATH. Ends with one ``SUMMARY throughput:`` line.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):                       # run as a script: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import add_common_args, build_systems, model_config_of, setup_threads
from benchmarks.hardware import hardware_line, measure_gemm_peak_flops
from benchmarks.model_cost import ModelShape
from benchmarks.report import format_table, percent, write_json
from benchmarks.systems import RunResult, timed_run
from benchmarks.workload import synthetic_requests
from kvforge.bench.sharegpt import BenchRequest, sample_sharegpt_requests

_DECODE_TEXT = ("The quick brown fox jumps over the lazy dog while the orchestra tunes its "
                "instruments, and a distant train carries letters, apples and stories north.")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--max-output-len", type=int, default=256)
    p.add_argument("--max-prompt-len", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hf-batch-size", type=int, default=16)
    p.add_argument("--decode-batch", type=int, default=64, help="0 skips the decode-heavy run")
    p.add_argument("--decode-prompt-len", type=int, default=16)
    p.add_argument("--decode-output-len", type=int, default=64)
    add_common_args(p)
    return p.parse_args(argv)


def decode_heavy(system, requests_1: list[BenchRequest], requests_n: list[BenchRequest],
                 shape: ModelShape) -> dict:
    """Time the same prompts with 1 and with n output tokens; the difference is decode only."""
    short = timed_run(system, requests_1)
    full = timed_run(system, requests_n)
    seconds = full.elapsed_s - short.elapsed_s
    flops = sum(shape.decode_flops(r.prompt_len, r.output_len) for r in requests_n)
    tokens = sum(r.output_len - 1 for r in requests_n)
    if seconds <= 0:
        print(f"WARNING: {system.name} decode-heavy run was not slower than its 1-token run "
              f"(timing noise); raise --decode-output-len or use a quieter machine")
    prompt_tokens = sum(r.prompt_len for r in requests_1)
    return {"system": system.name, "batch": len(requests_n), "decode_s": seconds,
            "decode_tokens": tokens, "decode_flops": flops,
            "decode_tok_per_s": tokens / seconds if seconds > 0 else None,
            "prefill_s": short.elapsed_s, "prefill_tok_per_s": prompt_tokens / short.elapsed_s}


def main(argv=None) -> dict:
    args = parse_args(argv)
    threads = setup_threads(args.threads)
    peak = measure_gemm_peak_flops()
    kv, hf, encode = build_systems(args, hf_batch_size=args.hf_batch_size)
    shape = ModelShape.from_config(model_config_of(kv, hf))
    systems = [s for s in (kv, hf) if s is not None]

    requests = sample_sharegpt_requests(encode, args.num_prompts, seed=args.seed,
                                        max_output_len=args.max_output_len,
                                        max_prompt_len=args.max_prompt_len)
    prompt_tokens = sum(r.prompt_len for r in requests)
    output_tokens = sum(r.output_len for r in requests)
    print(f"workload: {len(requests)} ShareGPT requests, {prompt_tokens} prompt + {output_tokens} "
          f"output tokens (mean {prompt_tokens / len(requests):.0f} / {output_tokens / len(requests):.0f})")

    warmup = synthetic_requests(encode(_DECODE_TEXT), 2, 8, 2)
    results: list[RunResult] = []
    for system in systems:
        system.generate(warmup)
        res = timed_run(system, requests, shape)
        print(f"  {system.name}: {res.elapsed_s:.1f} s")
        results.append(res)

    decode_rows = []
    if args.decode_batch > 0:
        base = encode(_DECODE_TEXT)
        reqs_1 = synthetic_requests(base, args.decode_batch, args.decode_prompt_len, 1)
        reqs_n = synthetic_requests(base, args.decode_batch, args.decode_prompt_len, args.decode_output_len)
        for system in systems:
            saved = getattr(system, "batch_size", None)
            if saved is not None:
                system.batch_size = args.decode_batch    # equal prompts: one HF batch, no padding
            decode_rows.append(decode_heavy(system, reqs_1, reqs_n, shape))
            if saved is not None:
                system.batch_size = saved

    # a shared machine drifts: measure the peak again and keep the better (conservative MFU)
    peak = max(peak, measure_gemm_peak_flops())

    print()
    print(format_table(["system", "requests/s", "output tok/s", "total tok/s", "MFU"],
                       [[r.system, r.requests_per_s, r.output_tok_per_s, r.total_tok_per_s,
                         percent(r.mfu(peak))] for r in results]))
    if decode_rows:
        print()
        print(f"decode-heavy: batch {args.decode_batch}, prompt {args.decode_prompt_len}, "
              f"{args.decode_output_len} output tokens (time of 1-token run subtracted)")
        print(format_table(["system", "decode tok/s", "decode MFU", "prefill tok/s (1-token run)"],
                           [[d["system"], d["decode_tok_per_s"] or "n/a",
                             percent(d["decode_flops"] / d["decode_s"] / peak) if d["decode_s"] > 0
                             else "n/a", d["prefill_tok_per_s"]] for d in decode_rows]))
    print()
    from kvforge.kernels.tune import describe, installed, machine_line
    print(f"kernels: {machine_line()}; fp32 projection plans per row range "
          f"({'tuned' if installed() else 'build defaults: untuned or not fp32'}):")
    for line in describe(list(installed().values())):
        print("  " + line)
    print(hardware_line())
    print(f"fp32 GEMM peak (2048^3 torch.mm, best of 5, before and after): {peak / 1e9:.1f} GFLOP/s; "
          f"matmul params {shape.matmul_params / 1e6:.1f} M "
          f"(layers {shape.layer_matmul_params / 1e6:.1f} M + LM head {shape.head_params / 1e6:.1f} M)")

    print("MFU = useful FLOPs / elapsed / peak; FLOPs per request (P prompt, O output tokens, "
          "n = P+O-1) = 2*W_layers*n + 2*W_head*O + 4*layers*heads*head_dim*n(n+1)/2")

    by_name = {r.system: r for r in results}
    kv_res = by_name.get(kv.name) if kv else None
    hf_res = by_name.get(hf.name) if hf else None
    decode_by_name = {d["system"]: d for d in decode_rows}
    parts = []
    if kv_res:
        parts.append(f"kvforge {kv_res.output_tok_per_s:.1f} out tok/s")
    if hf_res:
        parts.append(f"{'vs ' if kv_res else ''}HF {hf_res.output_tok_per_s:.1f}"
                     + ("" if kv_res else " out tok/s"))
    if kv_res and hf_res:
        ratio = kv_res.output_tok_per_s / hf_res.output_tok_per_s
        print(f"kvforge / HF: {ratio:.2f}x output tok/s, "
              f"{kv_res.total_tok_per_s / hf_res.total_tok_per_s:.2f}x total tok/s")
        parts[-1] += f" ({ratio:.2f}x)"
    main_res = kv_res or hf_res
    summary = " ".join(parts) + f", MFU {percent(main_res.mfu(peak))}"
    dec = decode_by_name.get(main_res.system)
    if dec and dec["decode_s"] > 0:
        summary += f", decode MFU {percent(dec['decode_flops'] / dec['decode_s'] / peak)}"
    print(f"SUMMARY throughput: {summary}")

    payload = {"args": vars(args), "threads": threads, "hardware": hardware_line(),
               "gemm_peak_flops": peak, "matmul_params": shape.matmul_params,
               "workload": {"num_requests": len(requests), "prompt_tokens": prompt_tokens,
                            "output_tokens": output_tokens},
               "results": [r.as_dict(peak) for r in results], "decode_heavy": decode_rows,
               "summary": summary}
    if args.json:
        write_json(args.json, payload)
    return payload


if __name__ == "__main__":
    main()
