"""The batch's allowed-token masks: llguidance fills a packed bitmask, the sampler applies it.

    bitmask [R, ceil(V / 32)] int32, one row per constrained request of the batch:
            bit t % 32 of word t // 32 set = token t allowed
    rows    [R] the batch rows they belong to; unconstrained rows are left alone

Filling runs in llguidance's native code without the GIL; several constrained rows fill in
parallel on its thread pool.
"""
from __future__ import annotations

import math

import torch

from kvforge.structured.matcher import GrammarMatcher

_executor = None


def _parallel_executor():
    global _executor
    if _executor is None:
        import llguidance
        _executor = llguidance.LLExecutor(num_threads=max(1, torch.get_num_threads()))
    return _executor


def fill_token_bitmask(matchers: list[GrammarMatcher | None],
                       vocab_size: int) -> tuple[list[int], torch.Tensor]:
    """(batch rows with a matcher, their [R, ceil(V / 32)] int32 bitmask)."""
    rows = [i for i, m in enumerate(matchers) if m is not None]
    bitmask = torch.empty((len(rows), (vocab_size + 31) // 32), dtype=torch.int32)
    live = [(matchers[i], j) for j, i in enumerate(rows)]
    healthy = [(m.ll_matcher, i) for m, i in live if not m.is_error]
    if len(healthy) > 1:
        _parallel_executor().unsafe_compute_mask_ptr(healthy, bitmask.data_ptr(),
                                                     bitmask.shape[1] * 4, bitmask.shape[0])
        for m, i in live:
            if m.is_error:
                m.fill_eos_only(bitmask, i)
    else:
        for m, i in live:
            m.fill(bitmask, i)
    return rows, bitmask


_BIT_SHIFTS: dict[torch.device, torch.Tensor] = {}


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int, device) -> torch.Tensor:
    """[B, V] bool from the packed bitmask."""
    device = torch.device(device)
    shifts = _BIT_SHIFTS.get(device)
    if shifts is None:
        shifts = _BIT_SHIFTS[device] = torch.arange(32, dtype=torch.int32, device=device)
    bits = (bitmask.to(device).unsqueeze(-1) >> shifts) & 1
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_token_bitmask(logits: torch.Tensor, rows: list[int],
                        bitmask: torch.Tensor) -> torch.Tensor:
    """Disallowed tokens of the listed rows -> -inf (out of place)."""
    allowed = allowed_tokens(bitmask, logits.shape[1], logits.device)
    if len(rows) == logits.shape[0]:
        return logits.masked_fill(~allowed, -math.inf)
    index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
    logits = logits.clone()
    logits[index] = logits[index].masked_fill(~allowed, -math.inf)
    return logits


def apply_grammars(logits: torch.Tensor, matchers: list[GrammarMatcher | None]) -> torch.Tensor:
    """The sampler's grammar stage: each constrained row keeps only the tokens its grammar
    allows next."""
    rows, bitmask = fill_token_bitmask(matchers, logits.shape[1])
    return apply_token_bitmask(logits, rows, bitmask)
