"""Skip-join multi-level feedback queue (FastServe, Wu et al.): short jobs first, preemptively.

K levels with growing quanta, measured in tokens of work: each step a request is scheduled it
is charged 1 for each token it samples (its decode, the last prompt token, or the k tokens of a
multi-step decode) plus ``prefill_weight`` for every other token the step computes for it
(prefill chunks, recompute after a preemption, speculative verification rows):

    level:     0      1       2        3         4 (last)
    quantum:   8      32      128      512       unbounded        (defaults)

Why these defaults. The quantum of level 0 decides how long a job that arrived first keeps a
slot before later, possibly shorter, jobs get one: with every prompt short all jobs join level
0, and with a quantum of 64 eight 160-token jobs queued ahead of 8-token ones held the slots for
~60 decode steps each before demotion (mean JCT only 1.9x lower than FCFS in decode steps, where
shortest-remaining-first gives 3.7x). FastServe sets the top quantum to about one iteration and
grows it geometrically; here one iteration is one decode step, and 8 keeps a typical short reply
(a few to 8 tokens) inside level 0 while a long job yields after 8 steps. Growth 4 keeps the
number of demotions (each may preempt, i.e. recompute a partial block) of a long job at
log4(length / 8). On the head-of-line workload above (tests/sched/test_mlfq_engine.py) mean JCT
drops ~3.2x below FCFS with ~1% more decode steps.

``prefill_weight`` (default 0.1) is the cost of one prefill token relative to one decode step;
FastServe measures service in time, and a batched prompt token costs far less than a decode
iteration (~0.1 on a 2-core CPU, ~0.01 on a GPU; ``benchmarks/sched.py --mlfq-prefill-weight
auto`` measures it). With 1.0 a 20-token prompt alone would use up a small top quantum.

- Skip-join: a new request joins the first level whose quantum exceeds its estimated
  first-token work = ``prefill_weight`` x the prompt tokens the prefix cache does not already
  hold. A 1000-token prompt (100 of work) joins level 2 directly instead of being demoted
  through levels 0 and 1 on the way.
- Demotion: once the work charged at its level reaches that level's quantum, it moves one level
  down (the charge starts over), at the step that charges it; the next step yields its slot if
  a waiting request is on a higher level.
- Order: lower level first; within a level lower ``Request.priority`` value first, then
  arrival into the level (a preempted request goes back to the front of its level).
- Preemption for waiting work (``requests_to_yield``): when every sequence slot is taken and a
  waiting request is on a strictly higher level than a running one, the lowest running request
  yields its slot (preempted per ``--preemption-mode``: recompute re-matches its own computed
  full blocks in the prefix cache, so it recomputes only its last partial block, at most
  ``block_size`` tokens; swap keeps its KV in a slower tier). A running request whose
  ``max_tokens`` leaves at most level 0's quantum of decodes is never asked to yield: it frees
  its slot within that quantum anyway, and the preemption would only add a recompute.
- Starvation bound: a waiting request that has not been scheduled for ``starvation_steps``
  engine steps is promoted to level 0 with a fresh quantum.
- Victims, for a waiting request's slot and for KV exhaustion (``select_preemption_victim``):
  the running request with the lowest rank (highest level, then largest priority value, then
  latest into its level).
- Multi-step decoding (engine/decode_steps.py) holds a slot for k steps in one call, so with
  requests waiting k is bounded (``decode_steps_bound``) by the decode steps left in the
  quantum of every running request that a waiting one would preempt once it is demoted (and
  by the nearest starvation promotion): preemptions happen at the model step they would one
  step at a time, while the steps in between run k at a time. The k tokens are charged as k
  decode steps and age the waiting requests by k; a call that ends early (an arrival
  interrupted it) is charged the steps it ran instead (``on_decode_steps_unused``).

Only sequence slots (``max_num_seqs``) trigger ``requests_to_yield``; the token budget and KV
blocks are shared as in FCFS (running requests are ordered by rank, so higher levels take the
token budget first). MLFQ approximates least-attained-service: jobs of equal size end up
sharing slots in turn (demotion by demotion), which is what it gives up against FCFS for them.
"""
from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from kvforge.engine.request import Request
from kvforge.sched.queues import RequestQueue, register_queue_policy


