"""Prompt-lookup (n-gram) proposer: no model, no KV.

Find the latest earlier occurrence of the last n tokens (n from ``max_n`` down to ``min_n``) in
the request's prompt + output and propose the tokens that followed it:

    tokens:  a b c d x y a b c  ?        last n = 3: "a b c"
             ^^^^^ match at i = 0 (not the suffix itself)
    propose: tokens[i + n : i + n + k] = d x y
"""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from kvforge.spec.base import TokenProposer


class NgramProposer(TokenProposer):
    def __init__(self, min_n: int = 1, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n!r}, max_n={max_n!r}")
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, token_ids: list[int], max_tokens: int) -> list[int]:
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens!r}")
        num = len(token_ids)
        if num < self.min_n + 1:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, num - 1), self.min_n - 1, -1):
            # windows starting at 0 .. num - n - 1: each has at least one token after it
            windows = sliding_window_view(tokens[:-1], n)
            hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n                     # latest occurrence wins
                return tokens[start:start + max_tokens].tolist()
        return []
