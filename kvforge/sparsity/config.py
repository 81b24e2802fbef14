"""Activation-sparsity options: a model-wide target S and the method that reaches it.

- ``teal``: every projection's input (q|k|v, o, gate|up, down) keeps only the entries whose
  magnitude exceeds its layer's threshold, the S-quantile of that input's |x| on calibration
  text; the skipped inputs' weight rows are not read. With rotation ``pca`` gate|up's
  input is thresholded in its principal axes (rotation.py).
- ``cats``: the MLP only: channels with |silu(gate)| at or under the layer's threshold skip
  their row of up and their input of down (gate itself stays dense).
"""
from __future__ import annotations

MODES = ("teal", "cats")
# how TEAL's target spreads over the kinds of projection: the same S for every input
# (uniform), or per kind by a greedy search on calibration text (calibrate.py)
ALLOCATIONS = ("greedy", "uniform")
# teal: threshold the hidden-width inputs as they are, or in their PCA axes (rotation.py)
ROTATIONS = ("none", "pca")
# one threshold per (layer, kind); the kinds each mode thresholds
KINDS = {"teal": ("qkv", "o", "gate_up", "down"), "cats": ("gate",)}


def validate_sparsity(sparsity, mode, allocation: str = "uniform",
                      rotation: str = "none") -> None:
    """Raise ValueError naming the bad value: S in [0, 1) (0 = off), mode teal | cats,
    allocation greedy | uniform, rotation none | pca (teal only)."""
    if isinstance(sparsity, bool) or not isinstance(sparsity, (int, float)):
        raise ValueError(f"activation_sparsity must be a number in [0, 1), got {sparsity!r}")
    if not 0.0 <= float(sparsity) < 1.0:
        raise ValueError(f"activation_sparsity must be in [0, 1) (0 = off), got {sparsity!r}")
    if mode not in MODES:
        raise ValueError(f"activation_sparsity_mode must be one of {', '.join(MODES)}, "
                         f"got {mode!r}")
    if allocation not in ALLOCATIONS:
        raise ValueError(f"activation_sparsity_allocation must be one of "
                         f"{', '.join(ALLOCATIONS)}, got {allocation!r}")
    if rotation not in ROTATIONS:
        raise ValueError(f"activation_sparsity_rotation must be one of {', '.join(ROTATIONS)}, "
                         f"got {rotation!r}")
    if rotation != "none" and mode != "teal":
        raise ValueError(f"activation_sparsity_rotation {rotation!r} rotates TEAL's projection "
                         f"inputs; mode {mode!r} thresholds silu(gate) and takes none")
