"""From how many activation rows a GGUF projection leaves the integer dot kernels for a
many-row kernel, and which one: int8 panels (csrc/gguf_gemm.cpp) or fp32 weight tiles + ATen's
GEMM (``GgufWeight(..., gemm_min_rows=N, int8_panels=...)``; docs/gguf_native.md), per block
type and machine.

A prefill chunk or a large batch multiplies every weight block by many rows. The integer dot
kernels pay for activation rounding and per-block scale work on every row; int8 panels unpack
each block once per call and multiply in int8 at several times the dots' rate; fp32 tiles
decode each block once and then run ATen's GEMM. Which wins depends on the machine and on the
block type:

- the machine: with MKL on Intel the GEMM runs near the FMA peak; on the AMD CPU the integer
  kernels were tuned on, MKL's GEMM is slow and the tiles lost at every row count;
- the type: each format's integer kernel does its own per-block work (scales, mins, fifth
  bits, signs), so the crossover moves with it (an Intel Xeon with MKL held to AVX2: Q4_1 96,
  Q8_0 128, Q4_K 64, Q6_K 48 rows; benchmarks/gguf_kernels.py). Timed on one Q4_K probe at
  256 and 512 rows only, prompts of 64-255 tokens stayed on the slower path (Qwen2.5-1.5B
  Q4_K_M, 256 tokens: 4.7 s on the integer kernels, 3.55 s on tiles).

- the many-row kernel: panels ran 1.3-1.8x the tiles at 512 rows and ~2x the dots at 32 on
  the Xeon held to AVX2 (Q6_K's 6-bit codes the least); with MKL's AVX-512 GEMM the tiles
  win on Q6_K.

So the many-row kernel (panels against tiles at 256 rows, for the types with a panel form) and
then its crossover are measured once per machine and type the first time a model uses the
type (a synthetic weight of that type, the paths alternated at growing row counts) and cached
like the fp32 kernel plans (kernels/tune.py).

``KVFORGE_GGUF_GEMM_ROWS`` sets it: ``N`` for every type (0: integer kernels at every row
count), or per type, ``Q4_K=256,Q6_K=0``, with an optional bare ``N`` for the types not named
(the rest are measured). With tuning off (``KVFORGE_TUNE=0``, the test suite) an unset type is
0, so every row count gets the integers a row gets alone unless asked.
``KVFORGE_GGUF_GEMM_KERNEL`` sets the kernel the same way (``panels`` or ``tiles``, for every
type or per type); unset and not measured: panels where the type has a panel form. Both change
a chunk's numbers from what the same rows get in smaller chunks: tiles multiply fp32
activations, panels round them per 32 values instead of the dots' steps.
"""
from __future__ import annotations

import functools
import json
import os
import time
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from kvforge.kernels.isa import cpu_model_name

