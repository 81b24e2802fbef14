"""Per-token NLL of one long text, fed in chunks through the paged cache with an optional
attention window: the curve of ``benchmarks/streaming_ppl.py`` (dense vs StreamingLLM).

    ids      t0 t1 ... t(C-1) | tC ... t(2C-1) | ...     chunks of C tokens, one forward each
    scored      t1 ...  tC    | ...                      nll[i] = -log p(t(i+1) | t0..ti)

Each chunk is allocated through a ``KVCacheManager`` with the window, so blocks that leave
the window are released exactly as in the engine (``max_held_blocks`` reports the peak), and
the masks are per token, so the result does not depend on the chunk size.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvforge.attention.metadata import AttentionMetadata
from kvforge.attention.window import AttentionWindow
from kvforge.attention.windowed import WindowedAttentionBackend
from kvforge.engine.request import Request
from kvforge.kvcache.kv_manager import KVCacheManager
from kvforge.sampling_params import SamplingParams


@dataclass
class LongNLL:
    nll: torch.Tensor            # [len(ids) - 1] float64: nll[i] scores ids[i + 1]
    max_held_blocks: int         # most KV blocks the sequence held at once


def set_window(model: torch.nn.Module, window: AttentionWindow | None) -> int:
    """Give every windowed attention backend of ``model`` this window (None: full attention).
    The model must have been configured with ``configure_attention_window`` (e.g. built by an
    engine with ``attention_sinks`` / ``sliding_window``). Returns how many layers it set."""
    backends = [b for m in model.modules() for b in vars(m).values()
                if isinstance(b, WindowedAttentionBackend)]
    if not backends:
        raise ValueError(f"{type(model).__name__} has no windowed attention backend: build it "
                         f"with attention_sinks / sliding_window first")
    for backend in backends:
        backend.window = window
    return len(backends)


@torch.inference_mode()
def chunked_nll(model: torch.nn.Module, ids: list[int], window: AttentionWindow | None,
                chunk: int = 1024, block_size: int = 16,
                num_blocks: int | None = None) -> LongNLL:
    """NLL of ``ids[1:]`` with ``window`` on every layer (see ``set_window``); ``num_blocks``
    sizes the cache (default: just enough for the window's live blocks, or the whole text)."""
    if chunk < 1 or len(ids) < 2:
        raise ValueError(f"need chunk >= 1 and at least 2 ids, got chunk={chunk}, {len(ids)} ids")
    set_window(model, window)
    if num_blocks is None:
        num_blocks = (window.max_live_blocks(block_size, chunk) if window is not None
                      else -(-len(ids) // block_size))
    device = next(model.parameters()).device
    kv = KVCacheManager(num_blocks, block_size, window=window)
    request = Request("eval", ids, SamplingParams())
    caches = [torch.zeros(model.kv_cache_shape(num_blocks, block_size),
                          dtype=model.kv_cache_dtype(), device=device)
              for _ in range(model.num_layers)]
    tokens = torch.tensor(ids, device=device)
    nll = torch.empty(len(ids) - 1, dtype=torch.float64)
    most_held = 0
    for start in range(0, len(ids) - 1, chunk):
        n = min(chunk, len(ids) - 1 - start)       # the last token is only ever a target
        if kv.allocate_slots(request, n) is None:
            raise ValueError(f"{num_blocks} KV blocks cannot hold a chunk of {n} tokens")
        most_held = max(most_held, kv.num_held_blocks("eval"))
        meta = AttentionMetadata.build([n], [start], [kv.get_block_ids("eval")], block_size,
                                       device)
        hidden = model(tokens[start:start + n], meta.positions(), caches, meta)
        logits = model.compute_logits(hidden).float()
        nll[start:start + n] = torch.nn.functional.cross_entropy(
            logits, tokens[start + 1:start + n + 1], reduction="none").double().cpu()
        request.num_computed_tokens += n
    kv.free("eval")
    kv.check_integrity()
    return LongNLL(nll, most_held)
