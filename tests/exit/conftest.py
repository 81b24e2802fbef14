"""Factories for the exit tests: a tiny random Llama, its fp32 model, and exit heads saved where
the engine looks for them (a private cache dir per test session)."""
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


@pytest.fixture(scope="module")
def tiny_path(tiny_model_factory):
    path, _ = tiny_model_factory("llama", num_hidden_layers=NUM_LAYERS)
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
