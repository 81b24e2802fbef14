"""What a speculative step costs and gains, in units of one single-row target forward.

A forward over r rows costs ``fixed + per_row * r``: reading the weights (once per forward)
plus the work per row. A memory-bound kernel has per_row ~ 0; GGUF block kernels on a 2-core
AVX2 CPU pay ~0.4 of a step per extra row (codes x activations in integers), so verification
rows are not free there and k must be chosen, not maximised.

A request that proposes k tokens with per-token acceptance alpha emits on average

    E(alpha, k) = 1 + alpha + .. + alpha^k = (1 - alpha^(k+1)) / (1 - alpha)

tokens per step (Leviathan et al.), and costs, in a batch of B decodes,

    share  = target(B) / B                  its part of the plain step
    verify = target.per_row * k             its k extra rows
    draft  = draft(1 row) * model_drafts    the draft model's forwards (0 for n-gram guesses;
                                            fewer than k when n-gram candidates are accepted)

so speculation gains E * share / (share + verify + draft); below 1 it must not run.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ForwardCost:
    """Cost of a forward over r rows: fixed + per_row * r (seconds or relative units)."""
    fixed: float
    per_row: float

    def __post_init__(self) -> None:
        if self.fixed < 0 or self.per_row < 0 or self.fixed + self.per_row <= 0:
            raise ValueError(f"forward cost needs fixed, per_row >= 0 and a positive sum, got "
                             f"fixed={self.fixed!r}, per_row={self.per_row!r}")

    def __call__(self, rows: int) -> float:
        return self.fixed + self.per_row * rows

    @classmethod
    def from_timings(cls, one_row: float, rows: int, many_rows: float) -> "ForwardCost":
        per_row = max(0.0, (many_rows - one_row) / (rows - 1))
        return cls(fixed=max(0.0, one_row - per_row), per_row=per_row)


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a step emits with k proposals accepted each with probability alpha, in order."""
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


@dataclass(frozen=True)
class SpecCostModel:
    target: ForwardCost
    draft: ForwardCost | None = None      # None: proposals cost no forward (n-gram)
    # the least predicted speed-up worth speculating for: a speculative step also costs what
    # the model does not price (proposing, verification bookkeeping, no multi-step decoding)
    min_gain: float = 1.05

    def __post_init__(self) -> None:
        if self.min_gain < 1.0:
            raise ValueError(f"min_gain must be >= 1, got {self.min_gain!r}")

    def speedup(self, alpha: float, k: int, batch: int = 1, model_fraction: float = 1.0) -> float:
        """Predicted tokens/s of a request proposing k tokens vs decoding one per step, in a
        batch of ``batch`` decodes; ``model_fraction`` of its drafts need a draft forward."""
        if k <= 0:
            return 1.0
        share = self.target(batch) / batch
        cost = share + self.target.per_row * k
        if self.draft is not None:
            # a draft pass serves the whole batch; its fixed part is shared like the target's
            cost += (self.draft.fixed / batch + self.draft.per_row) * k * model_fraction
        return expected_tokens(alpha, k) * share / cost

    def best(self, alpha: float, k_max: int, batch: int = 1, model_fraction: float = 1.0
             ) -> tuple[int, float]:
        """(k, predicted speedup) for the k in 0..k_max with the highest prediction; (0, 1.0)
        when none reaches ``min_gain``."""
        best, best_gain = 0, 1.0
        for k in range(1, k_max + 1):
            gain = self.speedup(alpha, k, batch, model_fraction)
            if gain > best_gain:
                best, best_gain = k, gain
        return (best, best_gain) if best_gain >= self.min_gain else (0, 1.0)

    def best_k(self, alpha: float, k_max: int, batch: int = 1,
               model_fraction: float = 1.0) -> int:
        return self.best(alpha, k_max, batch, model_fraction)[0]


def time_forward(forward, rows: int, repeats: int = 3) -> float:
    """Fastest of ``repeats`` calls of ``forward(rows)`` after two warm-up calls (the first
    pages a memory-mapped model in; the minimum drops what other processes took)."""
    forward(rows)
    forward(rows)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        forward(rows)
        times.append(time.perf_counter() - start)
    return min(times)


def calibrate(target_forward, draft_forward=None, rows: int = 4,
              min_gain: float = 1.05) -> SpecCostModel:
    """Measure both models at 1 and ``rows`` rows (one sequence each) on this machine and
    express every cost in single-row target forwards."""
    with torch.inference_mode():
        t1, tn = time_forward(target_forward, 1), time_forward(target_forward, rows)
        target = ForwardCost.from_timings(t1, rows, tn)
        unit = target(1)
        target = ForwardCost(target.fixed / unit, target.per_row / unit)
        draft = None
        if draft_forward is not None:
            d1, dn = time_forward(draft_forward, 1), time_forward(draft_forward, rows)
            raw = ForwardCost.from_timings(d1, rows, dn)
            draft = ForwardCost(raw.fixed / unit, raw.per_row / unit)
    return SpecCostModel(target, draft, min_gain=min_gain)
