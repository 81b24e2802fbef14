"""Self-draft (LayerSkip-style): the first L decoder layers of the target, then its final norm
and LM head. Shares every weight with the target and needs no KV of its own:

    target layer l < L at position p reads only the tokens at positions <= p and the weights of
    layers 0..l, exactly what the draft computes there. So the draft's K/V for layers < L are
    the target's K/V for those layers, and the draft reads/writes the target's caches[:L].

When the draft writes positions T-1..T+k-2 (the last token and its drafts), the verification
forward in the same step rewrites those slots for every layer with the same tokens, so nothing
the draft leaves behind survives; rejected slots are past num_computed_tokens and overwritten
before they are ever read. (The values may differ in the last bits: the draft runs a 1-token
batch, the target a (1 + k)-token one. Only the target's are kept, so greedy output is the
target's own.) An untrained model exits early badly: acceptance is usually low (see README).
"""
from __future__ import annotations

import torch

from kvforge.attention.metadata import AttentionMetadata
from kvforge.models.layerwise import CachedLayers


class SelfDraftModel:
    """Runs ``num_layers`` of a Llama-family or Gemma 3 target (models/layerwise.py)."""

    shares_target_kv = True

    def __init__(self, target: torch.nn.Module, num_layers: int) -> None:
        self.layers = CachedLayers(target, "self-draft")
        total = len(self.layers.stack.layers)
        if not 1 <= num_layers < total:
            raise ValueError(f"self-draft layers must be in [1, {total}), got {num_layers!r}")
        self.target = target
        self.num_layers = num_layers
        self.vocab_size = target.config.vocab_size

    def first_layers(self, input_ids: torch.Tensor, positions: torch.Tensor,
                     kv_caches: list[torch.Tensor], meta: AttentionMetadata
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(hidden, residual) after the target's first ``num_layers`` layers (residual None
        for a family whose layers add their own: models/layerwise.py)."""
        hidden = self.layers.embed(input_ids)
        rope = self.layers.rope(positions, hidden.dtype)
        residual = None
        for j in range(self.num_layers):
            hidden, residual = self.layers.layer(j, hidden, residual, rope[j], kv_caches[j], meta)
        return hidden, residual

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 kv_caches: list[torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        return self.layers.final_norm(*self.first_layers(input_ids, positions, kv_caches, meta))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.target.compute_logits(hidden)
