"""Batch-1 GEMV time of one linear layer per weight format, on the default model's shapes.

    .venv/bin/python benchmarks/quant_kernels.py [--threads 1] [--rounds 15]

For each SmolLM2-135M projection (q|k|v 576->960, o 576->576, gate|up 576->3072, down 1536->576,
LM head 576->49152) and each format, the time of ``Linear.forward`` on one fp32 row (M = 1):
fp32 (UnquantizedLinearMethod), int8 (``_weight_int8pack_mm``), int4 g32/g64/g128
(``_weight_int4pack_mm_for_cpu``), plus the bare int4 g64 kernel on a ready bf16 row (what the
method adds around it is the bf16 casts and bookkeeping). Random weights: the kernels' speed
does not depend on values. Formats are timed round-robin in the same process, median of
``--rounds`` rounds, so background load hits all of them alike: read the ratios.
Ends with one ``SUMMARY quant_kernels:`` line (per decoder layer, the four projections).
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

SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576),
          "lm_head": (576, 49152)}
LAYER = ("qkv", "o", "gate_up", "down")


def build_layers(in_features: int, out_features: int) -> dict:
    from kvforge.layers.linear import Linear
    from kvforge.quant.int4 import Int4LinearMethod
    from kvforge.quant.int8 import Int8LinearMethod
    w = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(0)) * 0.05
    methods = {"fp32": None, "int8": Int8LinearMethod(), "int4-g32": Int4LinearMethod(32),
               "int4-g64": Int4LinearMethod(64), "int4-g128": Int4LinearMethod(128)}
    layers = {}
    for name, method in methods.items():
        layer = Linear(in_features, out_features, method=method)
        layer.load_weight("weight", w)
        layer.process_weights_after_loading()
        layers[name] = layer
    return layers


def time_calls(fns: dict, rounds: int, calls: int) -> dict[str, float]:
    """Median microseconds per call of each fn, timed round-robin."""
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            fn()
            t = time.perf_counter()
            for _ in range(calls):
                fn()
            samples[name].append((time.perf_counter() - t) / calls * 1e6)
    return {k: statistics.median(v) for k, v in samples.items()}


@torch.inference_mode()
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--rounds", type=int, default=15)
    args = p.parse_args(argv)
    setup_threads(args.threads)
    rows, per_layer = [], {}
    for shape_name, (k, n) in SHAPES.items():
        layers = build_layers(k, n)
        x = torch.randn(1, k)
        xb = x.to(torch.bfloat16)
        g64 = layers["int4-g64"]
        fns = {name: (lambda layer=layer: layer(x)) for name, layer in layers.items()}
        fns["int4-g64 kernel"] = lambda: torch._weight_int4pack_mm_for_cpu(
            xb, g64.qweight, 64, g64.scales_zeros)
        us = time_calls(fns, args.rounds, 5 if shape_name == "lm_head" else 100)
        rows.append([f"{shape_name} {k}x{n}"] + [f"{us[f]:.1f}" for f in fns] +
                    [f"{us['fp32'] / us['int4-g64']:.2f}x"])
        if shape_name in LAYER:
            for f, v in us.items():
                per_layer[f] = per_layer.get(f, 0.0) + v
    rows.append(["decoder layer (4)"] + [f"{per_layer[f]:.1f}" for f in fns] +
                [f"{per_layer['fp32'] / per_layer['int4-g64']:.2f}x"])
    print(hardware_line())
    print(format_table(["shape (us per call, M=1)"] + list(fns) + ["fp32 / int4-g64"], rows))
    head = rows[len(SHAPES) - 1]
    print(f"SUMMARY quant_kernels: layer fp32={per_layer['fp32']:.0f}us "
          f"int8={per_layer['int8']:.0f}us int4-g64={per_layer['int4-g64']:.0f}us "
          f"({per_layer['fp32'] / per_layer['int4-g64']:.2f}x) lm_head fp32={head[1]}us "
          f"int8={head[2]}us int4-g32={head[3]}us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
