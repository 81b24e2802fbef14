"""Speculative decoding: tokens/s with speculation off vs n-gram vs a draft model.

    python benchmarks/spec.py                         # defaults: ~6 minutes on 2 cores
    python benchmarks/spec.py --batch-sizes 1 4 8 --num-prompts 8 --num-speculative-tokens 6
    # a real pair: Qwen2.5-Coder 1.5B target, 0.5B draft (both GGUF Q4_K_M, run natively)
    python benchmarks/spec.py --model qwen2.5-coder-1.5b-instruct \
        --draft-model qwen2.5-coder-0.5b-instruct --workloads code --max-tokens 200 \
        --methods off ngram draft draft+ngram --batch-sizes 1

Workloads (greedy, EOS honoured, chat template applied, default model SmolLM2-135M-Instruct):
  chat   ShareGPT first human turns (``--num-prompts``, seed ``--seed``)
  copy   all 8 input-grounded edits written for this benchmark: code or text given in the prompt
         that the answer should mostly copy (rename a variable, add type hints, fix the
         indentation, reformat); the 135M model copies some and answers others in its own words
  code   3 coding chats: two edits of a given class (type hints, docstrings) and one new
         function; with batch b > 3 the prompts repeat to fill the batch
  edit   the two edits alone;  new  the new function alone (the issue's two targets)
  turns  2 two-turn code chats, run in order: the edit above, then the same chat with an
         answer and a follow-up request, whose prompt starts with the first turn's (a prefix
         cache hit for the target, and for the draft model where its KV is still there);
         meant for batch 1

Methods: off; ngram (prompt lookup); self-draft (the target's first layers); early-exit (the
first layers + a trained exit head, docs/early_exit.md); lossy-exit (no speculation: decodes
leave at exit heads, ``--early-exit-threshold``; not lossless); draft (a separate
``--draft-model``, k drafts every step, no cost model: plain drafting); draft+ngram (the same
model with n-gram guesses where they pay more and k per request from the cost model,
kvforge/spec/cost.py, measured at engine start; nothing where nothing pays).

For each batch size b the prompts run in groups of b (one ``LLM.generate`` per group) after a
warm-up; tok/s = output tokens / wall time (prefill included); decode tok/s = tokens after
each request's first / the time from its first token to its last (the phase speculation
speeds up). Greedy speculation is lossless, so every method
must produce the same tokens as "off" (column "same"). Acceptance = accepted / proposed; mean
len = tokens a speculating request gains per verification step; draft ms/tok = the draft
model's time per drafted token (n-gram guesses it checked included); predicted = the cost
model's decode speed-up for the steps the method ran (target rows and draft passes priced
with the costs measured at start); guard held = steps in which the speed guard
(kvforge/spec/speed_guard.py) held speculation back because, at that batch size, its steps had
been measured slower than decoding alone (``--unguarded`` adds each method without it). Ends
with one ``SUMMARY spec:`` line (speedups vs "off" measured in the same run).
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
from kvforge.bench.sharegpt import sample_sharegpt_requests

_CODE = '''def total_price(items, tax_rate):
    total = 0
    for item in items:
        if item.quantity <= 0:
            continue
        total += item.price * item.quantity
    total = total * (1 + tax_rate)
    return round(total, 2)
'''
_CODE2 = '''class Counter:
    def __init__(self):
        self.counts = {}

    def add(self, word):
        self.counts[word] = self.counts.get(word, 0) + 1

    def most_common(self, n):
        pairs = sorted(self.counts.items(), key=lambda kv: kv[1], reverse=True)
        return pairs[:n]
'''
_TEXT = ("The meeting is moved from Tuesday to Thursday at 10am in room 4B. Please bring the "
         "quarterly report, the budget spreadsheet and your notes from the client call. Lunch "
         "will be provided after the meeting, and the afternoon session starts at 2pm.")

_CLASS = '''class Inventory:
    def __init__(self):
        self.items = {}

    def add(self, name, quantity, price):
        if quantity <= 0:
            raise ValueError("quantity must be positive")
        if name in self.items:
            self.items[name]["quantity"] += quantity
        else:
            self.items[name] = {"quantity": quantity, "price": price}

    def remove(self, name, quantity):
        if name not in self.items:
            raise KeyError(name)
        self.items[name]["quantity"] -= quantity
        if self.items[name]["quantity"] <= 0:
            del self.items[name]

    def total_value(self):
        return sum(item["quantity"] * item["price"] for item in self.items.values())
'''

CODE_PROMPTS = [
    f"Add type hints to every method of this Python class. Output the whole class:\n\n{_CLASS}",
    f"Add a one-line docstring to every method of this Python class. Output the whole "
    f"class:\n\n{_CLASS}",
    "Write a Python function `merge_intervals(intervals)` that merges overlapping intervals "
    "given as a list of (start, end) tuples and returns the merged list sorted by start. "
    "Include a docstring and handle the empty list.",
]

# "code": all three; "edit" / "new": the two kinds of code task apart (their targets
# differ: a whole class copied with edits drafts far better than a new function)
CODE_SETS = {"code": CODE_PROMPTS, "edit": CODE_PROMPTS[:2], "new": CODE_PROMPTS[2:]}

# the follow-up turns of the "turns" workload, after a fixed answer (the class with hints)
_CLASS_TYPED = _CLASS.replace("def __init__(self):", "def __init__(self) -> None:").replace(
    "def add(self, name, quantity, price):",
    "def add(self, name: str, quantity: int, price: float) -> None:").replace(
    "def remove(self, name, quantity):", "def remove(self, name: str, quantity: int) -> None:"
).replace("def total_value(self):", "def total_value(self) -> float:")
FOLLOW_UPS = [
    "Now also add a one-line docstring to every method. Output the whole class again.",
    "Now rename the class to `Stock` and the method `total_value` to `value`. Output the whole "
    "class again.",
]

COPY_PROMPTS = [
    f"Rename the variable `total` to `amount` in this Python function and output the whole "
    f"function:\n\n{_CODE}",
    f"Add type hints to this Python class and output the full code:\n\n{_CODE2}",
    f"Rewrite this function so that it uses `items_list` instead of `items`. Output only the "
    f"code:\n\n{_CODE}",
    f"Repeat the following announcement exactly, but change Thursday to Friday:\n\n{_TEXT}",
    f"Add a docstring to each method of this class and output the full code:\n\n{_CODE2}",
    f"Copy this text and put each sentence on its own line:\n\n{_TEXT}",
    f"Convert this function to use a generator expression with sum(). Output the code:\n\n{_CODE}",
    f"Fix the indentation and output this code unchanged otherwise:\n\n{_CODE2}",
]

METHODS = {
    "off": {},
    "ngram": {"speculative_method": "ngram"},
    "self-draft": {"speculative_method": "draft"},
    "draft": {"speculative_method": "draft", "speculative_draft_ngram": False},
    "draft+ngram": {"speculative_method": "draft", "speculative_draft_ngram": True},
    # kvforge/exit (needs `kvforge train-exit-heads`): lossless self-speculation from an exit
    # head, and lossy early exit at --early-exit-threshold (its "same" column may say NO)
    "early-exit": {"speculative_method": "early-exit"},
    "lossy-exit": {},
}
DRAFT_METHODS = ("draft", "draft+ngram")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--num-prompts", type=int, default=4, help="chat prompts")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2])
    p.add_argument("--max-tokens", type=int, default=256,
                   help="cap per answer (256: whole edited snippets, not their first lines)")
    p.add_argument("--num-speculative-tokens", type=int, default=7,
                   help="7: with 1 decode row, the 8 rows the CPU linear kernel takes in one pass")
    p.add_argument("--draft-layers", type=int, default=None,
                   help="self-draft depth (default: a quarter of the layers; early-exit: the "
                        "shallowest trained head)")
    p.add_argument("--early-exit-threshold", type=float, default=0.9,
                   help="lossy-exit: exit at the first head this confident")
    p.add_argument("--draft-model", default=None,
                   help="a separate draft model (catalogue name or path) for draft, draft+ngram")
    p.add_argument("--draft-vocab", type=int, default=None,
                   help="draft, draft+ngram: the draft's head over the N most frequent tokens "
                        "(--speculative-draft-vocab; default: the engine's, 0 = whole head)")
    p.add_argument("--methods", nargs="+", default=["off", "ngram", "self-draft"],
                   choices=list(METHODS))
    p.add_argument("--workloads", nargs="+", default=["chat", "copy"],
                   choices=["chat", "copy", "code", "edit", "new", "turns"])
    p.add_argument("--quantization", default=None,
                   help="engine quantization (default: auto; none = fp32, where greedy "
                        "speculation is bit-identical)")
    p.add_argument("--unguarded", action="store_true",
                   help="also run every speculating method with the speed guard off "
                        "(rows 'METHOD/unguarded': speculation wherever the policy predicts a "
                        "gain, even where its steps were measured slower)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--streaming", default=None, metavar="S,W",
                   help="every method under StreamingLLM: S sink tokens + a window of W "
                        "(n-gram and early-exit speculation run under it)")
    args = p.parse_args(argv)
    if args.streaming is not None:
        try:
            sinks, window = (int(v) for v in args.streaming.split(","))
        except ValueError:
            p.error(f"--streaming {args.streaming!r}: use S,W, e.g. 4,256")
        args.streaming = dict(attention_sinks=sinks, sliding_window=window)
    return args


def _workloads(tokenizer, args) -> dict[str, list[list[int]]]:
    def chat(*turns: str) -> list[int]:
        """The chat template over user, assistant, user, .. turns; a base model without a
        template (gemma-3-270m) gets the turns as plain text, a blank line apart."""
        if tokenizer.chat_template is None:
            return tokenizer.encode("\n\n".join(turns) + "\n\n")
        roles = ["user", "assistant"] * len(turns)
        return tokenizer.apply_chat_template(
            [{"role": r, "content": t} for r, t in zip(roles, turns)])

    out = {}
    if "chat" in args.workloads:
        reqs = sample_sharegpt_requests(lambda t: tokenizer.encode(t, add_special_tokens=False),
                                        args.num_prompts, seed=args.seed, max_prompt_len=384)
        out["chat"] = [chat(r.prompt) for r in reqs]
    if "copy" in args.workloads:
        out["copy"] = [chat(p) for p in COPY_PROMPTS]
    for name, texts in CODE_SETS.items():
        if name in args.workloads:
            prompts = [chat(p) for p in texts]
            # fill the largest batch: a batch larger than the set repeats its prompts
            size = max(len(prompts), max(args.batch_sizes))
            out[name] = [prompts[i % len(prompts)] for i in range(size)]
    if "turns" in args.workloads:
        out["turns"] = []
        for prompt, follow_up in zip(CODE_PROMPTS[:2], FOLLOW_UPS):
            out["turns"] += [chat(prompt), chat(prompt, _CLASS_TYPED, follow_up)]
    return out


def _run(llm, prompts, batch_size, max_tokens):
    """-> (token ids per prompt, wall seconds, decode seconds): decode seconds sum each request's
    time from its first token to its last (prefill excluded: speculation cannot speed it up)."""
    from kvforge import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    tokens, decode_s, start = [], 0.0, time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        outs = llm.generate(prompts[i:i + batch_size], params, use_tqdm=False)
        tokens.extend(o.outputs[0].token_ids for o in outs)
        decode_s += sum(o.metrics.finished_time - o.metrics.first_token_time for o in outs)
    return tokens, time.perf_counter() - start, decode_s


def main(argv=None) -> None:
    args = parse_args(argv)
    threads = setup_threads(args.threads)
    from kvforge import LLM
    results = {}                       # (workload, batch, method) -> row values
    outputs = {}
    # every engine up front, then each (workload, batch) runs the methods back to back: the
    # shared VM's memory bandwidth drifts over minutes, and a method measured minutes after
    # "off" would carry that drift into its ratio
    llms = {}
    if any(m in DRAFT_METHODS for m in args.methods) and not args.draft_model:
        raise SystemExit(f"methods {DRAFT_METHODS} need --draft-model")
    labels = []
    for method in args.methods:
        labels.append((method, method, True))
        if args.unguarded and method not in ("off", "lossy-exit"):
            labels.append((f"{method}/unguarded", method, False))
    for label, method, guarded in labels:
        kwargs = dict(METHODS[method], num_threads=threads, kv_cache_memory="512MiB",
                      max_model_len=2048, speculative_speed_guard=guarded)
        if args.quantization:
            kwargs["quantization"] = args.quantization
        if args.streaming:
            kwargs.update(args.streaming)
        if method not in ("off", "lossy-exit"):
            kwargs["num_speculative_tokens"] = args.num_speculative_tokens
        if method == "lossy-exit":
            kwargs["early_exit_threshold"] = args.early_exit_threshold
        if method in ("self-draft", "early-exit") and args.draft_layers:
            kwargs["speculative_draft_layers"] = args.draft_layers
        if method in DRAFT_METHODS:
            kwargs["speculative_draft_model"] = args.draft_model
            kwargs["speculative_draft_vocab"] = args.draft_vocab
        llms[label] = LLM(args.model, **kwargs)
    costs = [llm.engine.spec.cost for llm in llms.values()
             if llm.engine.spec is not None and llm.engine.spec.cost is not None]
    costs.sort(key=lambda c: c.draft is None)          # one with the draft's costs first
    for method, llm in llms.items():
        spec = llm.engine.spec
        if spec is None:
            continue
        if method.split("/")[0] == "draft":
            # plain drafting: k drafts every step (its rows per step still below a GGUF
            # model's many-row crossover: spec/factory.py)
            spec.cost = None
        if costs:                        # every method priced with the same measured costs
            spec.report_cost = costs[0]
    if costs:
        c = costs[0]
        draft = f"; draft {c.draft.describe()}" if c.draft is not None else ""
        print(f"cost model (single-row target forwards) by rows: target {c.target.describe()}"
              f"{draft}")
    workloads = _workloads(next(iter(llms.values())).engine.tokenizer, args)
    for llm in llms.values():
        _run(llm, [workloads[next(iter(workloads))][0]], 1, 8)          # warm-up
    for name, prompts in workloads.items():
        for b in args.batch_sizes:
            for method, llm in llms.items():
                before = _snapshot(llm.engine)
                group = (prompts[:max(len(CODE_SETS[name]), b)] if name in CODE_SETS
                         else prompts)
                tokens, seconds, decode_s = _run(llm, group, b, args.max_tokens)
                stats = _delta(llm.engine, before)
                outputs[(name, b, method)] = tokens
                n = sum(len(t) for t in tokens)
                results[(name, b, method)] = (n, seconds, stats, decode_s, n - len(tokens))
                print(f"  {name} b={b} {method}: {n} tokens in {seconds:.1f}s", flush=True)
    for llm in llms.values():
        llm.engine.check_integrity()
    del llms

    rows, speedups, decode_speedups = [], {}, {}
    for (name, b, method), (n, seconds, stats, decode_s, decode_n) in results.items():
        stats, draft = stats if stats else (None, None)
        base = results.get((name, b, "off"), results[(name, b, method)])
        speed = (n / seconds) / (base[0] / base[1])
        decode_speed = (decode_n / decode_s) / (base[4] / base[3])
        speedups[(name, b, method)] = speed
        decode_speedups[(name, b, method)] = decode_speed
        same = "yes" if outputs[(name, b, method)] == outputs.get((name, b, "off"),
                                                                  outputs[(name, b, method)]) else "NO"
        acc = f"{stats[1] / stats[0]:.0%}" if stats and stats[0] else "-"
        mean_len = f"{stats[3] / stats[2]:.2f}" if stats and stats[2] else "-"
        draft_ms = f"{draft[0] * 1000 / draft[1]:.0f}" if draft and draft[1] else "-"
        predicted = f"{stats[5] / stats[4]:.2f}x" if stats and stats[4] else "-"
        held = str(stats[6]) if stats and stats[6] is not None else "-"
        rows.append([name, b, method, n, round(n / seconds, 1), f"{speed:.2f}x",
                     round(decode_n / decode_s, 1), f"{decode_speed:.2f}x", predicted, acc,
                     mean_len, draft_ms, held, same])
    print(format_table(["workload", "batch", "method", "tokens", "tok/s", "vs off",
                        "decode tok/s", "vs off", "predicted", "acceptance", "mean len",
                        "draft ms/tok", "guard held", "same"], rows))
    print(hardware_line() + f" | threads {threads}")
    parts = [f"{name} b{b} {m} {s:.2f}x (decode {decode_speedups[(name, b, m)]:.2f}x)"
             for (name, b, m), s in speedups.items() if m != "off"]
    print("SUMMARY spec: tokens/s vs off (decode tokens/s after the first token): "
          + ", ".join(parts))


def _snapshot(engine):
    stats = engine.spec_stats
    if stats is None:
        return None
    draft = getattr(engine.runner.drafter, "stats", None)
    guard = engine.spec.guard
    return ((stats.num_proposed, stats.num_accepted, stats.num_verify_steps, stats.num_emitted,
             stats.predicted_cost, stats.plain_cost,
             guard.stats.denied_steps if guard is not None else None),
            (draft.seconds, draft.num_drafts) if draft is not None else None)


def _delta(engine, before):
    now = _snapshot(engine)
    if now is None:
        return None
    spec = tuple(None if a is None else a - b for a, b in zip(now[0], before[0]))
    draft = tuple(a - b for a, b in zip(now[1], before[1])) if now[1] else None
    return spec, draft


if __name__ == "__main__":
    main()
