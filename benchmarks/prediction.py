"""Predicted Outputs (OpenAI's ``prediction``) with n-gram speculation: batch-1 decode speed
when the client predicts the output, against the same engine without a prediction and
without speculation, alternated in one process.

    python benchmarks/prediction.py                        # default model, 4 ShareGPT chats
    python benchmarks/prediction.py --model qwen2.5-coder-1.5b-instruct --max-tokens 128

Per ShareGPT prompt the "off" run's answer is the reference. Predictions: ``exact`` (that
answer: a client regenerating a known reply, the best case) and ``edited`` (the answer with
every 8th word replaced, as when a client predicts the text an edit mostly keeps). Every run's
tokens must equal the reference (the prediction is a hint; the output never changes). Prefix
caching is off in both engines: a native GGUF prompt rounds differently as one prefill than
as a cache hit's short tail (docs/gguf_native.md), which would move the reference itself.
Ends with one ``SUMMARY prediction:`` line with the hardware.
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
from kvforge.bench.sharegpt import sample_sharegpt_requests


def _edited(text: str, every: int = 8) -> str:
    words = text.split(" ")
    return " ".join("banana" if i % every == every - 1 else w for i, w in enumerate(words))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--num-speculative-tokens", type=int, default=5)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    setup_threads(args.threads)
    from kvforge import LLM, SamplingParams
    kw = {"enable_prefix_caching": False}
    if args.model is not None:
        kw["model"] = args.model
    off = LLM(**kw)
    spec = LLM(speculative_method="ngram", num_speculative_tokens=args.num_speculative_tokens,
               **kw)
    tok = off.tokenizer

    def chat(text: str) -> list[int]:
        if tok.chat_template is None:
            return tok.encode(text + "\n\n")
        return tok.apply_chat_template([{"role": "user", "content": text}])

    reqs = sample_sharegpt_requests(lambda t: tok.encode(t, add_special_tokens=False),
                                    args.num_prompts, seed=0, max_prompt_len=384)
    prompts = [chat(r.prompt) for r in reqs]
    base = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)

    def run(llm, prompt, prediction=None):
        params = base if prediction is None else SamplingParams(
            temperature=0.0, max_tokens=args.max_tokens, prediction=prediction)
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        o = out.outputs[0]
        decode_s = out.metrics.finished_time - out.metrics.first_token_time
        return o.token_ids, (len(o.token_ids) - 1) / max(decode_s, 1e-9)

    refs = [run(off, pr)[0] for pr in prompts]                 # warm-up and reference
    methods = ["off", "ngram", "ngram + prediction (exact)", "ngram + prediction (edited)"]
    rates: dict[str, list[float]] = {m: [] for m in methods}
    same = {m: True for m in methods}
    for _ in range(args.reps):
        for pr, ref in zip(prompts, refs):
            text = tok.decode(ref)
            for m in methods:                                  # alternated per prompt
                llm = off if m == "off" else spec
                pred = (text if "exact" in m else _edited(text) if "edited" in m else None)
                ids, rate = run(llm, pr, pred)
                rates[m].append(rate)
                same[m] &= ids == ref
    med = {m: statistics.median(v) for m, v in rates.items()}
    rows = [[m, med[m], f"{med[m] / med['off']:.2f}x", "yes" if same[m] else "NO"]
            for m in methods]
    print(format_table(["method", "decode tok/s (median)", "vs off", "same tokens"], rows))
    print(hardware_line())
    print("SUMMARY prediction: " + ", ".join(f"{m} {med[m] / med['off']:.2f}x"
                                             for m in methods[1:])
          + f" (decode tok/s vs off; {args.num_prompts} prompts x {args.max_tokens} tokens, "
            f"{args.reps} reps; same tokens: {'yes' if all(same.values()) else 'NO'}) | "
          + hardware_line())


if __name__ == "__main__":
    t0 = time.perf_counter()
    main()
    print(f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
