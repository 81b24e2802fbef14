"""Placement policies: which decoder layers keep their weights resident in RAM, which keep
their KV in RAM (the rest on disk), how many batches make a block, and the KV pool's size.

- ``lp``: FlexGen's search. For each block size (batches per block) a mixed-integer LP (scipy's
  HiGHS through ``milp``) chooses how many layers take each placement (weights resident or
  streamed x KV in RAM or on disk) to minimise the predicted decode step time under the memory
  budget; the block size with the highest predicted throughput wins.
- ``naive``: Accelerate-style: one batch at a time, every layer read from disk for every step,
  no overlap, KV in RAM.
- explicit ``w=PCT[,kv=PCT]``: those percentages of the layers keep weights (and KV) in RAM;
  whatever is not given is chosen as ``lp`` would.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from kvforge.offload.calibrate import HardwareCosts
from kvforge.offload.cost_model import (CATEGORIES, ModelFacts, Workload, activation_bytes,
                                        category_layer_s, decode_step_s, fast_tier_bytes,
                                        kv_layer_bytes, kv_staging_bytes)

MAX_BLOCK_BATCHES = 32
# the chosen block is the largest whose predicted throughput is within this factor of the
# best block's. Past the point where compute hides the loads the predictions flatten, and a
# few batches more cost little in a step but decide whether a workload fits one block: on a
# 2-core EPYC VM the 135M benchmark's 128 prompts got 15 batches of 8 (16 predicted 1.3% more)
# and its last 8 sequences then decoded alone, a whole weight stream for 8 tokens a step
BLOCK_GAIN_MIN = 1.02


@dataclass(frozen=True)
class PolicySpec:
    kind: str                          # lp | naive | explicit
    weights_percent: float | None = None
    kv_percent: float | None = None


def parse_policy(value: str) -> PolicySpec:
    """'lp' | 'naive' | 'w=PCT[,kv=PCT]' (percent of the layers whose weights / KV stay in RAM)."""
    if not isinstance(value, str):
        raise ValueError(f"offload_policy must be 'lp', 'naive' or 'w=PCT[,kv=PCT]', got "
                         f"{value!r}")
    v = value.strip().lower()
    if v in ("lp", "naive"):
        return PolicySpec(v)
    parts = {}
    for item in v.split(","):
        m = re.fullmatch(r"\s*(w|kv)\s*=\s*([0-9]*\.?[0-9]+)\s*%?\s*", item)
        if m is None or m.group(1) in parts:
            raise ValueError(f"offload_policy must be 'lp', 'naive' or 'w=PCT[,kv=PCT]' (percent "
                             f"of the layers whose weights / KV stay in RAM, e.g. 'w=25'), got "
                             f"{value!r}")
        pct = float(m.group(2))
        if not 0 <= pct <= 100:
            raise ValueError(f"offload_policy {value!r}: percentages must be within 0..100")
        parts[m.group(1)] = pct
    return PolicySpec("explicit", parts.get("w"), parts.get("kv"))


@dataclass
class Placement:
    policy: str
    batch_size: int
    block_batches: int
    counts: tuple[int, int, int, int]   # layers per CATEGORIES placement
    slots: int                          # weight loader buffers (2: computing + prefetching)
    overlap: bool
    kv_pool_bytes: int                  # one layer's pool
    predicted_step_s: float
    fast_tier_bytes: int
    memory: dict[str, int] = field(default_factory=dict)

    @property
    def block_seqs(self) -> int:
        return self.batch_size * self.block_batches

    def _layers(self, pick) -> list[int]:
        out, j = [], 0
        for (resident, kv_ram), n in zip(CATEGORIES, self.counts):
            if pick(resident, kv_ram):
                out.extend(range(j, j + n))
            j += n
        return out

    @property
    def resident_layers(self) -> list[int]:
        return self._layers(lambda resident, kv_ram: resident)

    @property
    def kv_disk_layers(self) -> list[int]:
        return self._layers(lambda resident, kv_ram: not kv_ram)

    @property
    def predicted_tokens_per_s(self) -> float:
        """Decode throughput: every sequence of the block gains a token per step."""
        return self.block_seqs / self.predicted_step_s

    def describe(self) -> str:
        return (f"offload policy {self.policy}: {self.block_batches} batch(es) x "
                f"{self.batch_size} seqs per block; of {sum(self.counts)} layers "
                f"{len(self.resident_layers)} keep weights in RAM, "
                f"{len(self.kv_disk_layers)} keep KV on disk; fast tier "
                f"{self.fast_tier_bytes / 2**20:.1f} MiB; predicted decode "
                f"{self.predicted_tokens_per_s:.1f} tok/s ({self.predicted_step_s * 1e3:.0f} "
                f"ms/step)")


def _solve_counts(m: ModelFacts, hw: HardwareCosts, w: Workload, batch_size: int,
                  block_batches: int, budget: int, spec: PolicySpec, kv_on_disk: bool
                  ) -> tuple[int, int, int, int] | None:
    """The MILP over the four placement counts for one block size; None when nothing fits."""
    from scipy.optimize import Bounds, LinearConstraint, milp
    L = m.num_layers
    seqs = batch_size * block_batches
    base = fast_tier_bytes(m, w, batch_size, block_batches, 0, 0, 2)
    if not kv_on_disk:
        base -= kv_staging_bytes(m, w, batch_size, block_batches)
    room = budget - base
    if room < 0:
        return None
    cost = np.array(category_layer_s(m, hw, w, batch_size, block_batches, True))
    kv_l = kv_layer_bytes(m, w, seqs)
    rows = [[1, 1, 1, 1],                                            # every layer placed
            [m.layer_bytes + kv_l, kv_l, m.layer_bytes, 0]]           # fast-tier bytes
    lo, hi = [L, -np.inf], [L, room]
    upper = [L, L, L if kv_on_disk else 0, L if kv_on_disk else 0]
    if spec.weights_percent is not None:
        k = int(round(spec.weights_percent / 100 * L))
        rows.append([1, 0, 1, 0]); lo.append(k); hi.append(k)
    if spec.kv_percent is not None:
        k = int(round(spec.kv_percent / 100 * L))
        rows.append([1, 1, 0, 0]); lo.append(k); hi.append(k)
    res = milp(cost, constraints=LinearConstraint(np.array(rows, dtype=float), lo, hi),
               integrality=np.ones(4), bounds=Bounds([0] * 4, upper))
    if not res.success:
        return None
    return tuple(int(round(x)) for x in res.x)


def _placement(policy: str, m: ModelFacts, hw: HardwareCosts, w: Workload, budget: int,
               batch_size: int, block_batches: int, counts: tuple[int, int, int, int],
               slots: int, overlap: bool) -> Placement:
    seqs = batch_size * block_batches
    resident = counts[0] + counts[2]
    kv_ram = counts[0] + counts[1]
    used = fast_tier_bytes(m, w, batch_size, block_batches, resident, kv_ram, slots)
    kv_l = kv_layer_bytes(m, w, seqs)
    staging = used - (resident * m.layer_bytes + slots * m.stage_bytes + kv_ram * kv_l
                      + activation_bytes(m, w, batch_size, block_batches) + m.fixed_bytes)
    # budget left over grows the pool of the RAM-KV layers (longer sequences fit)
    spare = max(0, budget - used)
    kv_pool = kv_l + (spare // kv_ram if kv_ram else 0)
    memory = {"resident_weights": resident * m.layer_bytes,
              "weight_slots": slots * m.stage_bytes, "kv_ram": kv_ram * kv_pool,
              "kv_staging": staging, "activations": activation_bytes(m, w, batch_size,
                                                                     block_batches),
              "fixed": m.fixed_bytes}
    step = decode_step_s(m, hw, w, batch_size, block_batches, counts, overlap)
    return Placement(policy, batch_size, block_batches, counts, slots, overlap, kv_pool, step,
                     sum(memory.values()), memory)


def choose_placement(spec: PolicySpec, m: ModelFacts, hw: HardwareCosts, w: Workload,
                     budget: int, batch_size: int, block_batches: int | None) -> Placement:
    """The placement ``spec`` asks for under ``budget`` fast-tier bytes; ValueError naming the
    budget when not even one batch fits."""
    L = m.num_layers
    if spec.kind == "naive":
        if fast_tier_bytes(m, w, batch_size, 1, 0, L, 1) > budget:
            raise _too_small(m, w, budget, batch_size, 1)
        return _placement("naive", m, hw, w, budget, batch_size, 1, (0, L, 0, 0), 1, False)
    candidates = [block_batches] if block_batches is not None else range(1, MAX_BLOCK_BATCHES + 1)
    by_block: dict[int, Placement] = {}          # the best placement of each block size
    for nb in candidates:
        for kv_on_disk in (False, True):
            counts = _solve_counts(m, hw, w, batch_size, nb, budget, spec, kv_on_disk)
            if counts is None:
                continue
            p = _placement(spec.kind, m, hw, w, budget, batch_size, nb, counts, 2, True)
            if nb not in by_block or (p.predicted_tokens_per_s
                                      > by_block[nb].predicted_tokens_per_s * 1.0001):
                by_block[nb] = p
    best = None
    if by_block:
        top = max(p.predicted_tokens_per_s for p in by_block.values())
        best = by_block[max(nb for nb, p in by_block.items()
                            if p.predicted_tokens_per_s * BLOCK_GAIN_MIN >= top)]
    if best is None:
        if spec.kind == "explicit":
            raise ValueError(f"offload_policy {spec.weights_percent}% weights / "
                             f"{spec.kv_percent}% KV in RAM does not fit "
                             f"offload_memory_budget {budget / 2**20:.1f} MiB with "
                             f"{block_batches or 1} batch(es) of {batch_size} sequences")
        raise _too_small(m, w, budget, batch_size, block_batches or 1)
    return best


def _too_small(m: ModelFacts, w: Workload, budget: int, batch_size: int,
               block_batches: int) -> ValueError:
    need = fast_tier_bytes(m, w, batch_size, block_batches, 0, 0, 2)
    return ValueError(
        f"offload_memory_budget {budget / 2**20:.1f} MiB is too small for {block_batches} "
        f"batch(es) of {batch_size} sequences of {w.seq_len} tokens: even with every layer and "
        f"all KV on disk that needs {need / 2**20:.1f} MiB (two {m.stage_bytes / 2**20:.1f} MiB "
        f"weight slots, activations, KV staging); lower offload_batch_size or max_model_len, "
        f"or raise the budget")
