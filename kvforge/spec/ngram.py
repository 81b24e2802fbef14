"""Prompt-lookup (n-gram) proposer: no model, no KV.

Find the longest suffix of the request's prompt + output (up to ``max_n`` tokens, at least
``min_n``) that occurred earlier, take its latest occurrence, and propose the tokens that
followed it:

    tokens:  a b c d x y a b c  ?        longest earlier match of the suffix: "a b c" (n = 3)
             ^^^^^ match at 0 (not the suffix itself)
    propose: tokens[3 : 3 + k] = d x y

Why the longest and not a short fixed n: where an answer copies its prompt (an edited class,
a quoted text) short n-grams recur all over it ("self", ", name"), and the latest of them is
often in another place than the one being copied; the longest match is the copied place. Its
length also says how much to trust the guess (spec/decoder.py keeps acceptance per length).

Search: the positions holding the last token are the candidates for n = 1; each round keeps
those whose preceding token also matches the suffix's (n + 1), until none is left or n = max_n:

    suffix     ... a b c          candidates (match ends)   n
    c at        2, 5, 9            -> 3 positions            1
    b before    2, 9               -> 2                      2
    a before    2                  -> 1                      3   propose after position 2
"""
from __future__ import annotations

import numpy as np

from kvforge.spec.base import TokenProposer


class NgramProposer(TokenProposer):
    def __init__(self, min_n: int = 1, max_n: int = 32) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n!r}, max_n={max_n!r}")
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, token_ids: list[int], max_tokens: int) -> list[int]:
        return self.propose_matched(token_ids, max_tokens)[0]

    def propose_matched(self, token_ids: list[int], max_tokens: int) -> tuple[list[int], int]:
        """(guess, n): the tokens after the latest occurrence of the longest earlier match of
        the suffix, and that match's length n (([], 0) without a match of >= min_n)."""
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens!r}")
        num = len(token_ids)
        if num < self.min_n + 1:
            return [], 0
        tokens = np.asarray(token_ids, dtype=np.int64)
        # ends[i]: a position < num - 1 where an earlier copy of the suffix's last n tokens ends
        ends = np.flatnonzero(tokens[:-1] == tokens[-1])
        n = 1
        while ends.size and n < min(self.max_n, num - 1):
            before = ends - n                   # the token n before each end
            kept = ends[before >= 0]
            kept = kept[tokens[kept - n] == tokens[num - 1 - n]]
            if not kept.size:
                break
            ends, n = kept, n + 1
        if not ends.size or n < self.min_n:
            return [], 0
        start = int(ends[-1]) + 1                   # the latest occurrence wins
        return tokens[start:start + max_tokens].tolist(), n
