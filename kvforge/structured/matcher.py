"""GrammarMatcher: one sequence's position in its grammar.

The engine gives every constrained sequence its own matcher (n > 1: one per sample) and keeps it
on the Request, so preemption (recompute or swap) keeps it too: the outputs it has consumed stay
the request's outputs. Per step: ``fill`` writes the allowed next tokens into a bitmask row
before sampling; the engine then ``consume``s each token the request accepted.
"""
from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)


class GrammarMatcher:
    def __init__(self, ll_matcher, eos_token_ids: tuple[int, ...]) -> None:
        self._m = ll_matcher
        self._eos_token_ids = eos_token_ids
        self.num_consumed = 0

    @property
    def ll_matcher(self):
        return self._m

    @property
    def is_error(self) -> bool:
        return self._m.is_error()

    @property
    def is_accepting(self) -> bool:
        """The output so far is a complete match."""
        return self._m.is_accepting()

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Row ``row`` of ``bitmask`` [B, ceil(V / 32)] int32 := the allowed next tokens.

        A matcher in error (a token it refused was forced on it) allows only EOS, so the
        sequence ends instead of sampling from an empty distribution."""
        if self._m.is_error():
            self.fill_eos_only(bitmask, row)
            return
        v = bitmask[row]
        self._m.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * v.element_size())

    def fill_eos_only(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row] = 0
        for t in self._eos_token_ids:
            bitmask[row, t // 32] |= _bit(t % 32)

    def consume(self, token_id: int) -> bool:
        """Advance over a sampled token; False (and an error state) if the grammar refuses it."""
        ok = self._m.consume_token(token_id)
        if ok:
            self.num_consumed += 1
        else:
            logger.warning("grammar refused sampled token %d: %s", token_id, self._m.get_error())
        return ok


def _bit(i: int) -> int:
    # bit 31 of an int32 is its sign bit
    return (1 << i) - (1 << 32 if i == 31 else 0)
