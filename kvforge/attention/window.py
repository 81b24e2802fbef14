"""Attention windows: StreamingLLM sinks + a sliding window, or a model's own sliding window.

Which keys a query sees (S = sinks, W = window; W counts the query itself, HF's
``kv_idx > q_idx - sliding_window`` convention)::

    key k is visible to query p  iff  k <= p  and  (k < S  or  k > p - W)

    p = 9, S = 2, W = 4     keys  0 1 2 3 4 5 6 7 8 9
                                  s s . . . . w w w w        (6 keys: 2 sinks + 4 window)

Positions. ``"true"`` (a native sliding window, Mistral / Qwen2): nothing is remapped.
``"in_cache"`` (StreamingLLM): the S + W cached entries are read as if they sat at positions
0 .. S+W-1, the query at ``c(p) = min(p, S+W-1)``, sink j at j and window key k at
``k - p + c(p)``. RoPE scores depend only on the query-key distance, so window keys keep their
true distance ``p - k`` and only sinks change, from ``p - j`` to ``c(p) - j``: the keys stay
rotated at their true positions in the normal paged cache and the sink scores use the query
rotated back by ``sink_shift(p) = p - c(p) = max(0, p - (S + W - 1))``. Distances therefore
never exceed S + W - 1, whatever p is, which keeps the model inside its trained context.

Blocks (B tokens each). Block i holds positions [iB, (i+1)B). Once the next query is at
``next_pos`` (queries only move forward), a block is dead for good when it holds no sink
(iB >= S) and its last position is before the window of next_pos:
(i+1)B - 1 <= next_pos - W  <=>  i < (next_pos - W + 1) // B::

    S = 2, W = 6, B = 4, next_pos = 14        window of 14 = 9 .. 14
    block  0: 0-3  1: 4-7  2: 8-11  3: 12-15
           sinks   dead    live     live       dead_blocks = range(ceil(2/4), (14-6+1)//4)
                                                           = range(1, 2)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

POSITION_MODES = ("in_cache", "true")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True, slots=True)
class AttentionWindow:
    """Sinks + sliding window of one attention layer, validated on creation.

    - ``sinks``: the first ``sinks`` positions stay visible to every query (>= 0).
    - ``window``: the last ``window`` positions up to and including the query (>= 1).
    - ``positions``: ``"in_cache"`` (StreamingLLM distances for sinks, see the module
      docstring) or ``"true"`` (native sliding window).
    """

    sinks: int
    window: int
    positions: str = "in_cache"

    def __post_init__(self) -> None:
        for name, low in (("sinks", 0), ("window", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"attention window {name} must be an integer >= {low}, "
                                 f"got {value!r}")
        if self.positions not in POSITION_MODES:
            raise ValueError(f"attention window positions must be one of {POSITION_MODES}, "
                             f"got {self.positions!r}")

    @property
    def span(self) -> int:
        """Most keys one query sees (S + W): also the largest in-cache distance + 1."""
        return self.sinks + self.window

    @property
    def shifts_sinks(self) -> bool:
        return self.positions == "in_cache" and self.sinks > 0

    # ---- masks and positions (tensors broadcast against each other) -----------------------
    def visible(self, query_pos: torch.Tensor, key_pos: torch.Tensor) -> torch.Tensor:
        """Bool mask: key position visible to query position."""
        in_window = key_pos > query_pos - self.window
        return (key_pos <= query_pos) & ((key_pos < self.sinks) | in_window)

    def sink_shift(self, query_pos: torch.Tensor) -> torch.Tensor:
        """How far back to rotate a query for its sink scores (0 with true positions)."""
        if not self.shifts_sinks:
            return torch.zeros_like(query_pos)
        return (query_pos - (self.span - 1)).clamp(min=0)

    def max_sink_shift(self, last_query_pos: int) -> int:
        """``sink_shift`` of the last query of a step as a host int (0: no rotation needed)."""
        return max(0, last_query_pos - (self.span - 1)) if self.shifts_sinks else 0

    # ---- blocks ------------------------------------------------------------------------------
    def num_sink_blocks(self, block_size: int) -> int:
        return _cdiv(self.sinks, block_size)

    def dead_blocks(self, next_pos: int, block_size: int) -> range:
        """Logical block indices no query at ``next_pos`` or later can see (never a sink block)."""
        return range(self.num_sink_blocks(block_size),
                     max(0, (next_pos - self.window + 1) // block_size))

    def max_live_blocks(self, block_size: int, num_new_tokens: int) -> int:
        """Upper bound on the blocks a request holds after allocating ``num_new_tokens`` from any
        position, its dead blocks released: the sink blocks plus the blocks spanning the
        ``window - 1`` positions before the first new token and the new tokens themselves. A
        span of m positions starting at offset r of a block covers ceil((r + m) / B) blocks,
        at most ceil((B - 1 + m) / B) (r = B - 1)."""
        span = self.window - 1 + num_new_tokens
        return self.num_sink_blocks(block_size) + _cdiv(block_size - 1 + span, block_size)
