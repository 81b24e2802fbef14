"""The batch's allowed-token masks: llguidance fills a packed bitmask, the sampler applies it.

    bitmask [R, ceil(V / 32)] int32, one row per constrained request of the batch:
            bit t % 32 of word t // 32 set = token t allowed
    rows    [R] the batch rows they belong to; unconstrained rows are left alone

Filling runs in llguidance's native code without the GIL; several constrained rows fill in
parallel on its thread pool.
"""
from __future__ import annotations

import math

import numpy as np
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
# bit value -> what it adds to a logit: unpacked bits index it, giving the additive mask
_BIAS_BY_BIT = np.array([-np.inf, 0.0], dtype=np.float32)


def _unpacked_bits(bitmask: torch.Tensor, vocab_size: int) -> np.ndarray:
    """[R, V] uint8 0/1 (little-endian bit order within each int32 word, as llguidance writes)."""
    return np.unpackbits(bitmask.contiguous().numpy().view(np.uint8), axis=1, count=vocab_size,
                         bitorder="little")


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int, device) -> torch.Tensor:
    """[R, V] bool from the packed bitmask."""
    device = torch.device(device)
    if device.type == "cpu":
        return torch.from_numpy(_unpacked_bits(bitmask, vocab_size)).bool()
    shifts = _BIT_SHIFTS.get(device)
    if shifts is None:
        shifts = _BIT_SHIFTS[device] = torch.arange(32, dtype=torch.int32, device=device)
    bits = (bitmask.to(device).unsqueeze(-1) >> shifts) & 1
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def _additive_mask(bitmask: torch.Tensor, vocab_size: int, device) -> torch.Tensor:
    """[R, V] float32: 0 where allowed, -inf where not. On CPU a table lookup of the unpacked
    bits: adding it costs ~1/3 of a masked_fill with a bool mask (measured on 49k and 152k)."""
    if torch.device(device).type == "cpu":
        return torch.from_numpy(np.take(_BIAS_BY_BIT, _unpacked_bits(bitmask, vocab_size)))
    allowed = allowed_tokens(bitmask, vocab_size, device)
    return torch.zeros(allowed.shape, device=device).masked_fill_(~allowed, -math.inf)


def apply_token_bitmask(logits: torch.Tensor, rows: list[int],
                        bitmask: torch.Tensor) -> torch.Tensor:
    """Disallowed tokens of the listed rows -> -inf (out of place)."""
    mask = _additive_mask(bitmask, logits.shape[1], logits.device)
    if len(rows) == logits.shape[0]:
        return logits + mask
    index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
    logits = logits.clone()
    logits[index] += mask
    return logits


def apply_grammars(logits: torch.Tensor, matchers: list[GrammarMatcher | None]) -> torch.Tensor:
    """The sampler's grammar stage: each constrained row keeps only the tokens its grammar
    allows next."""
    rows, bitmask = fill_token_bitmask(matchers, logits.shape[1])
    return apply_token_bitmask(logits, rows, bitmask)
