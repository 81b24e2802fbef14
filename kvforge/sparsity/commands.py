"""CLI: ``--activation-sparsity S`` / ``--activation-sparsity-mode`` (engine commands and
``kvforge eval perplexity``) and ``kvforge calibrate-sparsity [MODEL] --activation-sparsity S``."""
from __future__ import annotations

import argparse

from kvforge.sparsity.config import ALLOCATIONS, MODES, ROTATIONS


def add_sparsity_args(p) -> None:
    p.add_argument("--activation-sparsity", type=float, default=0.0, metavar="S",
                   help="decode steps skip the weights of the smallest activations: a "
                        "model-wide target fraction in [0, 1) (0 = off; thresholds calibrated "
                        "once per model and S, then cached)")
    p.add_argument("--activation-sparsity-mode", default="teal", choices=list(MODES),
                   help="teal: every projection's input; cats: the MLP, by |silu(gate)|")
    p.add_argument("--activation-sparsity-allocation", default="greedy",
                   choices=list(ALLOCATIONS),
                   help="teal: per kind of projection by a greedy search on calibration text "
                        "(S = fraction of the layers' weights skipped), or S for every input")
    p.add_argument("--activation-sparsity-rotation", default="none", choices=list(ROTATIONS),
                   help="teal: pca thresholds gate|up's input in its principal axes (far "
                        "less quality lost at S >= 0.4, for a d x d product per layer and step)")


def cmd_calibrate(args: argparse.Namespace) -> int:
    from kvforge.quant.commands import _load
    from kvforge.sparsity.cache import cache_path, load_or_calibrate
    from kvforge.sparsity.config import validate_sparsity
    validate_sparsity(args.activation_sparsity, args.activation_sparsity_mode,
                      args.activation_sparsity_allocation, args.activation_sparsity_rotation)
    if args.activation_sparsity <= 0:
        raise ValueError(f"calibrate-sparsity needs --activation-sparsity in (0, 1), got "
                         f"{args.activation_sparsity}")
    source, model = _load(args)
    t = load_or_calibrate(model, source, args.activation_sparsity, args.activation_sparsity_mode,
                          args.quantization, args.activation_sparsity_allocation,
                          recalibrate=True, rotation=args.activation_sparsity_rotation)
    path = cache_path(t.calibration["model"], t.mode, t.sparsity, t.calibration["allocation"],
                      args.activation_sparsity_rotation)
    levels = ", ".join(f"{k} {v:.2f}" for k, v in t.calibration["levels"].items())
    print(f"levels ({t.calibration['allocation']}): {levels}")
    for kind, values in t.layers.items():
        print(f"{kind:8s} thresholds: min {min(values):.4g}  median "
              f"{sorted(values)[len(values) // 2]:.4g}  max {max(values):.4g}  "
              f"({len(values)} layers)")
    print(f"cached at {path}")
    return 0


def add_calibrate_command(sub) -> None:
    from kvforge.quant.commands import _model_args
    p = sub.add_parser("calibrate-sparsity",
                       help="calibrate activation-sparsity thresholds for a model and cache them")
    _model_args(p, positional=True)
    add_sparsity_args(p)
    p.set_defaults(func=cmd_calibrate)
