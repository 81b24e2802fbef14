"""Thresholds applied to a model's Python layers (forward hooks; Llama family, Gemma 3): the
reference the compiled sparse decode is tested against, and what ``kvforge eval perplexity
--activation-sparsity`` runs (every token masked as a sparse decode step would mask it).

TEAL masks the input of each projection, ``x * (|x| > t)``, or for a rotated input
(rotation.py) its coordinates c = x Q in the principal axes (as the kernel computes them:
rotation.CoordinateRotation) and back, ``(c * (|c| > t)) Q^T``: W of that equals (W Q) times
the masked coordinates, what the decode twin computes. CATS multiplies the MLP's activation
``silu(gate) * up`` by ``|silu(gate)| > t``. Both count what they zero, per kind.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kvforge.sparsity.thresholds import SparsityThresholds

# inputs per quantization block of GGUF's formats (and int4 groups of 32): a block-quantized
# weight can skip only whole blocks, so the masks also count blocks with every input zeroed
GGUF_BLOCK = 32


def gated_projections(model, mode: str = "teal") -> list[dict[str, torch.nn.Module]]:
    """Per layer: the modules whose inputs sparsity thresholds ({qkv, o, gate_up, down, act});
    ValueError for a model without attention (q|k|v, o) + gated-MLP (gate|up, down) layers,
    or, for CATS, whose gate is not SiLU: CATS thresholds |silu(gate)| (Gemma 3's gelu-tanh
    gate takes TEAL only)."""
    from kvforge.layers.activation import GatedActivation
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    out = []
    for i, layer in enumerate(layers or []):
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        names = ("qkv_proj", "o_proj")
        if (attn is None or mlp is None or not all(hasattr(attn, n) for n in names)
                or not hasattr(mlp, "gate_up_proj") or not hasattr(mlp, "down_proj")
                or not isinstance(getattr(mlp, "act_fn", None), GatedActivation)):
            raise ValueError(f"activation sparsity needs layers of q|k|v, o and a gated MLP "
                             f"(gate|up, down); layer {i} of {type(model).__name__} is not")
        if mode == "cats" and mlp.act_fn.act_name not in ("silu", "swish"):
            raise ValueError(f"activation sparsity mode 'cats' thresholds |silu(gate)|; "
                             f"{type(model).__name__} gates its MLP with "
                             f"{mlp.act_fn.act_name!r}: use mode 'teal'")
        out.append({"qkv": attn.qkv_proj, "o": attn.o_proj, "gate_up": mlp.gate_up_proj,
                    "down": mlp.down_proj, "act": mlp.act_fn})
    if not out:
        raise ValueError(f"activation sparsity needs a decoder with layers; "
                         f"{type(model).__name__} has none")
    return out


class SparsityMasks:
    """Hooks that apply ``thresholds`` to every forward of ``model`` until ``remove()`` (or the
    end of a ``with`` block). ``realised()``: the fraction zeroed per kind so far.
    Keys ``<kind>:block32``: the fraction of 32-input blocks whose every input was zeroed.
    ``max_rows``: mask only calls of at most this many rows (tokens), as the engine's sparse
    decode does (prefill stays dense); None: every call."""

    def __init__(self, model, thresholds: SparsityThresholds, max_rows: int | None = None) -> None:
        self.max_rows = max_rows
        layers = gated_projections(model, thresholds.mode)
        if thresholds.num_layers != len(layers):
            raise ValueError(f"thresholds are for {thresholds.num_layers} layers, the model "
                             f"has {len(layers)}")
        self.counts: dict[str, list[int]] = {}      # kind -> [zeroed, total]
        self._handles = []
        for i, mods in enumerate(layers):
            if thresholds.mode == "teal":
                for kind in ("qkv", "o", "gate_up", "down"):
                    self._handles.append(mods[kind].register_forward_pre_hook(
                        self._teal_hook(kind, thresholds.threshold(kind, i),
                                        thresholds.rotation(kind, i))))
            else:
                self._handles.append(mods["act"].register_forward_hook(
                    self._cats_hook(thresholds.threshold("gate", i))))

    def _count(self, kind: str, zeroed: torch.Tensor, total: int) -> None:
        c = self.counts.setdefault(kind, [0, 0])
        c[0] += int(zeroed.sum())
        c[1] += total

    def _teal_hook(self, kind: str, t: float, rotation: torch.Tensor | None = None):
        if rotation is not None:     # the coordinates as the kernel computes them
            from kvforge.sparsity.rotation import CoordinateRotation
            to_coords = CoordinateRotation(rotation)

        def hook(module, args):
            x = args[0]
            if self.max_rows is not None and x.reshape(-1, x.shape[-1]).shape[0] > self.max_rows:
                return None
            if rotation is not None:
                coords = to_coords.coordinates(x)
                keep = coords.abs() > t
                self._count(kind, ~keep, keep.numel())
                back = rotation.to(device=x.device, dtype=x.dtype)
                return ((coords * keep) @ back.T,) + tuple(args[1:])
            keep = x.abs() > t
            self._count(kind, ~keep, keep.numel())
            if x.shape[-1] % GGUF_BLOCK == 0:      # whole 32-input blocks zeroed (GGUF's unit)
                blocks = keep.reshape(-1, GGUF_BLOCK).any(dim=-1)
                self._count(f"{kind}:block{GGUF_BLOCK}", ~blocks, blocks.numel())
            return (x * keep,) + tuple(args[1:])
        return hook

    def _cats_hook(self, t: float):
        def hook(module, args, output):
            if (self.max_rows is not None
                    and output.reshape(-1, output.shape[-1]).shape[0] > self.max_rows):
                return None
            gate = args[0][..., : output.shape[-1]]
            keep = F.silu(gate).abs() > t
            self._count("up", ~keep, keep.numel())
            self._count("down", ~keep, keep.numel())
            return output * keep
        return hook

    def realised(self) -> dict[str, float]:
        return {k: z / n for k, (z, n) in self.counts.items() if n}

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def __enter__(self) -> "SparsityMasks":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def realised_overall(model, realised: dict[str, float]) -> float:
    """The weight-read fraction the zeroed inputs skip, model-wide: each kind's zeroed fraction
    weighted by its projection's weight size (q|k|v, o, gate|up, down; CATS: up and down, up
    being half of gate|up)."""
    mods = gated_projections(model)[0]
    sizes = {k: mods[k].input_size * mods[k].output_size for k in ("qkv", "o", "gate_up", "down")}
    sizes["up"] = sizes["gate_up"] // 2
    total = sum(sizes[k] for k in ("qkv", "o", "gate_up", "down"))
    return sum(sizes[k] * f for k, f in realised.items() if k in sizes) / total
