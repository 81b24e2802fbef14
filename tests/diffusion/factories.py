"""Tiny random masked-diffusion models for the diffusion tests."""
from __future__ import annotations

import torch

from kvforge.models.diffusion_config import DiffusionLMConfig
from kvforge.models.diffusion_lm import MaskedDiffusionLM

VOCAB = 64
MASK_ID = 63


def tiny_config(layout: str = "llada", **overrides) -> DiffusionLMConfig:
    fields = dict(vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                  intermediate_size=48, mask_token_id=MASK_ID, max_position=256,
                  qkv_bias=layout == "dream")
    fields.update(overrides)
    return DiffusionLMConfig(layout, **fields)


def tiny_model(layout: str = "llada", seed: int = 0, **overrides) -> MaskedDiffusionLM:
    model = MaskedDiffusionLM(tiny_config(layout, **overrides))
    # std 0.3: logits spread enough that argmaxes and top-k orders have no near-ties
    model.init_weights(torch.Generator().manual_seed(seed), std=0.3)
    # a trained model never predicts the mask (it is never a target); a random one would, and
    # LLaDA's generate would then commit it where ours proposes the runner-up
    model.register_forward_hook(lambda module, args, logits: logits.index_fill_(
        -1, torch.tensor([MASK_ID]), float("-inf")))
    return model.eval().requires_grad_(False)
