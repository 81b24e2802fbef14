"""From how many activation rows a GGUF projection takes fp32 weight tiles + ATen's GEMM instead
of the integer dot kernels (``GgufWeight(..., gemm_min_rows=N)``; docs/gguf_native.md).

A long prefill chunk multiplies every weight block by hundreds of rows. The integer kernels pay
for activation rounding and per-block scale work on every row; fp32 tiles pay for decoding each
block once and then run ATen's GEMM. Which wins depends on the machine: with MKL on Intel the
GEMM runs near the FMA peak and the tiles are 1.2-1.7x faster at 512 rows (AVX2 code paths,
Qwen2.5-1.5B Q4_K and SmolLM2 Q4_1 shapes); on the AMD CPU the integer kernels were tuned on,
MKL's GEMM is slow and the tiles lost at every row count. So the crossover is measured once per
machine (a synthetic Q4_K weight, both paths alternated) and cached like the fp32 kernel plans
(kernels/tune.py).

``KVFORGE_GGUF_GEMM_ROWS=N`` sets it (0: integer kernels at every row count); with tuning off
(``KVFORGE_TUNE=0``, the test suite) it is 0, so every row count gets the integers a row gets
alone unless asked. Tiles change a prefill chunk's numbers (fp32 activations instead of 8-bit
ones: closer to the dequantized reference, but not what the same rows get in smaller chunks).
"""
from __future__ import annotations

import functools
import json
import os
import time
from pathlib import Path

import numpy as np
import torch

from kvforge.kernels.isa import cpu_model_name

ENV_VAR = "KVFORGE_GGUF_GEMM_ROWS"
CANDIDATE_ROWS = (256, 512)      # chunk sizes tried, smallest first (prefill chunks: 512 default)
WIN_MARGIN = 1.10                # the tiles must be this much faster at a row count to take it
_Q4_K = 12                       # GGMLQuantizationType.Q4_K
_Q4_K_BYTES = 144                # bytes per 256 weights


def _env_rows() -> int | None:
    value = os.environ.get(ENV_VAR, "").strip()
    if not value:
        return None
    try:
        rows = int(value)
    except ValueError:
        rows = -1
    if rows < 0:
        raise ValueError(f"{ENV_VAR}={value!r}: use a row count >= 0 (0: never use fp32 tiles)")
    return rows


def _cache_file(threads: int) -> Path:
    from kvforge.kernels.tune import _machine_key, cache_file
    # the fp32 kernel plans' key (CPU, kernel build, torch, threads) and what changes ATen's
    # GEMM without changing the CPU
    key = dict(_machine_key(threads), mkl=os.environ.get("MKL_ENABLE_INSTRUCTIONS", ""),
               onednn=os.environ.get("ONEDNN_MAX_CPU_ISA", ""))
    return cache_file("gguf-gemm-rows", key)


def synthetic_q4_k(rows: int, in_features: int, seed: int = 0) -> torch.Tensor:
    """Random Q4_K rows with finite, small scales (random bytes would give NaN / inf fp16s)."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows, in_features // 256, _Q4_K_BYTES), dtype=np.uint8)
    scales = np.array([0.01, 0.002], dtype=np.float16).view(np.uint8)    # d, dmin
    blocks[:, :, :4] = scales
    return torch.from_numpy(blocks.reshape(rows, -1))


def measure_gemm_min_rows(ops, out_features: int = 2048, in_features: int = 1536,
                          reps: int = 3) -> int:
    """The smallest of CANDIDATE_ROWS where tiles beat the integer kernels by WIN_MARGIN (best
    of ``reps`` alternated calls each), or 0."""
    raw = synthetic_q4_k(out_features, in_features)
    integer = ops.GgufWeight([raw], [_Q4_K], in_features, gemm_min_rows=0)
    tiles = ops.GgufWeight([raw], [_Q4_K], in_features, gemm_min_rows=1)
    for rows in CANDIDATE_ROWS:
        x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows))
        best = {"integer": float("inf"), "tiles": float("inf")}
        integer.linear(x), tiles.linear(x)                    # warm: first-touch, thread pool
        for _ in range(reps):
            for name, w in (("integer", integer), ("tiles", tiles)):
                start = time.perf_counter()
                w.linear(x)
                best[name] = min(best[name], time.perf_counter() - start)
        if best["integer"] >= WIN_MARGIN * best["tiles"]:
            return rows
    return 0


@functools.lru_cache(maxsize=None)
def _measured(threads: int) -> int:
    from kvforge.kernels import cpu_kernels
    ops = cpu_kernels()
    if ops is None:
        return 0
    path = _cache_file(threads)
    try:
        return int(json.loads(path.read_text())["gemm_min_rows"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    rows = measure_gemm_min_rows(ops)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"gemm_min_rows": rows, "cpu": cpu_model_name()}))
    tmp.replace(path)
    return rows


def gemm_min_rows() -> int:
    """Rows from which GGUF projections take fp32 tiles on this machine (0: never)."""
    rows = _env_rows()
    if rows is not None:
        return rows
    from kvforge.kernels.tune import tuning_enabled
    if not tuning_enabled():
        return 0
    return _measured(torch.get_num_threads())
