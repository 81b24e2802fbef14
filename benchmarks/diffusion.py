"""Masked-diffusion decoding: vanilla vs Fast-dLLM threshold vs threshold + prefix / dual cache.

    python benchmarks/diffusion.py                      # the `kvforge train-diffusion` model
    python benchmarks/diffusion.py --thresholds 0.9 0.7 --num-prompts 8 --json out.json

Prompts: ``--prompt-bytes`` of held-out text (the last 5% of The Tempest and of the ShareGPT
answers, which training never saw), half from each. Each setting generates ``--max-tokens``
greedily per prompt at batch 1 through ``LLM.generate`` (blocks of ``--block-length``):
  vanilla        one token per step, no cache (LLaDA's loop with steps = length)
  τ              Fast-dLLM threshold commits, no cache
  τ + prefix     ... with the prefix K/V cached, refreshed at each block
  τ + dual       ... with prefix and suffix K/V cached, refreshed at each block
Reported: generated tokens/s and speed-up over vanilla, model forwards per generated token,
quality: NLL per token of the generated text (prompt as context) under the default
autoregressive model (SmolLM2-135M, fp32), its change from vanilla, and the fraction of
positions equal to vanilla's. Ends with one ``SUMMARY diffusion:`` line.
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
from benchmarks.report import format_table, write_json


def held_out_prompts(count: int, size: int) -> list[str]:
    """``count`` prompts of ``size`` bytes, evenly spaced through the held-out text."""
    from kvforge.diffusion.train import HELD_OUT
    from kvforge.eval.corpus import shakespeare_text, sharegpt_text
    prompts = []
    texts = (shakespeare_text(), sharegpt_text(max_chars=1_000_000))
    for i, text in enumerate(texts):
        data = text.encode("utf-8")
        held = data[int(len(data) * (1 - HELD_OUT)):]
        n = count // 2 + (count % 2 if i == 0 else 0)
        step = (len(held) - size) // max(n, 1)
        for k in range(n):
            piece = held[k * step:k * step + size]
            prompts.append(piece.decode("utf-8", errors="ignore"))
    return prompts


class ARScorer:
    """NLL of a continuation under the default autoregressive model: the text's tokens after
    the prompt's, scored with the prompt as context."""

    def __init__(self) -> None:
        from kvforge.loader.source import load_model_source
        from kvforge.quant.loading import load_model
        source = load_model_source(None)
        self.model = load_model(source, quantization="none").eval()
        self.tokenizer = source.load_tokenizer()

    def nll(self, prompt: str, continuation: str) -> tuple[float, int]:
        from kvforge.eval.perplexity import window_nll
        context = self.tokenizer.encode(prompt, add_special_tokens=False)
        ids = context + self.tokenizer.encode(continuation, add_special_tokens=False)
        total, _ = window_nll(self.model, ids)
        before, _ = window_nll(self.model, context) if len(context) > 1 else (0.0, 0)
        return total - before, len(ids) - len(context)


def settings(thresholds: list[float]) -> list[tuple[str, dict]]:
    rows = [("vanilla", {})]
    for tau in thresholds:
        rows += [(f"τ={tau}", dict(parallel_threshold=tau)),
                 (f"τ={tau} + prefix", dict(parallel_threshold=tau, diffusion_cache="prefix")),
                 (f"τ={tau} + dual", dict(parallel_threshold=tau, diffusion_cache="dual"))]
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-diffusion")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--prompt-bytes", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--block-length", type=int, default=32)
    p.add_argument("--thresholds", type=float, nargs="+", default=[0.9])
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", default=None, metavar="PATH")
    args = p.parse_args(argv)
    threads = setup_threads(args.threads)
    from kvforge import LLM, SamplingParams
    llm = LLM(args.model, num_threads=threads)
    prompts = held_out_prompts(args.num_prompts, args.prompt_bytes)
    prompt_ids = [llm.tokenizer.encode(t, add_special_tokens=False) for t in prompts]
    base = dict(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True,
                diffusion_block_length=args.block_length)
    llm.generate(prompt_ids[:1], SamplingParams(**base, parallel_threshold=0.9), use_tqdm=False)
    results = {}
    for name, extra in settings(args.thresholds):
        params = SamplingParams(**base, **extra)
        before = llm.engine.stats.forwards
        texts, ids, seconds = [], [], 0.0
        for prompt in prompt_ids:                         # batch 1, as Fast-dLLM measures
            t0 = time.perf_counter()
            out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
            seconds += time.perf_counter() - t0
            texts.append(out.text)
            ids.append(out.token_ids)
        tokens = sum(len(t) for t in ids)
        results[name] = dict(seconds=seconds, tokens=tokens, texts=texts, ids=ids,
                             forwards=llm.engine.stats.forwards - before)
        print(f"{name}: {tokens / seconds:.1f} tok/s", flush=True)
    del llm
    scorer = ARScorer()
    vanilla = results["vanilla"]
    for r in results.values():
        nll = [scorer.nll(pr, t) for pr, t in zip(prompts, r["texts"])]
        r["nll"] = sum(n for n, _ in nll) / sum(c for _, c in nll)
        same = sum(a == b for x, y in zip(r["ids"], vanilla["ids"]) for a, b in zip(x, y))
        r["agreement"] = same / vanilla["tokens"]
        r["tok_s"] = r["tokens"] / r["seconds"]
    rows, summary = [], []
    for name, r in results.items():
        speedup = r["tok_s"] / vanilla["tok_s"]
        nll_change = r["nll"] / vanilla["nll"] - 1
        rows.append([name, round(r["tok_s"], 1), f"{speedup:.2f}x",
                     round(r["forwards"] / r["tokens"], 3), round(r["nll"], 3),
                     f"{nll_change:+.1%}", f"{r['agreement']:.1%}"])
        if name != "vanilla":
            summary.append(f"{name} {speedup:.2f}x nll {nll_change:+.1%}")
    print(hardware_line())
    print(f"model {args.model}; {len(prompts)} held-out prompts of {args.prompt_bytes} bytes, "
          f"{args.max_tokens} tokens each, blocks of {args.block_length}, greedy, batch 1, "
          f"{threads} threads")
    print(format_table(["setting", "tok/s", "speed-up", "forwards/tok", "AR NLL/tok",
                        "NLL vs vanilla", "agree w/ vanilla"], rows))
    print(f"sample (vanilla): {prompts[0]!r} -> {vanilla['texts'][0]!r}")
    last = list(results)[-1]
    print(f"sample ({last}): {results[last]['texts'][0]!r}")
    print("SUMMARY diffusion: " + "; ".join(summary))
    if args.json:
        write_json(args.json, {"rows": rows, "hardware": hardware_line(),
                               "settings": {k: {f: v for f, v in r.items() if f != "ids"}
                                            for k, r in results.items()}})


if __name__ == "__main__":
    main()
