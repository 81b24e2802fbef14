"""GGUF block projections by activation rows: the integer dot kernels, int8 panels and fp32 tiles + GEMM.

    .venv/bin/python benchmarks/gguf_kernels.py [--types Q4_1 Q8_0 Q4_K Q6_K]
        [--shapes 1536x576 576x1536 17920x1536] [--rows 1 4 16 64 128 256 512] [--threads 2]

Per block type and weight shape (out x in, in a multiple of the type's block: K-quants skip
SmolLM2's 576-wide inputs; synthetic valid blocks, kernels/gguf_tiles.py: the
kernels' speed does not depend on the values), per row count M: the time of
``GgufWeight.linear`` on the integer kernels (``gemm_min_rows=0``, docs/gguf_native.md), on int8
panels (``int8_panels=True``; types with a panel form) and on fp32 tiles + ATen's GEMM
(``gemm_min_rows=1``), alternated, best of ``--reps``; GFLOP/s = 2 M out in / time. Then the
many-row kernel and crossover the engine would choose for each type on this machine
(``gguf_tiles.measure_gemm_path``: panels or tiles, whichever is faster at 256 rows, from the
smallest row count at which it wins by 10% at every larger one; 0 = never). The integer
kernels run on ``KVFORGE_INT8_DOT``'s instruction (VNNI where the CPU has it); when that is
not maddubs, the maddubs kernels are timed beside them ("maddubs" column) and their outputs
compared bit for bit ("same bits"). ``KVFORGE_ISA=avx2`` with ``MKL_ENABLE_INSTRUCTIONS=AVX2``
(and ``KVFORGE_INT8_DOT=maddubs``) measures an AVX2 machine's paths on an AVX-512 CPU. Ends
with one ``SUMMARY gguf_kernels:`` line.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):                       # run as a script: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from benchmarks.common import setup_threads
from benchmarks.hardware import hardware_line
from benchmarks.report import format_table
from kvforge.kernels import cpu_kernels
from kvforge.kernels.gguf_tiles import (BLOCK_TYPES, best_path_seconds, measure_gemm_path,
                                        path_weights, synthetic_blocks)
from kvforge.kernels.ops import INT8_DOTS, int8_dot

# SmolLM2-135M's gate|up and down, Qwen2.5-1.5B's gate|up
DEFAULT_SHAPES = ("1536x576", "576x1536", "17920x1536")


def parse_shape(text: str) -> tuple[int, int]:
    try:
        out_features, in_features = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"shape {text!r}: use OUTxIN, e.g. 1536x576") from None
    if out_features < 1 or in_features < 1 or in_features % 32:
        raise ValueError(f"shape {text!r}: sizes >= 1 and IN a multiple of 32 (whole blocks)")
    return out_features, in_features


def maddubs_weight(ops, type_name: str, shape: tuple[int, int]):
    """path_weights' integer weight (the same synthetic blocks) on AVX2's maddubs."""
    raw = torch.from_numpy(synthetic_blocks(type_name, *shape))
    return ops.GgufWeight([raw], [int(GGMLQuantizationType[type_name])], shape[1],
                          gemm_min_rows=0, int8_dot=INT8_DOTS["maddubs"])


def measure(ops, type_name: str, shape: tuple[int, int], rows: list[int], reps: int,
            with_maddubs: bool) -> list[tuple]:
    """(M, integer, panels (None: no panel form), tiles GFLOP/s, maddubs GFLOP/s and whether
    its outputs equal the integer kernels' (None, None: not asked)) per row count."""
    integer, tiles, panels = path_weights(ops, type_name, shape)
    maddubs = maddubs_weight(ops, type_name, shape) if with_maddubs else None
    weights = [integer, tiles] + ([panels] if panels is not None else []) + (
        [maddubs] if maddubs is not None else [])
    result = []
    for m in rows:
        seconds = best_path_seconds(weights, m, reps)
        flop = 2 * m * shape[0] * shape[1] / 1e9
        same = None
        if maddubs is not None:
            x = torch.randn(m, shape[1], generator=torch.Generator().manual_seed(m))
            same = torch.equal(integer.linear(x), maddubs.linear(x))
        result.append((m, flop / seconds[0], flop / seconds[2] if panels else None,
                       flop / seconds[1], flop / seconds[-1] if maddubs else None, same))
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", nargs="+", default=["Q4_1", "Q8_0", "Q4_K", "Q6_K"])
    parser.add_argument("--shapes", nargs="+", default=list(DEFAULT_SHAPES))
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 4, 16, 64, 128, 256, 512])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    bad = [t for t in args.types if t not in BLOCK_TYPES]
    if bad:
        parser.error(f"--types {bad}: choose from {', '.join(BLOCK_TYPES)}")
    if any(m < 1 for m in args.rows) or args.reps < 1:
        parser.error("--rows and --reps must be >= 1")
    try:
        shapes = [parse_shape(s) for s in args.shapes]
    except ValueError as e:
        parser.error(str(e))
    setup_threads(args.threads)
    ops = cpu_kernels()
    if ops is None:
        parser.error("the compiled kernels are not available (KVFORGE_KERNELS=0 or no compiler)")
    dot = int8_dot()
    with_maddubs = dot != INT8_DOTS["maddubs"]
    dot_name = next(name for name, code in INT8_DOTS.items() if code == dot)
    print(hardware_line() + f" | integer kernels on {dot_name}")
    rows_out, ratios, all_same = [], [], True
    for type_name in args.types:
        block = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]][0]
        for shape in shapes:
            if shape[1] % block:           # K-quants: whole super-blocks of 256 only
                continue
            for m, integer, panels, tiles, maddubs, same in measure(
                    ops, type_name, shape, args.rows, args.reps, with_maddubs):
                row = [type_name, f"{shape[0]}x{shape[1]}", m, f"{integer:.1f}",
                       "-" if panels is None else f"{panels:.1f}", f"{tiles:.1f}",
                       f"{max(panels or 0, tiles) / integer:.2f}"]
                if with_maddubs:
                    row += [f"{maddubs:.1f}", f"{integer / maddubs:.2f}", "yes" if same else "NO"]
                    ratios.append(integer / maddubs)
                    all_same = all_same and same
                rows_out.append(row)
    headers = ["type", "out x in", "rows", "integer GFLOP/s", "panels GFLOP/s", "tiles GFLOP/s",
               "best many-row / integer"]
    if with_maddubs:
        headers += ["maddubs GFLOP/s", f"{dot_name} / maddubs", "same bits"]
    print(format_table(headers, rows_out))
    paths = {t: measure_gemm_path(ops, t) for t in args.types}
    print(format_table(["type", "many-row kernel", "from (rows; 0 = never)"],
                       [[t, kernel, r] for t, (r, kernel) in paths.items()]))
    print("SUMMARY gguf_kernels: crossover " + ", ".join(f"{t} {kernel} {r}"
                                                       for t, (r, kernel) in paths.items())
          + (f" | integer {dot_name} / maddubs {min(ratios):.2f}-{max(ratios):.2f}x, outputs "
             f"{'identical' if all_same else 'DIFFER'}" if ratios else "")
          + f" | {hardware_line()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
