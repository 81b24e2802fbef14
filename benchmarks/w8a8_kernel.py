"""ZeroQuant's W8A8 projection per layer shape: the compiled kernel (each int8 dot this CPU
has) against the fp32 layer it replaces and against the per-group PyTorch path.

    .venv/bin/python benchmarks/w8a8_kernel.py [--rows 1,32,256] [--group-size 128]
        [--rounds 9] [--threads N]

Shapes: the fused projections of SmolLM2-135M (q|k|v 576->960, o 576->576, gate|up 576->3072,
down 1536->576) and Qwen2.5-1.5B (q|k|v 1536->2048, o 1536->1536, gate|up 1536->17920, down
8960->1536). Columns, microseconds per ``Linear.forward`` on fp32 rows (median of ``--rounds``
round-robin rounds, so background load hits every column alike): fp32 (the engine's float
layer: tuned kernels or MKL), zeroquant through PyTorch (one integer or exact fp32 GEMM per
group), the kernel with maddubs (AVX2's sign trick; every AVX2 CPU) and with VNNI where the CPU
has it. Random weights and activations: the kernels' speed does not depend on values.
Ends with one ``SUMMARY w8a8_kernel:`` line (fp32 time over the best kernel's, summed over the
shapes of each model at each row count).
"""
from __future__ import annotations

import argparse
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

SHAPES = {"135M": {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072),
                   "down": (1536, 576)},
          "1.5B": {"qkv": (1536, 2048), "o": (1536, 1536), "gate_up": (1536, 17920),
                   "down": (8960, 1536)}}


def build_layers(in_features: int, out_features: int, group_size: int) -> tuple[dict, list]:
    """name -> callable(x) for fp32, zeroquant via PyTorch and via each kernel dot."""
    from kvforge.kernels import ops
    from kvforge.layers.linear import Linear
    from kvforge.quant.zeroquant import ZeroQuantLinearMethod
    w = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(0)) * 0.05

    def layer(method=None):
        built = Linear(in_features, out_features, method=method)
        built.load_weight("weight", w)
        built.process_weights_after_loading()
        return built

    in_torch = ZeroQuantLinearMethod(group_size, True)
    in_torch.use_kernel = False
    fns = {"fp32": layer(), "zeroquant PyTorch": layer(in_torch)}
    kernels = []
    module = ops.cpu_kernels()
    if module is not None:
        rows = in_torch.export_rows(fns["zeroquant PyTorch"])
        panels = ops.pack_w8a8_panels(rows.q, rows.scale)
        projection = ops.w8a8_projection(*panels, out_features, in_features)
        for name, dot in ops.INT8_DOTS.items():
            if module.int8_dot_supported(dot):
                label = f"kernel {name}"
                fns[label] = lambda x, d=dot: projection.forward(x, True, d)
                kernels.append(label)
    return fns, kernels


def time_calls(fns: dict, x: torch.Tensor, rounds: int, calls: int) -> dict[str, float]:
    """Median microseconds per call of each fn on x, timed round-robin."""
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            fn(x)
            t = time.perf_counter()
            for _ in range(calls):
                fn(x)
            samples[name].append((time.perf_counter() - t) / calls * 1e6)
    return {k: statistics.median(v) for k, v in samples.items()}


@torch.inference_mode()
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,32,256", help="comma list of activation rows")
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    setup_threads(args.threads)
    row_counts = [int(r) for r in args.rows.split(",")]
    table, totals, columns = [], {}, None
    for model, shapes in SHAPES.items():
        for shape_name, (k, n) in shapes.items():
            fns, kernels = build_layers(k, n, args.group_size)
            columns = list(fns)
            for m in row_counts:
                x = torch.randn(m, k)
                calls = max(1, int(2e5 // (m * k * n / 1e3 + 1)))
                us = time_calls(fns, x, args.rounds, min(calls, 50))
                best = min(kernels, key=us.get) if kernels else "zeroquant PyTorch"
                table.append([model, f"{shape_name} {k}x{n}", m] + [f"{us[c]:.0f}" for c in fns]
                             + [f"{us['fp32'] / us[best]:.2f}x"])
                total = totals.setdefault((model, m), {"fp32": 0.0, "best": 0.0})
                total["fp32"] += us["fp32"]
                total["best"] += us[best]
    print(hardware_line())
    print(f"group_size {args.group_size}, activations per token and group")
    print(format_table(["model", "shape", "rows"] + columns + ["fp32 / best kernel"], table))
    summary = ", ".join(f"{model} rows {m}: {t['fp32'] / t['best']:.2f}x"
                        for (model, m), t in totals.items())
    print(f"SUMMARY w8a8_kernel: fp32 time / W8A8 kernel time per decoder layer's projections: "
          f"{summary}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
