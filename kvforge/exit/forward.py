"""The early-exit forward of a Llama-family or Gemma 3 stack (lossy, LITE-style).

A row may leave at exit layer E when the exit head's top-1 probability is >= P. Its later
layers are skipped, but later tokens still attend to it there, so each skipped layer gets K/V
computed from the row's residual stream at the exit (CALM's state propagation, limited to what
attention reads: input norm, qkv projection (Gemma 3: and the k norm), rotary, cache write; no
attention, no MLP):

    layer   1 .. E          E+1 .. L
    row     full layers     K/V only from stream_E        output: head_E(stream_E)

Why this rather than copying layer E's K/V upwards: K/V of layer l are projections with layer
l's own weights, so a copy would put layer E's keys into another layer's key space; a
projection of the propagated state stays in each layer's space and costs the qkv product only
(~16% of a SmolLM2 layer). The layers run through ``models/layerwise.py``, which says per
family what the residual stream is and which RoPE each layer takes.

In a batch where some rows have exited and others have not, every layer still runs on all rows
(one forward), with the exited rows' input reset to their frozen stream after each layer: their
K/V are then exactly the K/V-only values above, their other outputs discarded. Once every row
has exited, the remaining layers run K/V only. Rows that may not exit (``eligible`` False:
prefill rows in the engine) run every layer.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvforge.attention.paged import write_kv_cache
from kvforge.exit.heads import ExitHeads
from kvforge.models.layerwise import CachedLayers, set_stream, stream_of


@dataclass
class ExitStats:
    """Layer computations of the rows that could exit (the measure "layers skipped" uses)."""
    num_layers: int
    rows: int = 0
    layers_run: int = 0
    head_checks: int = 0
    exits: dict[int, int] = field(default_factory=dict)   # exit layer -> rows

    @property
    def skipped_fraction(self) -> float:
        return 1.0 - self.layers_run / max(1, self.rows * self.num_layers)


@dataclass
class ExitResult:
    hidden: torch.Tensor                 # [T, d]: head_E output or final-normed hidden
    exited_rows: torch.Tensor            # [n] row indices that left early
    exit_logits: torch.Tensor | None     # [n, V] their logits (the confidence check made them)


def early_exit_forward(layers: CachedLayers, heads: ExitHeads, threshold: float,
                       input_ids: torch.Tensor, positions: torch.Tensor,
                       kv_caches: list[torch.Tensor], meta, eligible: torch.Tensor | None = None,
                       stats: ExitStats | None = None) -> ExitResult:
    """One forward of ``layers.model`` in which eligible rows may leave at a head (module
    doc)."""
    model = layers.model
    hidden = layers.embed(input_ids)
    rope = layers.rope(positions, hidden.dtype)
    num_rows = hidden.shape[0]
    can_exit = (torch.ones(num_rows, dtype=torch.bool, device=hidden.device) if eligible is None
                else eligible.clone())
    exited = torch.zeros_like(can_exit)
    exit_layer = torch.full((num_rows,), model.num_layers, dtype=torch.int64)
    frozen = out = None
    exit_rows, exit_logits = [], []
    residual = None
    for i, cache in enumerate(kv_caches):
        if frozen is not None and bool(exited.all()):
            fill_skipped_kv(layers, i, frozen, rope[i], cache, meta)
            continue
        hidden, residual = layers.layer(i, hidden, residual, rope[i], cache, meta)
        if frozen is not None:                  # exited rows: next input is the frozen stream
            set_stream(hidden, residual, exited, frozen[exited])
        depth = i + 1
        if depth not in heads.layers:
            continue
        rows = (can_exit & ~exited).nonzero().squeeze(1)
        if rows.numel() == 0:
            continue
        stream = stream_of(hidden[rows], None if residual is None else residual[rows])
        z = heads[depth](stream)
        logits = model.compute_logits(z)
        if stats is not None:
            stats.head_checks += rows.numel()
        go = torch.softmax(logits, -1).amax(-1) >= threshold
        if not bool(go.any()):
            continue
        leave = rows[go]
        if frozen is None:
            frozen = torch.zeros_like(hidden)
            out = hidden.new_empty(hidden.shape)
        frozen[leave] = stream[go]
        out[leave] = z[go]
        exited[leave] = True
        exit_layer[leave.cpu()] = depth
        exit_rows.append(leave)
        exit_logits.append(logits[go])
        set_stream(hidden, residual, leave, stream[go])
    if stats is not None:
        counted = exit_layer[can_exit.cpu()]
        stats.rows += counted.numel()
        stats.layers_run += int(counted.sum())
        for e, n in zip(*torch.unique(counted, return_counts=True)):
            if int(e) < model.num_layers:
                stats.exits[int(e)] = stats.exits.get(int(e), 0) + int(n)
    if frozen is None:                          # nobody left early: the plain final norm
        return ExitResult(layers.final_norm(hidden, residual), exited.nonzero().squeeze(1), None)
    rest = ~exited
    if bool(rest.any()):
        out[rest] = layers.final_norm(hidden[rest], None if residual is None else residual[rest])
    return ExitResult(out, torch.cat(exit_rows), torch.cat(exit_logits))


def fill_skipped_kv(layers: CachedLayers, j: int, stream: torch.Tensor, rope: tuple,
                    kv_cache: torch.Tensor, meta) -> None:
    """Write layer j's K/V for every row from the residual ``stream`` (see module doc)."""
    k, v = layers.stream_kv(j, stream, rope)
    write_kv_cache(kv_cache, k, v, meta.slot_mapping)
