"""Attention designs and backends: what each architecture's KV cache costs, and how fast the tiled
(online-softmax) backend prefills against dense attention and the paged SDPA backend.

    python benchmarks/attention.py                            # defaults: a few minutes on 2 cores
    python benchmarks/attention.py --contexts 1024 4096 --budget 8GiB --seq-len 8192

Part 1 builds each architecture's kvforge model on the "meta" device (no weights, no memory) from
its published config and asks the model for its KV bytes per token, then how many sequences of
``--seq-len`` tokens fit in a ``--budget`` KV pool. Part 2 times ONE attention layer's full
prefill of ``L`` tokens through the paged cache (SmolLM2 shape: 9 query heads, 3 KV heads, 64
dims, fp32): "dense" materialises each head's [L, L] scores (what tiling avoids), "paged" is
the default backend (torch SDPA), "tiled" is kvforge/attention/tiled.py. Ends with one
``SUMMARY attention:`` line.
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
from kvforge.attention.paged import PagedAttentionBackend
from kvforge.attention.tiled import TiledAttentionBackend
from kvforge.config import parse_bytes
from kvforge.models.config import ModelConfig
from kvforge.models.registry import get_model_class

_LLAMA_135M = dict(architectures=["LlamaForCausalLM"], vocab_size=49152, hidden_size=576,
                   intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                   num_key_value_heads=3)
# (label, attention design, HF config.json fields): published shapes of real checkpoints
ARCHITECTURES = [
    ("GPT-2 medium 355M", "MHA 16:16", dict(architectures=["GPT2LMHeadModel"], vocab_size=50257,
                                            n_embd=1024, n_layer=24, n_head=16, n_positions=1024)),
    ("SmolLM2-135M", "GQA 9:3", _LLAMA_135M),
    ("SantaCoder 1.1B", "MQA 16:1", dict(architectures=["GPTBigCodeForCausalLM"],
                                         vocab_size=49280, n_embd=2048, n_layer=24, n_head=16,
                                         multi_query=True, n_positions=2048)),
    ("Mixtral-8x7B", "GQA 32:8 + MoE", dict(architectures=["MixtralForCausalLM"], vocab_size=32000,
                                            hidden_size=4096, intermediate_size=14336,
                                            num_hidden_layers=32, num_attention_heads=32,
                                            num_key_value_heads=8, num_local_experts=8,
                                            num_experts_per_tok=2)),
    ("DeepSeek-V2-Lite 16B", "MLA 512+64", dict(
        architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2", vocab_size=102400,
        hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
        num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16, q_lora_rank=None,
        kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
        n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6, first_k_dense_replace=1,
        n_group=1, topk_group=1, topk_method="greedy", norm_topk_prob=False,
        routed_scaling_factor=1.0, rms_norm_eps=1e-6, max_position_embeddings=4096)),
]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budget", default="4GiB", help="KV pool size for the capacity table")
    p.add_argument("--seq-len", type=int, default=4096, help="tokens per sequence (capacity)")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"],
                   help="KV cache dtype for the capacity table")
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 8192])
    p.add_argument("--reps", type=int, default=2, help="timed runs per point (best is kept)")
    p.add_argument("--skip-dense-above", type=int, default=8192,
                   help="skip the dense [L, L] baseline beyond this length (memory)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (1 by default: the tiled loop issues many small ops, and on "
                        "a shared, oversubscribed box OpenMP barriers then dominate them)")
    return p.parse_args(argv)


# ------------------------------------------------------------------ part 1: KV capacity
def kv_capacity_rows(budget_bytes: int, seq_len: int, dtype: torch.dtype):
    rows, per_token = [], {}
    for label, design, hf in ARCHITECTURES:
        try:
            config = ModelConfig.from_hf_dict(hf)
            model = get_model_class(config.architecture)(config, dtype=dtype, device="meta")
        except (ValueError, ImportError, KeyError, TypeError) as e:   # e.g. a family not built
            print(f"  (skipping {label}: {e})")
            continue
        bytes_per_token = model.kv_cache_bytes_per_token()
        per_token[label] = bytes_per_token
        per_layer = bytes_per_token // model.num_layers
        rows.append([label, design, model.num_layers, per_layer, bytes_per_token,
                     budget_bytes // (bytes_per_token * seq_len)])
    return rows, per_token


# ------------------------------------------------------------------ part 2: prefill time
def dense_prefill(q, k, v, scale):
    """Causal attention with each head's full [L, L] score matrix materialised."""
    length, heads, _ = q.shape
    group = heads // k.shape[1]
    mask = torch.ones(length, length, dtype=torch.bool).triu_(1)
    out = torch.empty_like(q)
    for h in range(heads):
        scores = (q[:, h] @ k[:, h // group].T).mul_(scale).masked_fill_(mask, float("-inf"))
        out[:, h] = torch.softmax(scores, -1) @ v[:, h // group]
    return out


def prefill_seconds(length: int, reps: int, skip_dense_above: int) -> dict[str, float]:
    heads, kv_heads, dim, block = 9, 3, 64, 16
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(length, h, dim, generator=g) for h in (heads, kv_heads, kv_heads))
    num_blocks = -(-length // block)
    meta = AttentionMetadata.build([length], [0], [list(range(num_blocks))], block)
    cache = torch.zeros(2, num_blocks, block, kv_heads, dim)
    runs = {"paged": lambda: PagedAttentionBackend(heads, kv_heads, dim, dim ** -0.5)
            .forward(q, k, v, cache, meta),
            "tiled": lambda: TiledAttentionBackend(heads, kv_heads, dim, dim ** -0.5)
            .forward(q, k, v, cache, meta)}
    if length <= skip_dense_above:
        runs["dense"] = lambda: dense_prefill(q, k, v, dim ** -0.5)
    best = {}
    with torch.inference_mode():
        ref = runs["paged"]()
        for name, run in runs.items():
            # correctness guard: a fast wrong answer must not make it into the table
            torch.testing.assert_close(run(), ref, atol=1e-4, rtol=1e-4)
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                run()
                times.append(time.perf_counter() - t0)
            best[name] = min(times)
    return best


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    budget = parse_bytes(args.budget)
    rows, per_token = kv_capacity_rows(budget, args.seq_len, dtype)
    print(f"KV cache per architecture ({args.dtype}; capacity = {args.budget} pool / "
          f"{args.seq_len}-token sequences)")
    print(format_table(["model", "attention", "layers", "bytes/token/layer", "bytes/token",
                        f"max seqs @{args.seq_len}"], rows))

    tile_bytes = 9 * TiledAttentionBackend.q_tile * TiledAttentionBackend.kv_tile_tokens * 4
    print(f"\nOne layer's full prefill, 9:3 heads x 64 dims fp32, block 16, {args.threads} threads "
          f"(dense materialises an L x L score matrix per head; tiled's largest score tile is "
          f"{tile_bytes / 2**20:.1f} MiB at any L)")
    prefill_rows, ratios = [], {}
    for length in args.contexts:
        t = prefill_seconds(length, args.reps, args.skip_dense_above)
        ratios[length] = t["paged"] / t["tiled"]
        dense = t.get("dense")
        prefill_rows.append([length, "-" if dense is None else dense * 1e3, t["paged"] * 1e3,
                             t["tiled"] * 1e3,
                             "-" if dense is None else f"{dense / t['tiled']:.2f}x",
                             f"{ratios[length]:.2f}x",
                             f"{length * length * 4 / 2**20:.0f} MiB"])
    print(format_table(["context", "dense ms", "paged SDPA ms", "tiled ms", "tiled vs dense",
                        "tiled vs paged", "dense scores/head"], prefill_rows))
    print(hardware_line())
    base = per_token.get("GPT-2 medium 355M")
    kv_part = ", ".join(f"{label.split()[0]} {b / 1024:.0f}KiB" for label, b in per_token.items())
    summary = (f"KV/token {kv_part}; tiled prefill speed vs paged SDPA "
               + ", ".join(f"{r:.2f}x@{n}" for n, r in ratios.items()))
    print(f"SUMMARY attention: {summary}")
    return {"kv_bytes_per_token": per_token, "tiled_vs_paged": ratios, "mha_base": base}


if __name__ == "__main__":
    main()
