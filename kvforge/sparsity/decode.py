"""The compiled decode stack's sparse projections (``kernels/csrc/sparse_gemv.cpp``).

For each layer, a projection whose weights our sparse kernels read gets a transposed
(input-major) copy, so a skipped input channel skips one contiguous row: fp32 weights (plain or
packed) and int8 ones (codes + per-output scales, ``quant/int8.py``). GGUF blocks and other
formats stay dense (docs/activation_sparsity.md: skipping needs whole 32-input blocks, which
magnitude thresholds almost never empty). The stack uses the copies for steps of up to
``sparse_rows_max`` rows (decode, multi-step decoding); prefill and larger batches stay dense,
on the original weights. The copies cost one more weight's worth of memory per covered
projection. A rotated input (rotation.py) gets the copy of W Q and Q^T in the W8A8 kernel's
int8 panels, an integer product the kernel applies to the step's rows before thresholding them
(with the int8 dot ``KVFORGE_INT8_DOT`` picks).
"""
from __future__ import annotations

import logging

import torch

from kvforge.kernels.ops import int8_dot
from kvforge.sparsity.masking import gated_projections
from kvforge.sparsity.rotation import kernel_rotations, rotated_rows
from kvforge.sparsity.thresholds import SparsityThresholds

logger = logging.getLogger(__name__)


def _weight_rows(linear) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(weight [out, in] fp32 or int8, fp32 per-output scales or None), or None for a format
    the sparse kernels do not read."""
    from kvforge.layers.linear import (PackedLinearMethod, UnquantizedLinearMethod,
                                       dense_weight)
    from kvforge.quant.int8 import Int8LinearMethod
    method = linear.method
    if type(method) in (UnquantizedLinearMethod, PackedLinearMethod):
        w = dense_weight(linear)
        return (w, None) if w.dtype == torch.float32 and w.device.type == "cpu" else None
    if type(method) is Int8LinearMethod:
        return linear.qweight.detach(), linear.scales.detach().float()
    return None


def _transposed(weight: torch.Tensor) -> torch.Tensor:
    from kvforge.kernels.huge_pages import huge_page_zeros
    (out,) = huge_page_zeros([tuple(weight.shape[::-1])], weight.dtype, "cpu")
    out.copy_(weight.t())
    return out


def sparse_layers(model, thresholds: SparsityThresholds, ops) -> tuple[list[list], int]:
    """Per layer [qkv, o, gate_up, down, cats] for ``DecodeStack.set_sparsity`` (None where a
    projection stays dense) and how many projections got a sparse copy."""
    layers, covered = [], 0
    # kind -> each layer's compiled x -> x Q (one set of huge-page buffers per kind)
    products = {kind: kernel_rotations(ops, qs) for kind, qs in thresholds.rotations.items()}
    dot = int8_dot() if thresholds.mode == "teal" else None    # the rotations' int8 dot
    for i, mods in enumerate(gated_projections(model, thresholds.mode)):
        entry = [None] * 5
        if thresholds.mode == "teal":
            for slot, kind in enumerate(("qkv", "o", "gate_up", "down")):
                rows = _weight_rows(mods[kind])
                if rows is None:
                    continue
                rotation = thresholds.rotation(kind, i)
                if rotation is not None:
                    rows = rotated_rows(rows[0], rows[1], rotation.float())
                    rotation = products[kind][i]
                bias = mods[kind].bias
                entry[slot] = ops.SparseProjection(
                    _transposed(rows[0]), thresholds.threshold(kind, i), scales=rows[1],
                    bias=None if bias is None else bias.detach().float().contiguous(),
                    rotation=rotation, rotation_dot=dot)
                covered += 1
        else:
            gu, down = _weight_rows(mods["gate_up"]), _weight_rows(mods["down"])
            if gu is not None and down is not None and mods["down"].bias is None \
                    and mods["gate_up"].bias is None:
                entry[4] = ops.CatsMlp(gu[0].contiguous(), _transposed(down[0]),
                                       thresholds.threshold("gate", i), gate_up_scales=gu[1],
                                       down_scales=down[1])
                covered += 2
                # int8 q|k|v and o are Python modules to the stack, which would run the whole
                # step op by op (dense MLP too): give them the sparse kernel at threshold 0
                # (every nonzero input kept: a dense product) so the step runs as one team
                for slot, kind in enumerate(("qkv", "o")):
                    rows = _weight_rows(mods[kind])
                    if rows is not None and rows[1] is not None:
                        bias = mods[kind].bias
                        entry[slot] = ops.SparseProjection(
                            _transposed(rows[0]), 0.0, scales=rows[1],
                            bias=None if bias is None else bias.detach().float().contiguous())
        layers.append(entry)
    return layers, covered


def why_dense(model, mode: str) -> str | None:
    """Why ``model``'s decode steps could not run sparse (no compiled stack, or no projection
    in a format the sparse kernels read), or None: what the engine checks before it spends a
    calibration on thresholds nothing would use."""
    from kvforge.kernels import cpu_kernels
    if cpu_kernels() is None or not hasattr(model, "decode_stack") or model.decode_stack() is None:
        return "activation sparsity needs the compiled decode stack"
    kinds = ("gate_up", "down") if mode == "cats" else ("qkv", "o", "gate_up", "down")
    for mods in gated_projections(model, mode):
        readable = [_weight_rows(mods[k]) is not None for k in kinds]
        if all(readable) if mode == "cats" else any(readable):
            return None
    return ("no projection of this model has weights the sparse kernels read (fp32, int8; "
            "GGUF blocks decode dense: --quantization none or int8 runs them sparse)")


def enable_sparse_decode(model, thresholds: SparsityThresholds) -> int:
    """Give ``model``'s compiled decode stack its sparse projections; returns how many
    projections run sparse (0: no stack, or no projection our sparse kernels read)."""
    from kvforge.kernels import cpu_kernels
    reason = why_dense(model, thresholds.mode)
    if reason is not None:
        logger.warning("%s; decoding dense", reason)
        return 0
    ops = cpu_kernels()
    layers, covered = sparse_layers(model, thresholds, ops)
    if covered == 0:                    # CATS over biased MLPs: none of its twins apply
        logger.warning("no projection of this model runs sparse; decoding dense")
        return 0
    model.decode_stack().set_sparsity(layers, ops.sparse_rows_max)
    return covered


def disable_sparse_decode(model) -> None:
    stack = model.decode_stack() if hasattr(model, "decode_stack") else None
    if stack is not None:
        stack.set_sparsity([], 0)