@dataclass(slots=True)
class MLFQConfig:
    """The skip-join MLFQ's parameters (engine options ``mlfq_*``, CLI ``--mlfq-*``).

    - ``quanta``: the bounded levels' quanta in tokens of work, strictly increasing; one more,
      unbounded, level follows. None = ``base_quantum * quantum_growth**i`` for the first
      ``num_levels - 1`` levels (defaults: 8, 32, 128, 512 + unbounded; the module docstring
      says why). When given it sets ``num_levels`` and ``base_quantum``.
    - ``starvation_steps`` (256): engine steps a waiting request may go unscheduled before it
      is promoted to level 0 with a fresh quantum.
    - ``prefill_weight`` (0.1, in (0, 1]): work of one prefill token relative to one decode.
    """

    num_levels: int = 5
    base_quantum: int = 8
    quantum_growth: int = 4
    starvation_steps: int = 256
    prefill_weight: float = 0.1
    quanta: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.quanta is None:
            for name in ("num_levels", "base_quantum"):
                _check_positive_int(name, getattr(self, name))
            if (not isinstance(self.quantum_growth, int) or isinstance(self.quantum_growth, bool)
                    or self.quantum_growth < 2):
                raise ValueError(f"quantum_growth must be an integer >= 2, got "
                                 f"{self.quantum_growth!r}")
            self.quanta = tuple(self.base_quantum * self.quantum_growth ** i
                                for i in range(self.num_levels - 1))
        else:
            quanta = tuple(self.quanta) if isinstance(self.quanta, (list, tuple)) else None
            if (not quanta or any(not isinstance(q, int) or isinstance(q, bool) or q < 1
                                  for q in quanta)
                    or any(a >= b for a, b in zip(quanta, quanta[1:]))):
                raise ValueError(f"mlfq quanta must be strictly increasing positive integers, "
                                 f"got {self.quanta!r}")
            self.quanta = quanta
            self.num_levels = len(quanta) + 1
            self.base_quantum = quanta[0]
        _check_positive_int("starvation_steps", self.starvation_steps)
        w = self.prefill_weight
        if (isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w)
                or not 0 < w <= 1):
            raise ValueError(f"prefill_weight must be a number in (0, 1], got {w!r}")

    def quantum(self, level: int) -> float:
        if level >= len(self.quanta):
            return float("inf")
        return self.quanta[level]

    def join_level(self, work: float) -> int:
        """First level whose quantum exceeds ``work`` tokens."""
        return next(lv for lv in range(self.num_levels) if self.quantum(lv) > work)


