"""Skip-join multi-level feedback queue (FastServe, Wu et al.): short jobs first, preemptively.

K levels with growing quanta, measured in tokens of work (prefill chunk tokens + decode tokens
the scheduler gave the request, recompute after a preemption included):

    level:     0          1           2            3 (last)
    quantum:   64         256         1024         unbounded        (base 64, growth 4)

- Skip-join: a new request joins the first level whose quantum exceeds its estimated
  first-token work = prompt tokens the prefix cache does not already hold. A 600-token prompt
  joins level 2 directly instead of being demoted through levels 0 and 1 on the way.
- Demotion: once the work charged at its level reaches that level's quantum, it moves one level
  down (the charge starts over).
- Order: lower level first; within a level lower ``Request.priority`` value first, then
  arrival into the level (a preempted request goes back to the front of its level).
- Preemption for waiting work (``requests_to_yield``): when every sequence slot is taken and a
  waiting request is on a strictly higher level than a running one, the lowest running request
  yields its slot (recompute preemption; with the prefix cache on it re-matches its own computed
  blocks, so little is recomputed).
- Starvation bound: a waiting request that has not been scheduled for ``starvation_steps``
  engine steps is promoted to level 0 with a fresh quantum.
- KV exhaustion victim (``select_preemption_victim``): the running request with the lowest
  rank (highest level, then largest priority value, then latest in the running list).

Only sequence slots (``max_num_seqs``) trigger ``requests_to_yield``; the token budget and KV
blocks are shared as in FCFS (running requests are ordered by rank, so higher levels take the
token budget first).
"""
from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from kvforge.engine.request import Request
from kvforge.sched.queues import RequestQueue, register_queue_policy


