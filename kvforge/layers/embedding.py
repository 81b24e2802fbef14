"""Token embedding tables created without initial values.

``nn.Embedding`` fills its table from a normal distribution when built; every model here loads
the table right after (or replaces it: ``--quantization gguf`` keeps the file's blocks), so
that fill only cost time and memory: ~2 s and ~0.9 GB of touched pages for a 152k x 1536
table, counted in the process's peak RSS. ``torch.empty`` pages stay untouched until loaded.
"""
from __future__ import annotations

import torch
from torch import nn


def uninitialized_embedding(num_embeddings: int, embedding_dim: int, dtype: torch.dtype,
                            device: torch.device | str) -> nn.Embedding:
    weight = torch.empty(num_embeddings, embedding_dim, dtype=dtype, device=device)
    return nn.Embedding(num_embeddings, embedding_dim, _weight=weight, _freeze=True)
