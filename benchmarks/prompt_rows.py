"""Same prompt, same answer: greedy output after a prefix-cache hit and in chunked-prefill pieces
against the whole prompt's, on a GGUF model with this machine's measured kernels.

    python benchmarks/prompt_rows.py                          # the default model, 8 chats
    python benchmarks/prompt_rows.py --models qwen2.5-coder-1.5b-instruct --prompts 4 \\
        --baseline ../kvforge-old                             # against another checkout's code

Per checkout, in a fresh process: ShareGPT first turns (chat template, greedy, ``--tokens``
tokens each) through one engine with the prefix cache off (the whole prompt in one step: the
reference), one with it on, run twice (the second run's prompt hits the cache: only its last
partial block is computed) and one that chunks prompts (``--chunk`` tokens a step). The table
gives, per engine, how many answers equal the reference token for token, the first differing
position of those that do not, and the median time to first token (arrival to first token, the
prefill of the whole prompt or of its uncached tail). ``--baseline DIR`` runs another checkout
the same way, alternating; one ``SUMMARY`` line.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

WORKER = r'''
import json, sys
sys.path.insert(0, {checkout!r})
from kvforge import LLM, SamplingParams
from kvforge.bench.sharegpt import sample_sharegpt_requests

def run(llm, prompts):
    params = SamplingParams(temperature=0.0, max_tokens={tokens}, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return ([o.outputs[0].token_ids for o in outs],
            [o.metrics.first_token_time - o.metrics.arrival_time for o in outs])

reference = LLM({model!r}, enable_prefix_caching=False)
tok = reference.engine.tokenizer
asked = sample_sharegpt_requests(tok.encode, {prompts}, max_prompt_len=600, seed=1)
prompts = [tok.apply_chat_template([{{"role": "user", "content": r.prompt}}],
                                   add_generation_prompt=True) for r in asked]
result = {{}}
# one prompt at a time: each is the only request of its steps, so only the split differs
result["whole"] = [run(reference, [p]) for p in prompts]
del reference
cached = LLM({model!r})
result["cold"] = [run(cached, [p]) for p in prompts]
result["prefix hit"] = [run(cached, [p]) for p in prompts]
del cached
chunked = LLM({model!r}, enable_prefix_caching=False, max_num_batched_tokens={chunk})
result["chunked"] = [run(chunked, [p]) for p in prompts]
print("RESULT" + json.dumps({{k: [[t[0][0], t[1][0]] for t in v] for k, v in result.items()}}))
'''


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y),
                None if len(a) == len(b) else min(len(a), len(b)))


def run_checkout(checkout: str, args) -> dict:
    code = WORKER.format(checkout=checkout, model=args.model, tokens=args.tokens,
                         prompts=args.prompts, chunk=args.chunk)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": checkout})
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT")]
    if not lines:
        raise RuntimeError(f"worker for {checkout} failed:\n{done.stderr[-3000:]}")
    return json.loads(lines[0][len("RESULT"):])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--chunk", type=int, default=64, help="chunked engine's tokens per step")
    p.add_argument("--baseline", default=None, help="another kvforge checkout to compare")
    p.add_argument("--rounds", type=int, default=1)
    args = p.parse_args(argv)
    from benchmarks.hardware import hardware_line
    from benchmarks.report import format_table
    checkouts = {"kvforge": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    if args.baseline:
        checkouts["baseline"] = os.path.abspath(args.baseline)
    runs: dict[str, list[dict]] = {name: [] for name in checkouts}
    for _ in range(args.rounds):
        for name, path in checkouts.items():
            runs[name].append(run_checkout(path, args))
    rows, summary = [], []
    for name, results in runs.items():
        first = results[0]
        reference = [tokens for tokens, _ in first["whole"]]
        for engine in ("whole", "cold", "prefix hit", "chunked"):
            tokens = [t for t, _ in first[engine]]
            diffs = [first_difference(a, b) for a, b in zip(reference, tokens)]
            same = sum(d is None for d in diffs)
            ttft = statistics.median(r[engine][i][1] for r in results
                                     for i in range(len(reference)))
            rows.append([name, engine, f"{same}/{len(reference)}",
                         ", ".join(str(d) for d in diffs if d is not None) or "-",
                         f"{ttft * 1000:.1f}"])
            if engine in ("prefix hit", "chunked"):
                summary.append(f"{name} {engine} {same}/{len(reference)}")
    print(format_table(["code", "engine", "answers = whole prompt's", "first differing token",
                        "median TTFT ms"], rows))
    print(f"SUMMARY prompt_rows: {args.model}, same greedy answer as the whole prompt: "
          f"{'; '.join(summary)} | {hardware_line()}")


if __name__ == "__main__":
    main()
