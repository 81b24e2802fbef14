"""What a speculative step costs and gains, in units of one single-row target forward.

A forward over r rows costs ``fixed + per_row * r``: reading the weights (once per forward)
plus the work per row. A memory-bound kernel has per_row ~ 0; GGUF block kernels on a 2-core
AVX2 CPU pay ~0.4 of a step per extra row (codes x activations in integers), so verification
rows are not free there and k must be chosen, not maximised. The line bends: the first rows'
integer work hides under the weights' memory traffic, later ones pay in full, so ``calibrate``
times several row counts and a cost is the line through those points:

    ms    Qwen2.5-Coder-1.5B Q4_K_M, 2-core Xeon (VNNI), one sequence, LM head on every row
    164 |                                      *  8     (dot kernels taking 4 rows a call)
    125 |                           *  6
     86 |                *  4                      a line through 1 and 4 rows would put
     67 |     *  2                                 8 rows at 117 ms
     63 |  *  1
        +------------------------------------------ rows

A request that proposes k tokens with per-token acceptance alpha emits on average

    E(alpha, k) = 1 + alpha + .. + alpha^k = (1 - alpha^(k+1)) / (1 - alpha)

tokens per step (Leviathan et al.), and costs, in a batch of B decodes that each propose k,

    share  = target(B) / B                  its part of the plain step
    step   = target(B (1 + k)) / B          its part of the step verifying every proposal
    draft  = draft(B) / B * k * fraction    k draft passes over the batch (fraction: the
                                            drafts that need a forward; 0 for n-gram guesses)

so speculation gains E * share / (step + draft); below 1 it must not run.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ForwardCost:
    """Cost of a forward over r rows (seconds or relative units): ``fixed + per_row * r``, or,
    with ``points`` ((rows, cost) measured, rows ascending), the line through them: between
    two points by interpolation, before the first and past the last along the nearest
    segment (``fixed`` / ``per_row``: the first segment's line)."""
    fixed: float
    per_row: float
    points: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        if self.fixed < 0 or self.per_row < 0 or self.fixed + self.per_row <= 0:
            raise ValueError(f"forward cost needs fixed, per_row >= 0 and a positive sum, got "
                             f"fixed={self.fixed!r}, per_row={self.per_row!r}")
        rows = [r for r, _ in self.points]
        if self.points and (len(rows) < 2 or rows != sorted(set(rows)) or rows[0] < 1
                            or any(c <= 0 for _, c in self.points)):
            raise ValueError(f"forward cost points need >= 2 distinct ascending row counts "
                             f">= 1 with positive costs, got {self.points!r}")

    def __call__(self, rows: float) -> float:
        pts = self.points
        if not pts:
            return self.fixed + self.per_row * rows
        i = 1                                # the segment: pts[i - 1] .. pts[i]
        while i < len(pts) - 1 and rows > pts[i][0]:
            i += 1
        (r0, c0), (r1, c1) = pts[i - 1], pts[i]
        return max(0.0, c0 + (c1 - c0) / (r1 - r0) * (rows - r0))

    def scaled(self, unit: float) -> "ForwardCost":
        """The same cost in units of ``unit``."""
        return ForwardCost(self.fixed / unit, self.per_row / unit,
                           tuple((r, c / unit) for r, c in self.points))

    def describe(self) -> str:
        """'1: 1.00, 2: 1.07, ..' (rows: cost), or 'fixed + per_row/row'."""
        if not self.points:
            return f"{self.fixed:.2f} + {self.per_row:.2f}/row"
        return ", ".join(f"{r}: {c:.2f}" for r, c in self.points)

    @classmethod
    def from_points(cls, points: list[tuple[int, float]]) -> "ForwardCost":
        """The line through measured (rows, cost) points (>= 2, rows ascending)."""
        # a point measured below the one before (timing noise) counts as level with it: more
        # rows never cost less
        level, cumulative = 0.0, []
        for r, c in points:
            level = max(level, float(c))
            cumulative.append((int(r), level))
        (r0, c0), (r1, c1) = cumulative[0], cumulative[1]
        per_row = (c1 - c0) / (r1 - r0)
        return cls(fixed=max(0.0, c0 - per_row * r0), per_row=per_row, points=tuple(cumulative))


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
        # the step verifies every request's k (the batch taken alike): its share of that step
        cost = self.target(batch * (1 + k)) / batch
        if self.draft is not None:
            # k draft passes, each over the batch's rows (its fixed part shared like the target's)
            cost += self.draft(batch) / batch * k * model_fraction
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


def time_forward(forward, rows: int, repeats: int = 3, warmup: int = 2) -> float:
    """Fastest of ``repeats`` calls of ``forward(rows)`` after ``warmup`` calls (the first
    pages a memory-mapped model in; the minimum drops what other processes took)."""
    for _ in range(warmup):
        forward(rows)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        forward(rows)
        times.append(time.perf_counter() - start)
    return min(times)


# the draft's catch-up over a request's whole context (its first draft) is a prefill: timed
# at this many rows, where prompt chunks run on the many-row kernels, so that longer runs are
# priced along that segment, not along the few-row dots' (~2.5x too dear on the 0.5B)
PREFILL_ROWS = 64


def calibrate(target_forward, draft_forward=None, rows: int = 8,
              min_gain: float = 1.05) -> SpecCostModel:
    """Measure both models on this machine at 1, 2, 4, 8 and ``rows`` rows (one sequence
    each; ``rows``: the most a step verifies; the draft also at PREFILL_ROWS) and express
    every cost in single-row target forwards."""
    counts = sorted({1, 2, max(rows, 2)} | {r for r in (4, 8) if r < rows})
    with torch.inference_mode():
        target = _measured(target_forward, counts)
        unit = target(1)
        target = target.scaled(unit)
        draft = None
        if draft_forward is not None:
            draft_counts = sorted({r for r in counts if r <= 8} | {1, 2, PREFILL_ROWS})
            draft = _measured(draft_forward, draft_counts).scaled(unit)
    return SpecCostModel(target, draft, min_gain=min_gain)


def _measured(forward, counts: list[int]) -> ForwardCost:
    forward(counts[-1])                  # pages the weights in, sizes the buffers
    return ForwardCost.from_points([(r, time_forward(forward, r, warmup=1)) for r in counts])
