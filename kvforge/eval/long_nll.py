"""Per-token NLL of one long text, fed in chunks through the paged cache with an optional
attention window: the curve of ``benchmarks/streaming_ppl.py`` (dense vs StreamingLLM).

    ids      t0 t1 ... t(C-1) | tC ... t(2C-1) | ...     chunks of C tokens, one forward each
    scored      t1 ...  tC    | ...                      nll[i] = -log p(t(i+1) | t0..ti)

Each chunk is allocated through a ``KVCacheManager`` with the window, so blocks that leave
the window are released exactly as in the engine (``max_held_blocks`` reports the peak), and
the masks are per token, so the result does not depend on the chunk size.

``decode_ranges`` feeds the positions in each [start, end) one token per forward instead:
decode steps, the only steps a sparse decode backend (QUEST) changes, teacher-forced:

    ids   t0 ... t(a-1) | ta | t(a+1) | ... | t(b-1) | tb ...      range [a, b)
          chunks          one forward per token       chunks again
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvforge.attention.metadata import AttentionMetadata
from kvforge.attention.window import AttentionWindow
from kvforge.attention.windowed import WindowedAttentionBackend
from kvforge.engine.request import Request
from kvforge.kernels import ops as kernel_ops
from kvforge.kvcache.kv_manager import KVCacheManager
from kvforge.sampling_params import SamplingParams


@dataclass
class LongNLL:
    nll: torch.Tensor            # [len(ids) - 1] float64: nll[i] scores ids[i + 1]
    top1: torch.Tensor           # [len(ids) - 1] bool: the argmax at position i is ids[i + 1]
    max_held_blocks: int         # most KV blocks the sequence held at once


def set_window(model: torch.nn.Module, window: AttentionWindow | None,
               allow_none: bool = False) -> int:
    """Give every windowed attention backend of ``model`` this window (None: full attention).
    The model must have been configured with ``configure_attention_window`` (e.g. built by an
    engine with ``attention_sinks`` / ``sliding_window``), unless ``window`` is None and
    ``allow_none``: then a model without windows is left as it is, and so is a model whose
    layers carry their own windows (Gemma 3's sliding layers: ``applies_own_sliding_window``),
    which takes no other window. Returns how many layers it set."""
    if getattr(model, "applies_own_sliding_window", False):
        if window is None and allow_none:
            return 0
        raise ValueError(f"{type(model).__name__} windows its own sliding layers; it takes no "
                         f"other attention window (got {window})")
    backends = [b for m in model.modules() for b in vars(m).values()
                if isinstance(b, WindowedAttentionBackend)]
    if not backends and window is None and allow_none:
        return 0
    if not backends:
        raise ValueError(f"{type(model).__name__} has no windowed attention backend: build it "
                         f"with attention_sinks / sliding_window first")
    for backend in backends:
        backend.window = window
    from kvforge.kernels.decode_stack import sync_stack_attention
    sync_stack_attention(model)          # a built compiled stack takes the new windows too
    return len(backends)


def _forward_spans(num_scored: int, chunk: int,
                   decode_ranges: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """[start, end) of each forward: chunks of ``chunk``, single tokens inside decode ranges."""
    single = set()
    for a, b in decode_ranges:
        if not 0 <= a <= b <= num_scored:
            raise ValueError(f"decode range ({a}, {b}) outside positions 0..{num_scored}")
        single.update(range(a, b))
    spans, start = [], 0
    while start < num_scored:
        if start in single:
            end = start + 1
        else:
            end = min(start + chunk, num_scored)
            end = next((p for p in range(start + 1, end) if p in single), end)
        spans.append((start, end))
        start = end
    return spans


@torch.inference_mode()
def chunked_nll(model: torch.nn.Module, ids: list[int], window: AttentionWindow | None,
                chunk: int = 1024, block_size: int = 16, num_blocks: int | None = None,
                decode_ranges: Sequence[tuple[int, int]] = ()) -> LongNLL:
    """NLL of ``ids[1:]`` with ``window`` on every layer (see ``set_window``); ``num_blocks``
    sizes the cache (default: just enough for the window's live blocks, or the whole text);
    positions in ``decode_ranges`` run as one-token decode steps."""
    if chunk < 1 or len(ids) < 2:
        raise ValueError(f"need chunk >= 1 and at least 2 ids, got chunk={chunk}, {len(ids)} ids")
    spans = _forward_spans(len(ids) - 1, chunk, decode_ranges)   # the last id is only a target
    set_window(model, window, allow_none=True)
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
    top1 = torch.empty(len(ids) - 1, dtype=torch.bool)
    most_held = 0
    for start, end in spans:
        n = end - start
        if kv.allocate_slots(request, n) is None:
            raise ValueError(f"{num_blocks} KV blocks cannot hold a chunk of {n} tokens")
        most_held = max(most_held, kv.num_held_blocks("eval"))
        meta = AttentionMetadata.build([n], [start], [kv.get_block_ids("eval")], block_size,
                                       device)
        hidden = model(tokens[start:end], meta.positions(), caches, meta)
        logits = model.compute_logits(hidden).float()
        targets = tokens[start + 1:end + 1]
        nll[start:end] = torch.nn.functional.cross_entropy(
            logits, targets, reduction="none").double().cpu()
        top1[start:end] = (kernel_ops.argmax_last_dim(logits) == targets).cpu()
        request.num_computed_tokens += n
    kv.free("eval")
    kv.check_integrity()
    return LongNLL(nll, top1, most_held)
