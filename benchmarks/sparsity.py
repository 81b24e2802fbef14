"""Activation sparsity (TEAL / CATS, kvforge/sparsity): batch-1 decode speed vs dense, perplexity
and realised sparsity per layer type, for several targets S.

    python benchmarks/sparsity.py                                   # default model, fp32
    python benchmarks/sparsity.py --quantization gguf               # its native GGUF blocks
    python benchmarks/sparsity.py --model qwen2.5-coder-1.5b-instruct --quantization int8
    python benchmarks/sparsity.py --rotation none,pca --sparsity 0,0.25,0.4,0.5   # both, one table

Per S and rotation (thresholds calibrated on The Tempest past the scored text, cached; pca:
gate|up's input thresholded in its principal axes, kvforge/sparsity/rotation.py):
- speed: one engine, batch-1 greedy decode of ``--tokens`` tokens after a short English
  prompt (multi-step decoding, so the compiled step), the sparse projections switched on and
  off between reps (dense, sparse, dense, ...): same weights, same process, alternated so
  background load hits both alike; the ratio of the median tok/s (end to end: the prompt's
  prefill and first token included) and of the decode phase's (tokens after the first over
  the time after it: what the sparse step changes), and the share of weight rows
  the thresholds skip on that decoded text (the speed follows it; a rotated input skips less
  there than on the calibration's Shakespeare). Formats the sparse kernels do not read (GGUF
  blocks) decode dense.
- quality: perplexity over the first ``--ppl-tokens`` tokens of The Tempest with every token
  masked as a sparse decode step masks it (the Python layers with the thresholds' hooks), and
  the realised fraction of zeroed inputs per kind of projection, plus the fraction of whole
  32-input blocks zeroed (what a GGUF block format could skip).
Ends with one ``SUMMARY sparsity:`` line with the hardware.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.hardware import hardware_line  # noqa: E402


# the decoded text of the speed reps: prose, through each model's own tokenizer
SPEED_PROMPT = "The old lighthouse keeper climbed the stairs every evening, and"


def decode(llm, tokens: int) -> tuple[float, float, list[int]]:
    """(tok/s end to end, decode-phase tok/s, prompt + decoded token ids) of one greedy
    batch-1 decode of ``tokens`` tokens; the decode phase: the tokens after the first over the
    time from the first token to the last."""
    from kvforge.sampling_params import SamplingParams
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    out = llm.generate([SPEED_PROMPT], params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    assert len(out[0].outputs[0].token_ids) == tokens
    m = out[0].metrics
    return (tokens / elapsed, (tokens - 1) / (m.finished_time - m.first_token_time),
            list(out[0].prompt_token_ids) + list(out[0].outputs[0].token_ids))


def skipped_on(model, thresholds, token_ids: list[int]) -> float:
    """The weight rows the thresholds skip on ``token_ids`` (the speed reps' decoded text): a
    rotated input realises less than its level on text unlike the calibration's."""
    from kvforge.eval.perplexity import perplexity
    from kvforge.sparsity.masking import SparsityMasks, realised_overall
    with SparsityMasks(model, thresholds) as masks:
        perplexity(model, token_ids, max_tokens=len(token_ids) - 1, progress=False)
    return realised_overall(model, masks.realised())


def measure_speed(llm, layers, reps: int, tokens: int) -> dict:
    """Medians of alternated reps: dense / sparse tok/s end to end and of the decode phase,
    and the dense reps' prompt + decoded ids."""
    from kvforge.kernels import cpu_kernels
    stack = llm.engine.runner.model.decode_stack()
    rows = cpu_kernels().sparse_rows_max
    runs = {"dense": [], "sparse": []}
    decode(llm, 8)                                         # warm-up
    for _ in range(reps):
        stack.set_sparsity([], 0)
        *rates, decoded = decode(llm, tokens)
        runs["dense"].append(rates)
        stack.set_sparsity(layers, rows)
        runs["sparse"].append(decode(llm, tokens)[:2])
    stack.set_sparsity([], 0)
    out = {"decoded": decoded}
    for name, rates in runs.items():
        out[name] = statistics.median(r[0] for r in rates)
        out[f"{name}_decode"] = statistics.median(r[1] for r in rates)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--quantization", default="none",
                   help="none (fp32), gguf (native blocks), int8, ...")
    p.add_argument("--mode", default="teal", choices=["teal", "cats"])
    p.add_argument("--allocation", default="uniform", choices=["uniform", "greedy"])
    p.add_argument("--rotation", default="none",
                   help="comma-separated: none, pca (each S is measured with each)")
    p.add_argument("--sparsity", default="0,0.25,0.4,0.5,0.6",
                   help="comma-separated targets; 0 is the dense baseline")
    p.add_argument("--ppl-tokens", type=int, default=2048)
    p.add_argument("--tokens", type=int, default=64, help="decoded tokens per speed rep")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--skip-speed", action="store_true")
    p.add_argument("--skip-ppl", action="store_true")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--calibration-tokens", type=int, default=None,
                   help="tokens to calibrate on when not cached (default 4096)")
    args = p.parse_args()

    from kvforge.engine.llm import LLM
    from kvforge.eval.corpus import load_corpus
    from kvforge.eval.perplexity import perplexity
    from kvforge.kernels import cpu_kernels
    from kvforge.sparsity.cache import load_or_calibrate
    from kvforge.sparsity.decode import sparse_layers
    from kvforge.sparsity.config import validate_sparsity
    from kvforge.sparsity.masking import SparsityMasks, realised_overall

    if args.threads:
        torch.set_num_threads(args.threads)
    levels = [float(s) for s in args.sparsity.split(",")]
    rotations = args.rotation.split(",")
    for rotation in rotations:
        validate_sparsity(0.0, args.mode, args.allocation, rotation)
    llm = LLM(args.model, quantization=args.quantization, kv_cache_memory="256MiB",
              max_model_len=2048, num_threads=args.threads)
    runner = llm.engine.runner
    model, source = runner.model, llm.engine.source if hasattr(llm.engine, "source") else None
    if source is None:
        from kvforge.loader.source import load_model_source
        source = load_model_source(args.model)
    ids = source.load_tokenizer().encode(load_corpus("shakespeare"), add_special_tokens=False)
    name = source.path.rsplit("/", 1)[-1]
    print(f"model {name} | quantization {args.quantization} | mode {args.mode} "
          f"({args.allocation}) | ppl over {args.ppl_tokens} Tempest tokens | speed: batch 1, "
          f"{args.tokens} tokens x {args.reps} alternated reps")
    rows, base_ppl = [], None
    for s, rotation in [(s, r) for s in levels for r in (rotations if s > 0 else ["none"])]:
        row = {"S": s, "rotation": rotation}
        thresholds = (load_or_calibrate(model, source, s, args.mode, args.quantization,
                                        args.allocation, tokens=args.calibration_tokens,
                                        rotation=rotation)
                      if s > 0 else None)
        if not args.skip_ppl:
            masks = SparsityMasks(model, thresholds) if thresholds is not None else None
            r = perplexity(model, ids, max_tokens=args.ppl_tokens, progress=False)
            if masks is not None:
                masks.remove()
                row["realised"] = masks.realised()
                row["skipped"] = realised_overall(model, row["realised"])
            row["ppl"] = r.perplexity
            base_ppl = r.perplexity if s == 0 else base_ppl
        if not args.skip_speed and thresholds is not None:
            layers, covered = sparse_layers(model, thresholds, cpu_kernels())
            row["covered"] = covered
            row.update(measure_speed(llm, layers, args.reps, args.tokens))
            row["skipped_decoded"] = skipped_on(model, thresholds, row.pop("decoded"))
        rows.append(row)
        print(_line(row, base_ppl), flush=True)

    print("\n| S | rotation | ppl | ppl vs dense | skipped weights | realised qkv / o / gate_up / "
          "down (CATS: up / down) | whole 32-blocks zeroed | skipped on the decoded text | "
          "dense tok/s | sparse tok/s | speed-up | decode phase: dense / sparse tok/s | speed-up |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(_table_row(row, base_ppl))
    best = [r for r in rows if "sparse" in r]
    speed = ", ".join(f"S={r['S']:g}{_rot(r)} x{r['sparse'] / r['dense']:.2f} (decode phase "
                      f"x{r['sparse_decode'] / r['dense_decode']:.2f})" for r in best)
    quality = ", ".join(f"S={r['S']:g}{_rot(r)} {r['ppl'] / base_ppl - 1:+.1%}" for r in rows
                        if "ppl" in r and base_ppl and r["S"] > 0)
    print(f"\nSUMMARY sparsity: {name} {args.quantization} {args.mode}/{args.allocation}: "
          f"decode {speed or 'n/a'}; ppl {quality or 'n/a'} | {hardware_line()}")


def _kinds(realised: dict) -> tuple[str, str]:
    plain = [f"{realised[k]:.0%}" for k in ("qkv", "o", "gate_up", "down", "up")
             if k in realised]
    blocks = [f"{v:.1%}" for k, v in realised.items() if ":block" in k]
    return " / ".join(plain), " / ".join(blocks) or "-"


def _rot(row) -> str:
    return "" if row.get("rotation", "none") == "none" else f" {row['rotation']}"


def _line(row, base) -> str:
    parts = [f"S={row['S']:g}{_rot(row)}"]
    if "ppl" in row:
        parts.append(f"ppl {row['ppl']:.3f}" + (f" ({row['ppl'] / base - 1:+.2%})" if base else ""))
    if "realised" in row:
        parts.append(f"realised {_kinds(row['realised'])[0]} (blocks {_kinds(row['realised'])[1]})"
                     f" skipped {row['skipped']:.1%}")
    if "sparse" in row:
        parts.append(f"decode dense {row['dense']:.1f} tok/s sparse {row['sparse']:.1f} tok/s "
                     f"x{row['sparse'] / row['dense']:.2f}, decode phase "
                     f"x{row['sparse_decode'] / row['dense_decode']:.2f} "
                     f"({row['covered']} projections sparse, "
                     f"{row['skipped_decoded']:.1%} of the weights skipped on the decoded text)")
    return " | ".join(parts)


def _table_row(row, base) -> str:
    ppl = f"{row['ppl']:.3f}" if "ppl" in row else "-"
    rel = f"{row['ppl'] / base - 1:+.2%}" if "ppl" in row and base and row["S"] > 0 else "-"
    kinds, blocks = _kinds(row["realised"]) if "realised" in row else ("-", "-")
    skipped = f"{row['skipped']:.1%}" if "skipped" in row else "-"
    if "sparse" in row:
        speed = (f"{row['skipped_decoded']:.1%} | {row['dense']:.1f} | {row['sparse']:.1f} | "
                 f"x{row['sparse'] / row['dense']:.2f} | {row['dense_decode']:.1f} / "
                 f"{row['sparse_decode']:.1f} | x{row['sparse_decode'] / row['dense_decode']:.2f}")
    else:
        speed = "- | - | - | - | - | -"
    return (f"| {row['S']:g} | {row.get('rotation', 'none')} | {ppl} | {rel} | {skipped} | "
            f"{kinds} | {blocks} | {speed} |")


if __name__ == "__main__":
    main()
