"""Factories for the exit tests: a tiny random Llama and Gemma 3, the fp32 model, and exit
heads saved where the engine looks for them (a private cache dir per test session)."""
from __future__ import annotations

import pytest

from kvforge.exit.heads import ExitHeads
from kvforge.exit.store import heads_dir, save_heads

NUM_LAYERS = 4


@pytest.fixture(autouse=True)
def _private_heads_cache(tmp_path_factory, monkeypatch):
    """Heads go to a per-session directory, never ~/.cache/kvforge (only the heads: moving
    KVFORGE_CACHE_DIR would also move, and rebuild, the compiled kernels)."""
    from kvforge.exit import store
    root = tmp_path_factory.getbasetemp() / "exit_heads"
    monkeypatch.setattr(store, "cache_root", lambda: root)


# Gemma 3: sliding (window 8) and global layers with their own RoPE bases, four norms a layer,
# a scaled embedding and a soft-capped head; the prompts of the tests outrun the window
GEMMA3 = dict(head_dim=16, sliding_window=8, query_pre_attn_scalar=16,
              layer_types=["sliding_attention", "full_attention"] * (NUM_LAYERS // 2),
              final_logit_softcapping=5.0)


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def tiny_path(request, tiny_model_factory):
    """A tiny random model of each family early exit runs (models/layerwise.py)."""
    extra = GEMMA3 if request.param == "gemma3" else {}
    path, _ = tiny_model_factory(request.param, num_hidden_layers=NUM_LAYERS, **extra)
    return path


@pytest.fixture
def tiny_fp32(tiny_path):
    from kvforge.loader.source import load_model_source
    from kvforge.quant.loading import load_model
    source = load_model_source(tiny_path)
    return source, load_model(source, quantization="none").eval()


@pytest.fixture
def saved_heads(tiny_path, tiny_fp32):
    """Heads after layers 1 and 2, the identity adapters slightly perturbed (a seeded nudge,
    so a head is not the plain final norm), saved for ``tiny_path``."""
    import torch
    _, model = tiny_fp32
    heads = ExitHeads.for_model(model, [1, 2])
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=gen))
    save_heads(heads, heads_dir(tiny_path), {"test": True})
    return heads
