"""fp32 projections of one SmolLM2-135M decoder stack: kvforge's tiled kernel vs MKL, by rows M.

    .venv/bin/python benchmarks/linear_kernel.py [--threads 2] [--rows 1 2 4 8 16 32 64 128 256]

Per M, the time of all 120 decoder projections (30 layers x q|k|v 576->960, o 576->576,
gate|up 576->3072, down 1536->576; random weights, the kernels' speed does not depend on values)
for: ``F.linear`` (x W^T), ``(W @ x^T)^T`` (MKL with the weight as the left operand; for M = 1
the row duplicated: the 2-column GEMM that reads W once), the compiled tiled kernel on the
row-major weights with the build's default plan and with this machine's tuned plan per row
range (kvforge/kernels/tune.py; MKL where the tuner chose it; ``KVFORGE_TUNE=0``: defaults,
``KVFORGE_ISA=avx2`` measures the AVX2 build on an AVX-512 CPU), ``linear_packed`` on the
packed ones (the layout the decode stack
runs; kvforge/kernels/csrc/linear.cpp), the packed ones as separate 4 KiB-page tensors and as
the engine keeps them, in one huge-page buffer in the order a step reads them (layer by layer;
kvforge/kernels/huge_pages.py). Methods run round-robin in the same process, best of
``--rounds``; GB/s = weight bytes / time, GFLOP/s = 2 M params / time. These runs set
``LINEAR_ROWS_MIN``/``LINEAR_ROWS_MAX`` in kvforge/kernels/ops.py. Ends with one
``SUMMARY linear_kernel:`` line.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if __package__ in (None, ""):                       # run as a script: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.common import setup_threads
from benchmarks.hardware import hardware_line
from benchmarks.report import format_table
from kvforge.kernels.huge_pages import huge_page_bytes, huge_page_zeros

LAYER_SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]   # (in, out)
NUM_LAYERS = 30


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8, 12, 16, 32, 64,
                                                            128, 256])
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    threads = setup_threads(args.threads)
    from kvforge.kernels import cpu_kernels, ops, tune
    kernels = cpu_kernels()
    if kernels is None:
        sys.exit("the compiled kernels are not available here (see the log); nothing to compare")
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(out, inp, generator=g) * 0.05
               for inp, out in LAYER_SHAPES for _ in range(NUM_LAYERS)]
    packed = [ops.pack_linear_weight(w) for w in weights]
    # the engine's placement: layer by layer (q|k|v, o, gate|up, down), one huge-page buffer
    step_order = [s * NUM_LAYERS + layer for layer in range(NUM_LAYERS)
                  for s in range(len(LAYER_SHAPES))]
    placed = huge_page_zeros([packed[i].shape for i in step_order])
    for buffer, i in zip(placed, step_order):
        ops.pack_linear_weight(weights[i], out=buffer)
    placed_weights = [weights[i] for i in step_order]
    # the engine's per-machine choice for these shapes (cached: `kvforge tune` redoes it)
    tunings = tune.tune_linear_shapes([(i, o, False, max(args.rows)) for i, o in LAYER_SHAPES])
    weight_bytes = sum(w.numel() * 4 for w in weights)
    params = sum(w.numel() for w in weights)

    def methods(xs):
        def linear():
            return [torch.nn.functional.linear(xs[w.shape[1]], w) for w in weights]

        def w_first():
            if next(iter(xs.values())).shape[0] == 1:
                return [torch.mm(w, xs[w.shape[1]].expand(2, -1).contiguous().t())[:, 0]
                        for w in weights]
            return [torch.mm(w, xs[w.shape[1]].t()).t().contiguous() for w in weights]

        def kernel():       # the build's default plan (no tuned choice)
            return [kernels.linear_with_plan(xs[w.shape[1]], w, -1, 0, 0) for w in weights]

        def kernel_tuned():  # what the Python layers run: the tuned plan, or MKL where it won
            out = []
            for w in weights:
                x = xs[w.shape[1]]
                y = ops.linear_rows(x, w)
                out.append(tune.mkl_linear(x, w) if y is None else y)
            return out

        def kernel_packed():
            return [kernels.linear_packed(xs[w.shape[1]], p, w.shape[0])
                    for w, p in zip(weights, packed)]

        def kernel_placed():
            return [kernels.linear_packed(xs[w.shape[1]], p, w.shape[0])
                    for w, p in zip(placed_weights, placed)]
        return {"F.linear": linear, "(W @ x^T)^T": w_first, "kvforge": kernel,
                "kvforge tuned": kernel_tuned, "kvforge packed": kernel_packed,
                "kvforge placed": kernel_placed}

    rows, summary = [], []
    for m in args.rows:
        xs = {inp: torch.randn(m, inp, generator=g) for inp, _ in LAYER_SHAPES}
        fns = methods(xs)
        times = {name: float("inf") for name in fns}
        for fn in fns.values():
            fn()                                    # warm-up: first-call allocations
        for _ in range(args.rounds):                # round-robin: load hits every method alike
            for name, fn in fns.items():
                start = time.perf_counter()
                fn()
                times[name] = min(times[name], time.perf_counter() - start)
        mkl = min(times["F.linear"], times["(W @ x^T)^T"])
        ours = times["kvforge placed"]
        tuned = times["kvforge tuned"]
        rows.append([m] + [f"{times[n] * 1e3:.1f}" for n in fns]
                    + [f"{2 * params * m / tuned / 1e9:.0f}", f"{mkl / tuned:.2f}x",
                       f"{times['kvforge'] / tuned:.2f}x",
                       f"{weight_bytes / ours / 1e9:.1f}", f"{mkl / ours:.2f}x"])
        summary.append(f"M={m} {mkl / tuned:.2f}x / {times['kvforge'] / tuned:.2f}x")
    print(format_table(["M", "F.linear ms", "(W@x^T)^T ms", "default ms", "tuned ms",
                        "packed ms", "placed ms", "tuned GFLOP/s", "best MKL / tuned",
                        "default / tuned", "placed GB/s", "best MKL / placed"], rows))
    pages = "2 MiB" if huge_page_bytes(placed[0]) else "4 KiB (no huge pages granted here)"
    print(f"placed: the packed weights in one buffer in step order, {pages} pages")
    print("tuned plan per row range (" + ("this run's tuning" if tunings else
                                           "none: KVFORGE_TUNE=0, default plans") + "):")
    for line in tune.describe(tunings):
        print("  " + line)
    print(f"kernel machine: {tune.machine_line()}")
    print(hardware_line() + f" | threads {threads}")
    print("SUMMARY linear_kernel: tuned kernel speed-up vs the faster MKL form / vs the "
          "untuned default: " + ", ".join(summary))


if __name__ == "__main__":
    main()