@dataclass(slots=True)
class MLFQConfig:
    """``num_levels`` queues; level i (but the last) has quantum ``base_quantum *
    quantum_growth**i`` tokens of work; the last level's quantum is unbounded.
    ``starvation_steps``: engine steps a waiting request may go unscheduled before promotion."""

    num_levels: int = 4
    base_quantum: int = 64
    quantum_growth: int = 4
    starvation_steps: int = 256

    def __post_init__(self) -> None:
        for name in ("num_levels", "base_quantum", "starvation_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(self.quantum_growth, int) or self.quantum_growth < 2:
            raise ValueError(f"quantum_growth must be an integer >= 2, got {self.quantum_growth!r}")

    def quantum(self, level: int) -> float:
        if level >= self.num_levels - 1:
            return float("inf")
        return self.base_quantum * self.quantum_growth ** level

    def join_level(self, work: int) -> int:
        """First level whose quantum exceeds ``work`` tokens."""
        return next(lv for lv in range(self.num_levels) if self.quantum(lv) > work)


@dataclass(slots=True)
class _Rank:
    """A request's place in the MLFQ (kept from admission until it finishes)."""

    level: int
    order: int           # position within the level: smaller goes first
    work_in_level: int = 0
    steps_waited: int = 0


@register_queue_policy("mlfq")
class MLFQRequestQueue(RequestQueue):
    """Waiting queue = requests sorted by (level, priority, order); also ranks running ones."""

    def __init__(self, config: MLFQConfig | None = None) -> None:
        self.config = config or MLFQConfig()
        self._ranks: dict[str, _Rank] = {}           # every admitted, unfinished request
        self._waiting: list[Request] = []             # sorted by _key
        self._counter = itertools.count()
        self._front_counter = itertools.count(-1, -1)  # prepend: before every later add
        self._match_length: Callable[[Request], int] | None = None
        self.num_demotions = 0
        self.num_promotions = 0

    def bind_prefix_matcher(self, match_length: Callable[[Request], int]) -> None:
        self._match_length = match_length

    # ---- ranks ---------------------------------------------------------------------------
    def _key(self, request: Request) -> tuple[int, int, int]:
        rank = self._rank(request)
        return (rank.level, request.priority, rank.order)

    def _rank(self, request: Request) -> _Rank:
        rank = self._ranks.get(request.request_id)
        if rank is None:
            # n > 1 siblings are forked straight into the running list: they inherit the
            # parent's level; anything else unseen joins by its remaining work
            parent = self._ranks.get(request.parent_id) if request.parent_id else None
            level = parent.level if parent else self.config.join_level(request.num_remaining_tokens)
            rank = self._ranks[request.request_id] = _Rank(level, next(self._counter))
        return rank

    def level_of(self, request: Request) -> int:
        return self._rank(request).level

    def estimated_work(self, request: Request) -> int:
        """First-token work: prompt tokens not already in the prefix cache."""
        cached = self._match_length(request) if self._match_length else 0
        return max(1, request.num_tokens - cached)

    # ---- queue contract ------------------------------------------------------------------
    def add(self, request: Request) -> None:
        level = self.config.join_level(self.estimated_work(request))
        self._ranks[request.request_id] = _Rank(level, next(self._counter))
        self._insert(request)

    def prepend(self, request: Request) -> None:
        rank = self._rank(request)
        rank.order = next(self._front_counter)
        rank.steps_waited = 0
        self._insert(request)

    def _insert(self, request: Request) -> None:
        bisect.insort(self._waiting, request, key=self._key)

    def peek(self) -> Request:
        if not self._waiting:
            raise IndexError("peek from an empty request queue")
        return self._waiting[0]

    def pop(self) -> Request:
        if not self._waiting:
            raise IndexError("pop from an empty request queue")
        request = self._waiting.pop(0)
        self._rank(request).steps_waited = 0
        return request

    def remove(self, request: Request) -> None:
        for i, queued in enumerate(self._waiting):
            if queued is request:
                del self._waiting[i]
                return
        raise ValueError(f"request {request.request_id!r} is not in the queue")

    def __len__(self) -> int:
        return len(self._waiting)

    def __iter__(self) -> Iterator[Request]:
        return iter(list(self._waiting))

    # ---- scheduler hooks -----------------------------------------------------------------
    def forget(self, request: Request) -> None:
        self._ranks.pop(request.request_id, None)

    def order_running(self, running: list[Request]) -> None:
        # stable sort: equal ranks keep admission order
        running.sort(key=self._key)

    def select_preemption_victim(self, running: Sequence[Request]) -> Request:
        if not running:
            raise ValueError("no running request to preempt")
        index = max(range(len(running)), key=lambda i: (self._key(running[i])[:2], i))
        return running[index]

    def requests_to_yield(self, running: Sequence[Request], free_seq_slots: int) -> list[Request]:
        """Running requests to preempt so that waiting requests on strictly higher levels get
        their sequence slots. Pairs the best waiting with the worst running, in turn."""
        victims: list[Request] = []
        candidates = sorted(running, key=lambda r: self._key(r)[:2], reverse=True)
        for waiting in self._waiting:
            if free_seq_slots > 0:
                free_seq_slots -= 1 + len(waiting.pending_forks)
                continue
            if not candidates or self.level_of(candidates[0]) <= self.level_of(waiting):
                break
            victims.append(candidates.pop(0))
        return victims

    def on_step_scheduled(self, num_scheduled_tokens: Mapping[str, int],
                          scheduled: Mapping[str, Request]) -> None:
        """Charge this step's work (demoting at the quantum) and age the waiting requests
        (promoting at the starvation bound)."""
        for request_id, num_tokens in num_scheduled_tokens.items():
            rank = self._rank(scheduled[request_id])
            rank.work_in_level += num_tokens
            if rank.work_in_level >= self.config.quantum(rank.level):
                rank.level += 1
                rank.work_in_level = 0
                self.num_demotions += 1
        promoted = False
        for request in self._waiting:
            rank = self._rank(request)
            rank.steps_waited += 1
            if rank.steps_waited >= self.config.starvation_steps and rank.level > 0:
                rank.level, rank.work_in_level, rank.steps_waited = 0, 0, 0
                rank.order = next(self._counter)
                self.num_promotions += 1
                promoted = True
        if promoted:
            self._waiting.sort(key=self._key)
