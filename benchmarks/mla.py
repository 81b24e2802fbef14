"""MLA (DeepSeek-V2 attention): KV bytes per token vs an MHA cache of the same heads, and one
layer's decode attention time, absorbed (reads only the latent cache) vs naive (up-projects the
whole context every step), over the same paged latent cache.

    python benchmarks/mla.py                          # defaults: about a minute on 2 cores
    python benchmarks/mla.py --heads 16 --contexts 512 2048 --batch 8

Shapes default to DeepSeek-V2-Lite's attention (kv_lora_rank 512, rope 64, nope 128, v 128,
16 heads). Ends with one ``SUMMARY mla:`` line.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if __package__ in (None, ""):                       # run as a script: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.hardware import hardware_line
from benchmarks.report import format_table
from kvforge.attention.metadata import AttentionMetadata
from kvforge.attention.mla import MLAAttentionBackend, MLAUpProjection


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-lora-rank", type=int, default=512)
    p.add_argument("--rope-dim", type=int, default=64)
    p.add_argument("--nope-dim", type=int, default=128)
    p.add_argument("--v-dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=4, help="decoding sequences per step")
    p.add_argument("--contexts", type=int, nargs="+", default=[256, 1024])
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    return p.parse_args(argv)


def decode_step_seconds(backend, up, batch: int, context: int, block_size: int, reps: int,
                        entry: int, q_dim: int) -> float:
    """Best-of-reps time of one decode step (batch sequences, one new token each)."""
    blocks_per_seq = -(-(context + 1) // block_size)
    tables = [list(range(s * blocks_per_seq, (s + 1) * blocks_per_seq)) for s in range(batch)]
    meta = AttentionMetadata.build([1] * batch, [context] * batch, tables, block_size)
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(1, batch * blocks_per_seq, block_size, entry, generator=g)
    q = torch.randn(batch, backend.num_heads, q_dim, generator=g)
    latent = torch.randn(batch, entry, generator=g)
    best = float("inf")
    with torch.inference_mode():
        for _ in range(reps + 1):                    # first run warms up (plan, allocator)
            meta.__dict__.pop("_mla_plans", None)
            t0 = time.perf_counter()
            backend.forward(q, latent, up, cache, meta)
            best = min(best, time.perf_counter() - t0)
    return best


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    h, rank, rope, nope, v = args.heads, args.kv_lora_rank, args.rope_dim, args.nope_dim, args.v_dim
    entry = rank + rope
    mha_values = h * (nope + rope + v)                 # per-head K (nope + rope) and V
    up = MLAUpProjection(h, rank, nope, v)
    up.load_kv_b(torch.randn(h * (nope + v), rank) * rank ** -0.5)
    backends = {path: MLAAttentionBackend(h, rank, nope, rope, v, (nope + rope) ** -0.5,
                                          decode_path=path) for path in ("naive", "absorbed")}
    print(f"MLA layer: {h} heads, kv_lora_rank {rank}, rope {rope}, nope {nope}, v {v}; "
          f"batch {args.batch}, block {args.block_size}, {args.threads} threads")
    print(format_table(["cache", "values/token/layer", "fp32 bytes/token/layer", "vs MHA"], [
        ["MHA (per-head K and V)", mha_values, mha_values * 4, "1.00x"],
        ["MLA latent (c_kv | k_pe)", entry, entry * 4, f"{mha_values / entry:.2f}x smaller"]]))
    rows, speedups = [], []
    for ctx in args.contexts:
        t = {path: decode_step_seconds(b, up, args.batch, ctx, args.block_size, args.reps, entry,
                                       nope + rope) for path, b in backends.items()}
        speedups.append(t["naive"] / t["absorbed"])
        rows.append([ctx, t["naive"] * 1e3, t["absorbed"] * 1e3, f"{speedups[-1]:.1f}x"])
    print(format_table(["context", "naive ms/step", "absorbed ms/step", "absorbed speedup"], rows))
    print(hardware_line())
    summary = (f"kv {mha_values / entry:.1f}x smaller than MHA; absorbed decode "
               + ", ".join(f"{s:.1f}x@{c}" for s, c in zip(speedups, args.contexts))
               + " faster than naive")
    print(f"SUMMARY mla: {summary}")
    return {"speedups": dict(zip(args.contexts, speedups)), "kv_ratio": mha_values / entry}


if __name__ == "__main__":
    main()
