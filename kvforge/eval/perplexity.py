"""Perplexity of a model over a fixed text, by direct forward passes over token windows.

The text is tokenized once and cut into non-overlapping windows of ``window`` tokens
(``max_tokens`` in all); each window is one prefill through a throw-away paged KV cache, and
every position but the window's last predicts the next token:

    window   t0 t1 t2 ... t(W-1)
    scored      t1 t2 ... t(W-1)    NLL = -log p(t(i+1) | t0..ti),  ppl = exp(mean NLL)

Same tokens, windows and order for every model, so numbers compare across quantizations.

``chunk``: run each window as consecutive forwards of ``chunk`` tokens over the same cache
instead of one prefill, so the scores come from the kernels short query runs take (decode-size
steps: e.g. GGUF blocks' integer dot products rather than the prefill's fp32 tiles):

    window   [t0 .. t15][t16 .. t31] ...     chunk i: positions 16i .. 16i+15, context 16i
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvforge.attention.metadata import AttentionMetadata


@dataclass
class PerplexityResult:
    perplexity: float
    mean_nll: float
    num_scored: int
    num_windows: int


@torch.inference_mode()
def forward_in_chunks(model, tokens: torch.Tensor, caches: list[torch.Tensor], block_size: int,
                      chunk: int) -> torch.Tensor:
    """Hidden states of ``tokens`` (one sequence from position 0) as consecutive forwards of
    ``chunk`` tokens over ``caches``, whose blocks 0, 1, ... hold the sequence."""
    table = [list(range(-(-len(tokens) // block_size)))]
    parts = []
    for start in range(0, len(tokens), chunk):
        piece = tokens[start:start + chunk]
        meta = AttentionMetadata.build([len(piece)], [start], table, block_size, tokens.device)
        parts.append(model(piece, meta.positions(), caches, meta))
    return torch.cat(parts)


@torch.inference_mode()
def window_nll(model, ids: list[int], block_size: int = 16,
               chunk: int | None = None) -> tuple[float, int]:
    """Summed NLL of ids[1:] given their prefixes (one prefill, or forwards of ``chunk``
    tokens) and the count scored."""
    device = next(model.parameters()).device
    num_blocks = -(-len(ids) // block_size)
    meta = AttentionMetadata.build([len(ids)], [0], [list(range(num_blocks))], block_size, device)
    dtype = model.kv_cache_dtype() if hasattr(model, "kv_cache_dtype") else model.dtype
    caches = [torch.zeros(model.kv_cache_shape(num_blocks, block_size), dtype=dtype, device=device)
              for _ in range(model.num_layers)]
    tokens = torch.tensor(ids, device=device)
    if chunk is None:
        hidden = model(tokens, meta.positions(), caches, meta)
    else:
        hidden = forward_in_chunks(model, tokens, caches, block_size, chunk)
    logits = model.compute_logits(hidden[:-1]).float()
    nll = torch.nn.functional.cross_entropy(logits, tokens[1:], reduction="sum")
    return float(nll), len(ids) - 1


def perplexity(model, token_ids: list[int], max_tokens: int = 4096, window: int = 512,
               progress: bool = True, chunk: int | None = None) -> PerplexityResult:
    if max_tokens < 2 or window < 2:
        raise ValueError(f"max_tokens and window must be >= 2, got {max_tokens}, {window}")
    if chunk is not None and chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    ids = token_ids[:max_tokens]
    windows = [ids[i:i + window] for i in range(0, len(ids), window)]
    windows = [w for w in windows if len(w) >= 2]
    if not windows:
        raise ValueError(f"the corpus has only {len(ids)} tokens; need at least 2")
    total, count = 0.0, 0
    from tqdm import tqdm
    bar = tqdm(total=sum(len(w) for w in windows), unit="tok", desc="perplexity",
               disable=not progress)
    for w in windows:
        nll, n = window_nll(model, w, chunk=chunk)
        total, count = total + nll, count + n
        bar.update(len(w))
        bar.set_postfix(ppl=f"{math.exp(total / count):.3f}")
    bar.close()
    return PerplexityResult(math.exp(total / count), total / count, count, len(windows))
