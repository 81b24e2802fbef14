"""Lossy early exit: perplexity and layer computations skipped by threshold.

    python benchmarks/early_exit.py                          # 2,048 tokens of The Tempest, fp32
    python benchmarks/early_exit.py --thresholds 0.95 0.9 --quantization auto

Needs the heads of ``kvforge train-exit-heads`` for the model. Every position of each window
exits as a decode would (exit/forward.py: skipped layers get K/V from the exit stream), the
same windows as ``kvforge eval perplexity``; "skipped" = decoder-layer computations not run
(the K/V-only projections and exit-head checks are not layers; "checks/tok" counts the LM-head
products the confidence checks cost). Ends with one ``SUMMARY early_exit:`` line.
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


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--quantization", default="none")
    p.add_argument("--max-tokens", type=int, default=2048)
    p.add_argument("--thresholds", type=float, nargs="+", default=[0.99, 0.95, 0.9, 0.8, 0.6])
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    threads = setup_threads(args.threads)
    from kvforge.eval.corpus import load_corpus
    from kvforge.eval.perplexity import perplexity
    from kvforge.exit.model import EarlyExitLM
    from kvforge.exit.store import load_heads_for
    from kvforge.loader.source import load_model_source
    from kvforge.quant.loading import load_model
    source = load_model_source(args.model)
    model = load_model(source, quantization=args.quantization).eval()
    heads = load_heads_for(model, source.path)
    ids = source.load_tokenizer().encode(load_corpus("shakespeare"), add_special_tokens=False)
    t0 = time.perf_counter()
    base = perplexity(model, ids, max_tokens=args.max_tokens, progress=False).perplexity
    rows = [["off", round(base, 3), "-", "0.0%", "-", "-", round(time.perf_counter() - t0, 1)]]
    summary = []
    for threshold in args.thresholds:
        ee = EarlyExitLM(model, heads, threshold, exit_all_rows=True)
        t0 = time.perf_counter()
        ppl = perplexity(ee, ids, max_tokens=args.max_tokens, progress=False).perplexity
        s = ee.stats
        exits = " ".join(f"{e}:{n / s.rows:.0%}" for e, n in sorted(s.exits.items())) or "-"
        rows.append([threshold, round(ppl, 3), f"{ppl / base - 1:+.2%}",
                     f"{s.skipped_fraction:.1%}", exits, round(s.head_checks / s.rows, 2),
                     round(time.perf_counter() - t0, 1)])
        summary.append(f"P={threshold} ppl {ppl / base - 1:+.2%} skipped {s.skipped_fraction:.1%}")
        print(f"  P={threshold}: ppl {ppl:.3f}, skipped {s.skipped_fraction:.1%}", flush=True)
    print(f"heads after layers {heads.layers} of {model.num_layers}; {args.max_tokens} tokens of "
          f"The Tempest; quantization {args.quantization}")
    print(format_table(["threshold", "perplexity", "vs off", "layers skipped",
                        "exits (after layer: share)", "checks/tok", "seconds"], rows))
    print(hardware_line() + f" | threads {threads}")
    print("SUMMARY early_exit: " + ", ".join(summary))


if __name__ == "__main__":
    main()