def _check_positive_int(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def mlfq_config_from_options(quanta: str | Sequence[int] | None, starvation_steps: int,
                             prefill_weight: float) -> MLFQConfig:
    """MLFQConfig from the engine options; ``quanta`` may be the CLI's "8,32,128,512". Errors
    name the option and the value as given."""
    parsed = quanta
    if isinstance(quanta, str):
        try:
            parsed = tuple(int(q) for q in quanta.split(","))
        except ValueError:
            parsed = quanta               # rejected below as it is
    elif isinstance(quanta, (list, tuple)):
        parsed = tuple(quanta)
    if quanta is not None:
        try:
            MLFQConfig(quanta=parsed)
        except ValueError:
            raise ValueError(f"mlfq_quanta must be strictly increasing positive integers like "
                             f"'8,32,128,512', got {quanta!r}") from None
    return MLFQConfig(quanta=parsed, starvation_steps=starvation_steps,
                      prefill_weight=prefill_weight)


@dataclass(slots=True)
class _Rank:
    """A request's place in the MLFQ (kept from admission until it finishes)."""

    level: int
    order: int           # position within the level: smaller goes first
    work_in_level: float = 0.0
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
        # this step's multi-step decodes: request_id -> (level, order, work_in_level before
        # the charge, decode steps charged, other work charged)
        self._charged: dict[str, tuple[int, int, float, int, float]] = {}

    def bind_prefix_matcher(self, match_length: Callable[[Request], int]) -> None:
        self._match_length = match_length

    # ---- ranks ---------------------------------------------------------------------------
    def _charge(self, rank: _Rank, work: float) -> None:
        """Add work at the rank's level; at the level's quantum it moves one level down."""
        rank.work_in_level += work
        if rank.work_in_level >= self.config.quantum(rank.level):
            rank.level += 1
            rank.work_in_level = 0
            rank.order = next(self._counter)          # the back of its new level
            self.num_demotions += 1

    def on_decode_steps_unused(self, unused: Mapping[str, int]) -> None:
        """Charge a multi-step call's requests for the steps it ran, not the k planned: each
        rank goes back to where it stood before the step and is charged again (a demotion
        the unrun steps caused is undone); the waiting requests' age drops by the unrun
        model steps."""
        for request_id, steps in unused.items():
            charged = self._charged.pop(request_id, None)
            rank = self._ranks.get(request_id)
            if charged is None or rank is None or steps <= 0:
                continue
            level, order, work, decodes, other = charged
            if rank.level != level:
                self.num_demotions -= 1
            rank.level, rank.order, rank.work_in_level = level, order, work
            self._charge(rank, max(0, decodes - steps) + other)
        unrun = max(unused.values(), default=0)
        for request in self._waiting:
            rank = self._rank(request)
            rank.steps_waited = max(0, rank.steps_waited - unrun)

    def _key(self, request: Request) -> tuple[int, int, int]:
        rank = self._rank(request)
        return (rank.level, request.priority, rank.order)

    def _rank(self, request: Request) -> _Rank:
        rank = self._ranks.get(request.request_id)
        if rank is None:
            # n > 1 siblings are forked straight into the running list: they inherit the
            # parent's level; anything else unseen joins by its remaining work
            parent = self._ranks.get(request.parent_id) if request.parent_id else None
            weighted = request.num_remaining_tokens * self.config.prefill_weight
            level = parent.level if parent else self.config.join_level(weighted)
            rank = self._ranks[request.request_id] = _Rank(level, next(self._counter))
        return rank

    def level_of(self, request: Request) -> int:
        return self._rank(request).level

    def estimated_work(self, request: Request) -> float:
        """First-token work: prompt tokens not already in the prefix cache, weighted."""
        cached = self._match_length(request) if self._match_length else 0
        return max(1, request.num_tokens - cached) * self.config.prefill_weight

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
        index = max(range(len(running)), key=lambda i: (self._key(running[i]), i))
        return running[index]

    def requests_to_yield(self, running: Sequence[Request], free_seq_slots: int) -> list[Request]:
        """Running requests to preempt so that waiting requests on strictly higher levels get
        their sequence slots. Pairs the best waiting with the worst running, in turn."""
        victims: list[Request] = []
        candidates = sorted((r for r in running if not self._finishes_soon(r)), key=self._key,
                            reverse=True)                              # lowest rank first
        for waiting in self._waiting:
            if free_seq_slots > 0:
                free_seq_slots -= 1 + len(waiting.pending_forks)
                continue
            if not candidates or self.level_of(candidates[0]) <= self.level_of(waiting):
                break
            victims.append(candidates.pop(0))
        return victims

    def decode_steps_bound(self, running: Sequence[Request]) -> int | None:
        """Decode steps until a waiting request would preempt a running one (every slot taken):
        a running request yields once its demotion puts it below the best waiting level, so the
        bound is the quantum it has left at its level; a waiting request's starvation promotion
        (to level 0) bounds it too. The k tokens of a multi-step call are charged as k decodes,
        so the demotion lands on the last of them, as it would one step at a time."""
        if not self._waiting:
            return None
        candidates = [r for r in running if not self._finishes_soon(r)]
        if not candidates:
            return None                      # every running request frees its slot soon
        best_waiting = self._rank(self._waiting[0]).level
        bound = None
        for request in candidates:
            rank = self._rank(request)
            if best_waiting < rank.level:
                return 1                                 # requests_to_yield preempts it now
            if best_waiting == rank.level:               # outranks it once it is demoted
                left = max(1, math.ceil(self.config.quantum(rank.level) - rank.work_in_level))
                bound = left if bound is None else min(bound, left)
        for waiting in self._waiting:
            rank = self._rank(waiting)
            if rank.level > 0:                    # promoted to level 0, it outranks them all
                left = max(1, self.config.starvation_steps - rank.steps_waited)
                bound = left if bound is None else min(bound, left)
        return bound

    def _finishes_soon(self, request: Request) -> bool:
        """Its ``max_tokens`` leaves at most the first level's quantum of decodes: it frees its
        slot within that quantum anyway, sooner than a waiter's first quantum would end, and
        preempting it would add a recompute (or swap) for nothing."""
        max_tokens = request.max_tokens
        return (max_tokens is not None
                and max_tokens - request.num_output_tokens <= self.config.quanta[0])

    def on_step_scheduled(self, num_scheduled_tokens: Mapping[str, int],
                          scheduled: Mapping[str, Request],
                          num_lookahead_tokens: Mapping[str, int] | None = None) -> None:
        """Charge this step's work (demoting at the quantum) and age the waiting requests
        (promoting at the starvation bound)."""
        w = self.config.prefill_weight
        lookaheads = num_lookahead_tokens or {}
        self._charged.clear()
        for request_id, num_tokens in num_scheduled_tokens.items():
            request = scheduled[request_id]
            rank = self._rank(request)
            # the token whose logits are sampled costs a decode step; the rest are prefill-like
            # (prompt chunks, recompute, speculative rows), batched at prefill_weight each
            # a multi-step decode's lookahead slots are decode steps too: k tokens, k steps
            lookahead = lookaheads.get(request_id, 0)
            samples = (request.num_computed_tokens + num_tokens - len(request.spec_token_ids)
                       - lookahead == request.num_tokens)
            decodes = samples * (1 + lookahead)
            if lookahead:          # kept until the call's tokens are in: it may end early
                self._charged[request_id] = (rank.level, rank.order, rank.work_in_level,
                                             decodes, w * (num_tokens - decodes))
            self._charge(rank, decodes + w * (num_tokens - decodes))
        promoted = False
        # waiting is counted in model steps: a multi-step decode call of k steps ages it by k
        model_steps = 1 + max(lookaheads.values(), default=0)
        for request in self._waiting:
            rank = self._rank(request)
            rank.steps_waited += model_steps
            if rank.steps_waited >= self.config.starvation_steps and rank.level > 0:
                rank.level, rank.work_in_level, rank.steps_waited = 0, 0, 0
                rank.order = next(self._counter)
                self.num_promotions += 1
                promoted = True
        if promoted:
            self._waiting.sort(key=self._key)
