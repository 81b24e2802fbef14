"""FP8 KV cache (``--kv-cache-dtype fp8_e4m3|fp8_e5m2``) against the fp32 cache, per model.

    python benchmarks/kv_fp8.py                                   # default model + Gemma 3
    python benchmarks/kv_fp8.py --models qwen2.5-coder-1.5b-instruct --contexts 32 2048

Per model and prompt length (``--contexts``: tokens of The Tempest), batch-1 greedy decode of
``--tokens`` tokens with each KV cache dtype, engines built once and run in alternation for
``--rounds`` rounds (the machine's memory speed drifts; medians are reported). The decode rate
excludes the prompt (time for tokens + 1 minus time for 1). Per dtype also: KV bytes per token,
the tokens a 256 MiB pool holds, and the quality cost against the fp32 cache -- greedy tokens
equal to fp32's (the first differing position) and the mean absolute gap of the chosen tokens'
logprobs over the positions before it.

First, the attention alone (``--attention-contexts``): the compiled decode attention of one
SmolLM2-shaped layer (9 query heads, 3 KV heads, 64 dims, blocks of 16) over 30 layers' worth of
distinct caches (so they stream from memory), fp32 vs fp8 planes, best of 7 alternated reps.

Ends with one ``SUMMARY kv_fp8:`` line (decode rate fp8 / fp32 per model at the longest
context).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):                       # run as a script: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import setup_threads
from benchmarks.hardware import hardware_line
from benchmarks.report import format_table

DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2")
POOL = "256MiB"


def _decode(llm, prompt: list[int], tokens: int):
    """(decode seconds for ``tokens`` after the first, the output of the long run)."""
    from kvforge import SamplingParams

    def run(n: int):
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=1)
        start = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        return time.perf_counter() - start, out[0].outputs[0]

    first, _ = run(1)
    whole, out = run(tokens + 1)
    return max(whole - first, 1e-9), out


def _quality(out, ref) -> tuple[str, str]:
    """(same tokens as fp32, or the first position that differs; mean |logprob gap| before it)."""
    n = next((i for i, (a, b) in enumerate(zip(out.token_ids, ref.token_ids)) if a != b),
             len(ref.token_ids))
    gaps = [abs(a[t] - b[t]) for a, b, t in zip(out.logprobs[:n], ref.logprobs[:n],
                                               out.token_ids[:n])]
    same = "yes" if n == len(ref.token_ids) else f"to token {n}"
    return same, f"{statistics.fmean(gaps):.4f}" if gaps else "-"


def attention_rows(contexts: list[int], batches: list[int]) -> list[list]:
    """ms per layer of the compiled decode attention, fp32 vs fp8 planes (None: no kernels)."""
    import torch
    from kvforge.kernels import cpu_kernels
    ops = cpu_kernels()
    if ops is None:
        return []
    gen = torch.Generator().manual_seed(0)
    block, kv_heads, dim, heads, layers = 16, 3, 64, 9, 30
    rows = []
    for context in contexts:
        for batch in batches:
            num_blocks = batch * (context // block + 1)
            planes = {"fp32": [(torch.randn(num_blocks, block, kv_heads, dim, generator=gen),
                                torch.randn(num_blocks, block, kv_heads, dim, generator=gen))
                               for _ in range(layers)]}
            for name, dtype in (("e4m3", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2)):
                planes[name] = [(k.to(dtype), v.to(dtype)) for k, v in planes["fp32"]]
            q = torch.randn(batch, heads, dim, generator=gen)
            tables = torch.randperm(num_blocks, generator=gen).view(batch, -1)
            lens = torch.full((batch,), context, dtype=torch.long)
            best = {}
            for _ in range(7):
                for name, layer_planes in planes.items():
                    start = time.perf_counter()
                    for k, v in layer_planes:
                        ops.paged_decode_attention(q, k, v, tables, lens, 0.125, 0)
                    best[name] = min(best.get(name, 1e9),
                                     (time.perf_counter() - start) / layers * 1e3)
            rows.append([context, batch] + [f"{best[n]:.3f}" for n in planes]
                        + [f"{best['fp32'] / best[n]:.2f}x" for n in ("e4m3", "e5m2")])
    return rows


def bench_model(name: str, contexts: list[int], tokens: int, rounds: int, threads: int):
    from kvforge import LLM
    from kvforge.eval.corpus import shakespeare_text
    from kvforge.loader.catalog import resolve_model

    path = resolve_model(name)
    llms = {d: LLM(path, num_threads=threads, kv_cache_memory=POOL, kv_cache_dtype=d,
                   enable_prefix_caching=False, max_model_len=max(contexts) + tokens + 8)
            for d in DTYPES}
    ids = llms["auto"].tokenizer.encode(shakespeare_text())
    for llm in llms.values():                     # first calls: kernel plans, tuning, packing
        _decode(llm, ids[:64], 8)
    rows, ratios = [], {}
    for context in contexts:
        prompt = ids[1000:1000 + context]
        times = {d: [] for d in DTYPES}
        outs = {}
        for _ in range(rounds):
            for d in DTYPES:
                seconds, outs[d] = _decode(llms[d], prompt, tokens)
                times[d].append(seconds)
        rate = {d: tokens / statistics.median(times[d]) for d in DTYPES}
        for d in DTYPES:
            runner = llms[d].engine.runner
            same, gap = _quality(outs[d], outs["auto"]) if d != "auto" else ("-", "-")
            stack = runner.model.decode_stack() is not None
            rows.append([Path(path).name, context, "fp32" if d == "auto" else d,
                         runner.kv_bytes_per_token, runner.num_blocks * runner.block_size,
                         f"{rate[d]:.1f}", f"{rate[d] / rate['auto']:.2f}x",
                         "yes" if stack else "no", same, gap])
        ratios[name] = {d: rate[d] / rate["auto"] for d in DTYPES if d != "auto"}
    return rows, ratios


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["smollm2-135m-instruct", "gemma-3-270m"])
    parser.add_argument("--contexts", nargs="+", type=int, default=[32, 1024])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--attention-contexts", nargs="*", type=int, default=[1024, 4096])
    args = parser.parse_args(argv)
    threads = setup_threads(args.threads)
    attention = attention_rows(args.attention_contexts, [1, 8])
    if attention:
        print(format_table(["context", "batch", "fp32 ms / layer", "e4m3 ms", "e5m2 ms",
                            "e4m3 speed-up", "e5m2 speed-up"], attention))
    rows, ratios = [], {}
    for name in args.models:
        r, q = bench_model(name, args.contexts, args.tokens, args.rounds, threads)
        rows += r
        ratios.update(q)
    print(format_table(["file", "context", "KV", "KV bytes/token", "pool tokens", "decode tok/s",
                        "vs fp32", "decode stack", "same tokens", "|logprob gap|"], rows))
    summary = "; ".join(f"{m} e4m3 {q['fp8_e4m3']:.2f}x e5m2 {q['fp8_e5m2']:.2f}x"
                        for m, q in ratios.items())
    print(f"SUMMARY kv_fp8: batch-1 decode at {max(args.contexts)} tokens of context vs the fp32 "
          f"cache: {summary} ({hardware_line()})")


if __name__ == "__main__":
    main()
