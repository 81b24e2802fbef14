"""Early-exit self-speculation (LayerSkip / Kangaroo style): the draft is the target's first E
layers + the trained exit head after layer E (kvforge/exit) + the target's own LM head.

Like the plain self-draft (spec/self_draft.py) it shares every weight and the target's KV
caches for layers < E: a draft row at position p computes exactly what the target computes
there for those layers, and the verification forward of the same step rewrites every slot the
draft wrote. Only the exit differs: head_E(stream_E) instead of the final norm, trained to
predict what the full model would. Verification is the target's, so greedy output is the
target's own (lossless).
"""
from __future__ import annotations

import torch

from kvforge.attention.metadata import AttentionMetadata
from kvforge.exit.heads import ExitHeads
from kvforge.models.layerwise import stream_of
from kvforge.spec.self_draft import SelfDraftModel


class ExitDraftModel(SelfDraftModel):
    def __init__(self, target: torch.nn.Module, heads: ExitHeads, exit_layer: int | None = None
                 ) -> None:
        exit_layer = heads.layers[0] if exit_layer is None else exit_layer
        if exit_layer not in heads.layers:
            raise ValueError(f"no trained exit head after layer {exit_layer}; trained: "
                             f"{heads.layers} (kvforge train-exit-heads --layers ...)")
        super().__init__(target, exit_layer)
        self.head = heads[exit_layer].to(next(target.parameters()).device)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 kv_caches: list[torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        return self.head(stream_of(*self.first_layers(input_ids, positions, kv_caches, meta)))