ENV_VAR = "KVFORGE_GGUF_GEMM_ROWS"
KERNEL_ENV_VAR = "KVFORGE_GGUF_GEMM_KERNEL"
KERNELS = ("panels", "tiles")
# row counts tried: the crossover is the smallest from which the many-row kernel wins at every
# larger one (prefill chunks are 512 rows by default; steps of ~1.5x keep the choice within
# that of the best). From 16: panels win from ~8 rows, but speculative verification steps
# must keep the dots a row gets alone (spec/factory.py keeps their rows below the smallest
# crossover, quant/gguf.integer_rows_max), and a low crossover would leave them few
CANDIDATE_ROWS = (16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
WIN_MARGIN = 1.10                # the many-row kernel must be this much faster to take a row count
KERNEL_ROWS = 256                # rows panels and tiles are compared at
# the block types the integer kernels run (float shards take tiles above 64 rows anyway)
BLOCK_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
# those with an int8 panel form (Q8_0's 8-bit codes would overflow the int16 pair sums)
PANEL_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
# byte offsets of each K-quant block's fp16 scales (every other byte may be anything)
_K_SCALE_OFFSETS = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
# the synthetic weight the crossover is timed on (a 1.5B model's projection size)
_TUNE_SHAPE = (1024, 1536)


def synthetic_blocks(type_name: str, rows: int, in_features: int, seed: int = 0,
                     scales: tuple[float, float] = (1e-3, 1e-2)) -> np.ndarray:
    """uint8 [rows, row bytes] of valid ``type_name`` blocks: gguf-py's quantizer on random
    normal values for the 32-weight formats, random bytes with finite fp16 scales (drawn from
    ``scales``) for the K-quants, which gguf-py does not quantize (random bytes alone would hold
    NaN / inf scales)."""
    from gguf import quants
    qtype = GGMLQuantizationType[type_name]
    rng = np.random.default_rng(seed)
    if type_name not in _K_SCALE_OFFSETS:
        w = rng.standard_normal((rows, in_features)).astype(np.float32)
        return quants.quantize(w, qtype).view(np.uint8).reshape(rows, -1)
    block_weights, block_bytes = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(rows * in_features // block_weights, block_bytes),
                          dtype=np.uint8)
    for offset in _K_SCALE_OFFSETS[type_name]:
        scale = rng.uniform(*scales, size=blocks.shape[0]).astype(np.float16)
        blocks[:, offset:offset + 2] = scale.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def _parse_rows(text: str, entry: str) -> int:
    try:
        rows = int(text)
    except ValueError:
        rows = -1
    if rows < 0:
        raise ValueError(f"{ENV_VAR} entry {entry!r}: use a row count >= 0 (0: never use fp32 "
                         "tiles), as N or TYPE=N")
    return rows


def _env_rows() -> tuple[int | None, dict[str, int]]:
    """(rows for every type not named or None, {type: rows}) from the environment."""
    default, per_type = None, {}
    for entry in filter(None, (e.strip() for e in os.environ.get(ENV_VAR, "").split(","))):
        name, sep, value = entry.partition("=")
        if not sep:
            default = _parse_rows(entry, entry)
            continue
        name = name.strip().upper()
        if name not in BLOCK_TYPES:
            raise ValueError(f"{ENV_VAR} entry {entry!r}: {name!r} is not a GGUF block type "
                             f"the integer kernels run ({', '.join(BLOCK_TYPES)})")
        per_type[name] = _parse_rows(value.strip(), entry)
    return default, per_type


def _env_kernels() -> tuple[str | None, dict[str, str]]:
    """(kernel for every type not named or None, {type: kernel}) from the environment."""
    default, per_type = None, {}
    for entry in filter(None, (e.strip() for e in os.environ.get(KERNEL_ENV_VAR, "").split(","))):
        name, sep, value = entry.rpartition("=")
        value = value.strip().lower()
        if value not in KERNELS:
            raise ValueError(f"{KERNEL_ENV_VAR} entry {entry!r}: the kernel is one of "
                             f"{', '.join(KERNELS)}, as KERNEL or TYPE=KERNEL")
        if not sep:
            default = value
            continue
        name = name.strip().upper()
        if name not in BLOCK_TYPES:
            raise ValueError(f"{KERNEL_ENV_VAR} entry {entry!r}: {name!r} is not a GGUF block "
                             f"type the integer kernels run ({', '.join(BLOCK_TYPES)})")
        per_type[name] = value
    return default, per_type


def _cache_file(threads: int, type_name: str) -> Path:
    from kvforge.kernels.tune import _machine_key, cache_file
    from kvforge.kernels.ops import int8_dot
    # the fp32 kernel plans' key (CPU, kernel build, torch, threads), what changes ATen's GEMM
    # without changing the CPU, and the integer kernels' instruction
    key = dict(_machine_key(threads), mkl=os.environ.get("MKL_ENABLE_INSTRUCTIONS", ""),
               onednn=os.environ.get("ONEDNN_MAX_CPU_ISA", ""), type=type_name,
               int8_dot=int8_dot())
    return cache_file("gguf-gemm-rows", key)


def measure_gemm_path(ops, type_name: str, shape: tuple[int, int] = _TUNE_SHAPE,
                      reps: int = 3) -> tuple[int, str]:
    """(rows, kernel): the many-row kernel, panels if ``type_name`` has a panel form and they
    beat the tiles at KERNEL_ROWS rows, else tiles; and the smallest of CANDIDATE_ROWS from which
    it beats the integer kernels by WIN_MARGIN at that and every larger candidate, or 0 (best
    of ``reps`` alternated calls each: one noisy win below the real crossover does not move
    it)."""
    integer, tiles, panels = path_weights(ops, type_name, shape)
    kernel = "tiles"
    if panels is not None:
        tiles_s, panels_s = best_path_seconds((tiles, panels), KERNEL_ROWS, reps)
        kernel = "panels" if panels_s < tiles_s else "tiles"
    many = panels if kernel == "panels" else tiles
    crossover = 0
    for rows in reversed(CANDIDATE_ROWS):
        integer_s, many_s = best_path_seconds((integer, many), rows, reps)
        if integer_s < WIN_MARGIN * many_s:
            break
        crossover = rows
    return crossover, kernel


def path_weights(ops, type_name: str, shape: tuple[int, int]):
    """One synthetic ``type_name`` weight [out, in] as three GgufWeights: integer kernels at
    every row count, fp32 tiles at every row count, int8 panels at every row count (None for
    a type without a panel form)."""
    from kvforge.kernels.ops import int8_dot
    out_features, in_features = shape
    raw = torch.from_numpy(synthetic_blocks(type_name, out_features, in_features))
    type_id = int(GGMLQuantizationType[type_name])
    panels = (ops.GgufWeight([raw], [type_id], in_features, gemm_min_rows=1, int8_panels=True)
              if type_name in PANEL_TYPES else None)
    # the integer kernels on the instruction the models will use (KVFORGE_INT8_DOT)
    integer = ops.GgufWeight([raw], [type_id], in_features, gemm_min_rows=0, int8_dot=int8_dot())
    return integer, ops.GgufWeight([raw], [type_id], in_features, gemm_min_rows=1), panels


def best_path_seconds(weights, rows: int, reps: int) -> list[float]:
    """Seconds of each GgufWeight of ``weights`` on ``rows`` random activation rows: best of
    ``reps`` calls each, the weights alternated (drift hits all alike), after one warm call
    each."""
    x = torch.randn(rows, weights[0].in_features, generator=torch.Generator().manual_seed(rows))
    best = [float("inf")] * len(weights)
    for w in weights:                                     # warm: first-touch, thread pool
        w.linear(x)
    for _ in range(reps):
        for i, w in enumerate(weights):
            start = time.perf_counter()
            w.linear(x)
            best[i] = min(best[i], time.perf_counter() - start)
    return best


@functools.lru_cache(maxsize=None)
def _measured(threads: int, type_name: str) -> tuple[int, str]:
    try:
        stored = json.loads(_cache_file(threads, type_name).read_text())
        kernel = str(stored["kernel"])
        if kernel not in KERNELS:
            raise ValueError(kernel)
        return int(stored["gemm_min_rows"]), kernel
    except (OSError, ValueError, KeyError, TypeError):
        return _measure_and_store(threads, type_name)


def _measure_and_store(threads: int, type_name: str) -> tuple[int, str]:
    from kvforge.kernels import cpu_kernels
    ops = cpu_kernels()
    if ops is None:
        return 0, "tiles"
    rows, kernel = measure_gemm_path(ops, type_name)
    path = _cache_file(threads, type_name)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"gemm_min_rows": rows, "kernel": kernel, "type": type_name,
                               "cpu": cpu_model_name()}))
    tmp.replace(path)
    return rows, kernel


