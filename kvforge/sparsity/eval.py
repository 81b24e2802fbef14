"""``kvforge eval perplexity --activation-sparsity S``: the model's Python layers masked with the
cached (or freshly calibrated) thresholds, and the realised sparsity afterwards."""
from __future__ import annotations

from kvforge.sparsity.cache import load_or_calibrate
from kvforge.sparsity.config import validate_sparsity
from kvforge.sparsity.masking import SparsityMasks, realised_overall


def sparsity_masks(model, source, args) -> SparsityMasks:
    validate_sparsity(args.activation_sparsity, args.activation_sparsity_mode,
                      args.activation_sparsity_allocation, args.activation_sparsity_rotation)
    thresholds = load_or_calibrate(model, source, args.activation_sparsity,
                                   args.activation_sparsity_mode, args.quantization,
                                   args.activation_sparsity_allocation,
                                   rotation=args.activation_sparsity_rotation)
    return SparsityMasks(model, thresholds)


def describe_realised(model, masks: SparsityMasks, args) -> str:
    realised = masks.realised()
    parts = ", ".join(f"{k} {v:.1%}" for k, v in realised.items() if ":" not in k)
    rotated = ("" if args.activation_sparsity_rotation == "none"
               else f" ({args.activation_sparsity_rotation} axes)")
    return (f"activation sparsity {args.activation_sparsity_mode}{rotated} "
            f"S={args.activation_sparsity}: "
            f"realised {parts}; weight reads skipped {realised_overall(model, realised):.1%}")