def retune(type_names: Iterable[str]) -> dict[str, tuple[int, str]]:
    """Time the many-row kernel and crossover of each block type in ``type_names`` again and
    cache them (``kvforge tune``); {type: (rows, kernel)}."""
    names = sorted({n for n in type_names if n in BLOCK_TYPES})
    result = {n: _measure_and_store(torch.get_num_threads(), n) for n in names}
    _measured.cache_clear()
    return result


def gemm_min_rows(type_name: str) -> int:
    """Rows from which a projection of ``type_name`` blocks takes its many-row kernel on this
    machine (0: never)."""
    if type_name not in BLOCK_TYPES:
        raise ValueError(f"{type_name!r} is not a GGUF block type the integer kernels run "
                         f"({', '.join(BLOCK_TYPES)})")
    default, per_type = _env_rows()
    if type_name in per_type:
        return per_type[type_name]
    if default is not None:
        return default
    from kvforge.kernels.tune import tuning_enabled
    if not tuning_enabled():
        return 0
    return _measured(torch.get_num_threads(), type_name)[0]


def gemm_kernel(type_name: str) -> str:
    """The many-row kernel of ``type_name`` blocks on this machine: "panels" or "tiles" (types
    without a panel form: always tiles)."""
    if type_name not in BLOCK_TYPES:
        raise ValueError(f"{type_name!r} is not a GGUF block type the integer kernels run "
                         f"({', '.join(BLOCK_TYPES)})")
    if type_name not in PANEL_TYPES:
        return "tiles"
    default, per_type = _env_kernels()
    if type_name in per_type:
        return per_type[type_name]
    if default is not None:
        return default
    from kvforge.kernels.tune import tuning_enabled
    if not tuning_enabled() or gemm_min_rows(type_name) == 0:
        return "panels"
    return _measured(torch.get_num_threads(), type_name)[1]


def shard_gemm_path(type_names: Iterable[str], rows: Iterable[int]) -> tuple[int, bool]:
    """(crossover, int8 panels) for a projection whose shards (one type each, ``rows`` output
    rows each) switch paths together: the crossover and kernel of the type with the most rows
    (Q4_K_M files put a Q6_K ``v`` beside Q4_K ``q`` and ``k``). Float shards do not vote."""
    votes: dict[str, int] = {}
    for name, n in zip(type_names, rows):
        if name in BLOCK_TYPES:
            votes[name] = votes.get(name, 0) + n
    if not votes:
        return 0, False
    voter = max(votes, key=votes.__getitem__)
    return gemm_min_rows(voter), gemm_kernel(voter) == "panels"


def shared_env(type_names: Iterable[str]) -> dict[str, str]:
    """The environment that gives another process (a tensor-parallel worker) this process's
    crossovers and kernels for ``type_names`` without timing them again."""
    names = sorted({n for n in type_names if n in BLOCK_TYPES})
    return {ENV_VAR: ",".join(f"{n}={gemm_min_rows(n)}" for n in names) or "0",
            KERNEL_ENV_VAR: ",".join(f"{n}={gemm_kernel(n)}" for n in names) or "tiles"}
