"""Continuous batching with chunked prefill and recompute preemption (vLLM v1 style).

One vocabulary for every request: it needs ``num_tokens - num_computed_tokens`` more tokens of
KV before its next sample. A step is a map ``{request_id: num_scheduled_tokens}`` under two caps,
a token budget (``max_num_batched_tokens``) and a sequence cap (``max_num_seqs``):

    1. RUNNING requests, in order: decodes take 1 token, unfinished prefills min(rest, budget).
       Out of KV blocks -> preempt the policy's victim (FCFS: newest) and retry; if the victim
       is the request itself, stop.
    2. Only if nothing was preempted: WAITING requests from the queue head, each taking
       min(rest, budget) tokens (the whole rest with chunked prefill off), until one does not
       fit (no skipping ahead).
    3. Prefill ahead (``SchedulerConfig.prefill_ahead``, off by default): with every sequence
       slot taken, waiting requests whose whole prompt fits the budget left are prefilled,
       sample their first token and stay in the waiting queue holding their KV ("parked").
       When a slot frees, a parked request resumes at its second token with nothing to
       recompute. Why: under load a new request otherwise waits for a slot before its first
       token (FCFS: a whole job's length), though its prefill is work the engine must do
       anyway: done ahead, it delays the running decodes by one prefill, as its admission
       would (docs/scheduling.md measures the difference). Job order stays the policy's. When KV
       blocks run short, parked requests give theirs back first (as a preempted request
       does: swapped out or recomputed later), before any running request is preempted.
    4. Parents whose chunk completes their prompt fork their pending n > 1 siblings.
    5. Batch order: 1-token requests (decodes) first, then prefill chunks.

The engine loop calls ``schedule()``, runs the model, then ``update_from_output()`` with the
sampled ids, then ``finish_request()`` for requests its stop checks end.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

from kvforge.engine.request import Request, RequestStatus
from kvforge.kvcache.kv_manager import KVCacheManager, cdiv
from kvforge.kvcache.prefix_cache import common_prefix_len
from kvforge.sched.config import SchedulerConfig
from kvforge.sched.output import SchedulerOutput
from kvforge.sched.queues import create_request_queue


@dataclass
class _StepPlan:
    """What the step under construction holds; the token budget shrinks as requests join."""

    tokens_left: int
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    requests: dict[str, Request] = field(default_factory=dict)          # in scheduling order
    block_copies: list[tuple[str, tuple[int, int]]] = field(default_factory=list)
    forked: dict[str, str] = field(default_factory=dict)
    forked_requests: list[Request] = field(default_factory=list)
    preempted_request_ids: list[str] = field(default_factory=list)
    num_lookahead_tokens: dict[str, int] = field(default_factory=dict)

    def add(self, request: Request, num_tokens: int, copies: list[tuple[int, int]],
            num_lookahead: int = 0) -> None:
        assert 0 < num_tokens <= self.tokens_left and 0 <= num_lookahead < num_tokens
        self.tokens_left -= num_tokens
        self.num_scheduled_tokens[request.request_id] = num_tokens
        self.requests[request.request_id] = request
        self.block_copies.extend((request.request_id, copy) for copy in copies)
        if num_lookahead:
            self.num_lookahead_tokens[request.request_id] = num_lookahead

    def remove(self, request_id: str) -> None:
        """Undo ``add`` for a request preempted later in the same step."""
        if request_id in self.requests:
            del self.requests[request_id]
            self.tokens_left += self.num_scheduled_tokens.pop(request_id)
            self.num_lookahead_tokens.pop(request_id, None)
            # its copy destinations were freed with its blocks
            self.block_copies = [(rid, c) for rid, c in self.block_copies if rid != request_id]

    def to_output(self, kv_manager: KVCacheManager) -> SchedulerOutput:
        ordered = sorted(self.requests.values(),             # stable: keeps scheduling order
                         key=lambda r: self.num_scheduled_tokens[r.request_id] != 1)
        return SchedulerOutput(
            scheduled=ordered,
            num_scheduled_tokens={r.request_id: self.num_scheduled_tokens[r.request_id]
                                  for r in ordered},
            block_ids={r.request_id: kv_manager.get_block_ids(r.request_id) for r in ordered},
            # recorded order is a safe execution order: a copy's src can be freed and reused
            # only after the copy was recorded
            block_copies=[copy for _, copy in self.block_copies],
            forked=dict(self.forked),
            forked_requests=list(self.forked_requests),
            preempted_request_ids=list(self.preempted_request_ids),
            spec_token_ids={r.request_id: list(r.spec_token_ids) for r in ordered
                            if r.spec_token_ids},
            num_lookahead_tokens=dict(self.num_lookahead_tokens))


def _num_ahead(output: SchedulerOutput, request_id: str) -> int:
    """Slots scheduled after a request's last token: proposed tokens or multi-step lookahead."""
    return (len(output.spec_token_ids.get(request_id, ()))
            + output.num_lookahead_tokens.get(request_id, 0))


class Scheduler:
    """Decides each step's batch; owns the waiting queue, the running list and, through the
    KVCacheManager, every request's KV blocks. Not thread-safe: one engine loop drives it."""

    def __init__(self, config: SchedulerConfig, kv_manager: KVCacheManager) -> None:
        if config.block_size != kv_manager.block_size:
            raise ValueError(f"SchedulerConfig.block_size {config.block_size} != "
                             f"KVCacheManager.block_size {kv_manager.block_size}")
        self.config = config
        self.kv_manager = kv_manager
        # policy options: only mlfq takes any (its levels, quanta, starvation bound)
        self.waiting = create_request_queue(
            config.policy, **({"config": config.mlfq} if config.policy == "mlfq" and config.mlfq
                              else {}))
        self.waiting.bind_prefix_matcher(kv_manager.prefix_match_length)
        self.running: list[Request] = []
        # every unfinished request, including n > 1 siblings not yet forked
        self.requests: dict[str, Request] = {}
        self._pending_fork_parent: dict[str, Request] = {}   # child id -> parent
        # waiting requests prefilled ahead, holding their KV (RUNNING during their prefill step)
        self.parked: dict[str, Request] = {}
        self.swapper = None      # sched/swap.py KVSwapper (set by the engine); None = recompute

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_request(self, request_id: str) -> Request | None:
        """The unfinished request with this id (None once finished or if never added)."""
        return self.requests.get(request_id)

    @property
    def max_tokens_in_cache(self) -> int:
        """Longest sequence the KV cache can hold. A request must stop growing by then (the
        engine's length check), else once alone it can never be scheduled again. Unbounded
        when an attention window keeps a request's blocks under the pool (KVCacheManager)."""
        return self.kv_manager.max_tokens_per_request(self.config.enable_chunked_prefill)

    def decode_steps_allowed(self) -> int | None:
        """The most decode steps the running batch may take in one call (multi-step decoding,
        engine/decode_steps.py) without delaying a scheduling decision; None = no bound.

        Nothing waiting: no bound. A free sequence slot, or a request to prefill ahead: 1 (it
        is admitted at the next step). Every slot taken: the next admission comes when a
        running request ends (each row's k is capped at its max_tokens, so the call ends where
        the first one finishes) or when the queue policy preempts one
        (``RequestQueue.decode_steps_bound``: MLFQ, at the end of a running request's quantum)."""
        if not self.waiting:
            return None
        if self._num_seq_slots_used() < self.config.max_num_seqs or self._prefills_ahead_next():
            return 1
        return self.waiting.decode_steps_bound(self.running)

    def _num_seq_slots_used(self) -> int:
        # running requests plus the siblings they will fork: reserved at admission so that a
        # fork never pushes the running count over max_num_seqs
        return len(self.running) + sum(len(r.pending_forks) for r in self.running)

    # ---- adding and finishing ------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a request; its n - 1 siblings ride along in ``request.pending_forks``."""
        family = [request, *request.pending_forks]
        for member in family:
            if member.request_id in self.requests:
                raise ValueError(f"duplicate request id {member.request_id!r}")
            if member.status is not RequestStatus.WAITING or member.num_computed_tokens != 0:
                raise ValueError(f"request {member.request_id!r} is not fresh: {member!r}")
        if len({m.request_id for m in family}) != len(family):
            raise ValueError(f"duplicate ids among {request.request_id!r} and its forks")
        if request.num_prompt_tokens == 0:
            raise ValueError(f"request {request.request_id!r} has an empty prompt")
        if request.num_tokens > self.max_tokens_in_cache:
            raise ValueError(f"request {request.request_id!r} has {request.num_tokens} tokens, "
                             f"more than the KV cache holds ({self.max_tokens_in_cache})")
        if request.num_tokens > self.config.max_model_len:
            raise ValueError(f"request {request.request_id!r} has {request.num_tokens} tokens, "
                             f"more than max_model_len {self.config.max_model_len}")
        if len(family) > self.config.max_num_seqs:
            raise ValueError(f"request {request.request_id!r} asks for {len(family)} sequences, "
                             f"more than max_num_seqs {self.config.max_num_seqs}")
        for child in request.pending_forks:
            if child.pending_forks or child.all_token_ids != request.all_token_ids:
                raise ValueError(f"fork {child.request_id!r} must have its parent's prompt and "
                                 f"no forks of its own")
        for member in family:
            self.requests[member.request_id] = member
        for child in request.pending_forks:
            self._pending_fork_parent[child.request_id] = request
        self.waiting.add(request)

    def finish_request(self, request_id: str, status: RequestStatus) -> None:
        """End a request in any state: free its blocks and take it out of every queue.

        A parent that has not forked yet takes its pending siblings with it. Unknown or already
        finished ids are ignored.
        """
        if not status.is_finished:
            raise ValueError(f"finish_request needs a finished status, got {status!r}")
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        if self.parked.pop(request_id, None) is not None:
            self.waiting.remove(request)
        elif request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request_id in self._pending_fork_parent:
            parent = self._pending_fork_parent.pop(request_id)
            parent.pending_forks[:] = [c for c in parent.pending_forks if c is not request]
        else:
            self.waiting.remove(request)
        if self.swapper is not None:
            # KV swapped out while it waited: its copies finish before any block is freed
            self.swapper.discard(request)
        self.kv_manager.free(request_id)
        self.waiting.forget(request)                      # policy state (mlfq ranks)
        request.status = status
        request.finished_time = time.monotonic()
        for child in list(request.pending_forks):
            self.finish_request(child.request_id, status)

    def abort_request(self, request_id: str) -> None:
        self.finish_request(request_id, RequestStatus.FINISHED_ABORTED)

    # ---- one step ------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        if self.swapper is not None:
            self.swapper.reap()                               # finished swap-outs free blocks
        plan = _StepPlan(tokens_left=self.config.max_num_batched_tokens)
        num_yielded = self._yield_to_waiting(plan)            # preemptive policies (mlfq)
        self._schedule_running(plan)
        if len(plan.preempted_request_ids) == num_yielded:    # no KV-pressure preemption
            self._schedule_waiting(plan)
            self._prefill_ahead(plan)
        self._fork_completed_prompts(plan)
        self.waiting.on_step_scheduled(plan.num_scheduled_tokens, plan.requests,   # quanta
                                       plan.num_lookahead_tokens)
        if not plan.requests and not self.running and self.waiting:
            self._raise_if_never_fits(self.waiting.peek())
        if self.swapper is not None:      # proactive swap-in, overlapping this step's forward
            self.swapper.prefetch(list(itertools.islice(self.waiting, self.config.max_num_seqs)),
                                  self.running)
        return plan.to_output(self.kv_manager)

    def _yield_to_waiting(self, plan: _StepPlan) -> int:
        """Let the queue policy rank the running list and name running requests that give
        their sequence slots to higher-ranked waiting ones (FCFS: none). Returns how many."""
        self.waiting.order_running(self.running)
        free_seq_slots = self.config.max_num_seqs - self._num_seq_slots_used()
        victims = self.waiting.requests_to_yield(self.running, free_seq_slots)
        for victim in victims:
            self._preempt(victim, plan)
        return len(victims)

    def _raise_if_never_fits(self, request: Request) -> None:
        # an empty step with an empty running list repeats forever: fail loudly instead
        if request.num_tokens > self.max_tokens_in_cache:
            raise RuntimeError(
                f"request {request.request_id!r} grew to {request.num_tokens} tokens but the KV "
                f"cache holds only {self.max_tokens_in_cache}: it can never be scheduled; stop "
                f"requests at Scheduler.max_tokens_in_cache or enlarge the cache")

    def _num_tokens_to_schedule(self, request: Request, tokens_left: int) -> int:
        remaining = request.num_remaining_tokens
        if self.config.enable_chunked_prefill:
            # an attention window caps chunks so that a request alone always fits the pool
            return max(0, min(remaining, tokens_left, self.kv_manager.max_chunk_tokens))
        return remaining if 0 < remaining <= tokens_left else 0

    @staticmethod
    def _num_spec_tokens(request: Request, num_tokens: int, tokens_left: int) -> int:
        """Speculative decoding (kvforge/spec): a decode (its last token only) also verifies
        its proposed tokens, as many as the budget takes; the rest are dropped."""
        spec = request.spec_token_ids
        if spec and (num_tokens != 1 or request.num_remaining_tokens != 1):
            spec.clear()
        del spec[max(0, tokens_left - num_tokens):]
        return len(spec)

    @staticmethod
    def _num_lookahead_tokens(request: Request, num_tokens: int, tokens_left: int) -> int:
        """Multi-step decoding: KV slots for the tokens a decode goes on to generate in this
        step (``request.num_lookahead_tokens``, as many as the budget takes)."""
        if num_tokens != 1 or request.num_remaining_tokens != 1 or request.spec_token_ids:
            return 0
        return max(0, min(request.num_lookahead_tokens, tokens_left - num_tokens))

    def _schedule_running(self, plan: _StepPlan) -> None:
        for request in list(self.running):
            if request.status is not RequestStatus.RUNNING:
                continue                          # preempted as a victim earlier in this loop
            if plan.tokens_left == 0:
                break
            num_tokens = self._num_tokens_to_schedule(request, plan.tokens_left)
            if num_tokens == 0:
                continue
            num_tokens += self._num_spec_tokens(request, num_tokens, plan.tokens_left)
            lookahead = self._num_lookahead_tokens(request, num_tokens, plan.tokens_left)
            if not self._allocate_or_preempt(request, num_tokens, plan, lookahead):
                break

    def _allocate_or_preempt(self, request: Request, num_tokens: int, plan: _StepPlan,
                             num_lookahead: int = 0) -> bool:
        """Allocate for a running request (plus ``num_lookahead`` slots), preempting victims
        until it fits; False if the request itself had to go."""
        while True:
            slots = self.kv_manager.allocate_slots(request, num_tokens + num_lookahead)
            if slots is not None:
                plan.add(request, num_tokens + num_lookahead, slots.block_copies, num_lookahead)
                return True
            if num_lookahead:                    # one token a step before preempting anyone
                num_lookahead = 0
                continue
            if request.spec_token_ids:           # drop speculation before preempting anyone
                num_tokens -= len(request.spec_token_ids)
                request.spec_token_ids = []
                continue
            if self.swapper is not None and self.swapper.make_room():
                continue                         # in-flight swap copies held the blocks
            if self._drop_parked():
                continue                         # a parked request's blocks, before a runner's
            victim = self.waiting.select_preemption_victim(self.running)
            self._preempt(victim, plan)
            if victim is request:
                return False

    def _preempt(self, request: Request, plan: _StepPlan) -> None:
        """Recompute preemption: drop its KV; it goes back to the front of the waiting queue."""
        self.running.remove(request)
        self._give_back_kv(request)
        request.spec_token_ids = []
        request.num_lookahead_tokens = 0
        self.waiting.prepend(request)
        plan.remove(request.request_id)
        plan.preempted_request_ids.append(request.request_id)

    def _give_back_kv(self, request: Request) -> None:
        """A preempted (or parked) request's blocks go back: its KV swapped out first where the
        swapper keeps it, else recomputed on admission."""
        if self.swapper is not None:
            self.swapper.on_preempt(request)     # swap its KV out before the blocks are freed
        self.kv_manager.free(request.request_id)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1

    def _schedule_waiting(self, plan: _StepPlan) -> None:
        seq_slots_used = self._num_seq_slots_used()
        while self.waiting and plan.tokens_left > 0:
            request = self.waiting.peek()
            seq_slots = 1 + len(request.pending_forks)
            if seq_slots_used + seq_slots > self.config.max_num_seqs:
                break
            # prefix cache hit: the prefill starts after the matched blocks
            prefix = (self.kv_manager.match_prefix(request) if request.request_id not in self.parked
                      else None)
            if prefix is not None and self._prefix_in_flight(request, prefix.num_tokens):
                break                        # admit next step, sharing what is being computed
            if request.request_id in self.parked:      # prefilled ahead: resumes its decode
                num_tokens = self._num_tokens_to_schedule(request, plan.tokens_left)
                slots = (self.kv_manager.allocate_slots(request, num_tokens)
                         if num_tokens > 0 else None)
                if slots is None:
                    if self._drop_parked(keep=request):
                        continue
                    break
                del self.parked[request.request_id]
            elif self.swapper is not None and self.swapper.is_swapped(request):   # swap-in
                num_tokens, slots = self.swapper.admit(request, prefix, plan.tokens_left,
                                                       self._num_tokens_to_schedule)
            else:
                request.num_computed_tokens = prefix.num_tokens if prefix else 0
                num_tokens = self._num_tokens_to_schedule(request, plan.tokens_left)
                slots = (self.kv_manager.allocate_slots(request, num_tokens, prefix)
                         if num_tokens > 0 else None)
            if slots is None:
                request.num_computed_tokens = 0
                if self.swapper is not None and self.swapper.make_room(keep=request):
                    continue                     # in-flight swap copies held the blocks
                if self._drop_parked(keep=request):
                    continue                     # parked requests queue behind it
                break
            self.waiting.pop()
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
            seq_slots_used += seq_slots
            plan.add(request, num_tokens, slots.block_copies)

    def _prefill_ahead(self, plan: _StepPlan) -> None:
        """Step 3 of the module docstring: park up to ``prefill_ahead`` requests that have no
        sequence slot, in queue order, while the token budget and the KV blocks (less a
        reserve for the running requests' next blocks) take their whole prompt."""
        room = self.config.prefill_ahead - len(self.parked)
        if room <= 0 or not self.waiting:
            return
        now = time.monotonic()
        for request in list(self.waiting):
            if room == 0 or plan.tokens_left == 0:
                break
            if not self._may_prefill_ahead(request):
                continue
            prefix = self.kv_manager.match_prefix(request)
            matched = prefix.num_tokens if prefix else 0
            if prefix is not None and self._prefix_in_flight(request, matched):
                continue
            request.num_computed_tokens = matched
            num_tokens = self._num_tokens_to_schedule(request, plan.tokens_left)
            if num_tokens != request.num_remaining_tokens:
                request.num_computed_tokens = 0
                continue                       # the whole prompt in one step, or not ahead
            if not self._fits_ahead(request):
                request.num_computed_tokens = 0
                break
            slots = self.kv_manager.allocate_slots(request, num_tokens, prefix)
            if slots is None:
                request.num_computed_tokens = 0
                break
            request.status = RequestStatus.RUNNING       # for this step only (update parks it)
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
            self.parked[request.request_id] = request
            plan.add(request, num_tokens, slots.block_copies)
            room -= 1

    def _may_prefill_ahead(self, request: Request) -> bool:
        # fresh requests only: not parked already, not preempted, not forking n > 1 siblings
        return (request.status is RequestStatus.WAITING and request.request_id not in self.parked
                and not request.pending_forks and not request.num_output_tokens)

    def _fits_ahead(self, request: Request) -> bool:
        """Its blocks fit beside a reserve for the running requests' next blocks (counted as
        if every block were new: prefix-matched ones may be cached ones, i.e. "free")."""
        need = (cdiv(request.num_tokens, self.config.block_size)
                + self.kv_manager.next_step_reserve(self.running))
        return need <= self.kv_manager.num_free_blocks

    def _prefills_ahead_next(self) -> bool:
        """Whether the next step will prefill a waiting request ahead (room, and the first
        candidate's blocks fit)."""
        if len(self.parked) >= self.config.prefill_ahead:
            return False
        candidate = next((r for r in self.waiting if self._may_prefill_ahead(r)), None)
        return candidate is not None and self._fits_ahead(candidate)

    def _drop_parked(self, keep: Request | None = None) -> bool:
        """KV blocks are short: the parked request last in queue order gives its blocks back,
        as a preempted request does (its KV swapped out, or recomputed on admission). False
        when there is none (``keep`` and requests in this step's prefill do not count)."""
        for request in reversed(list(self.waiting)):
            if (request.request_id in self.parked and request is not keep
                    and request.status is RequestStatus.WAITING):
                del self.parked[request.request_id]
                self._give_back_kv(request)
                return True
        return False

    def _prefix_in_flight(self, request: Request, num_matched: int) -> bool:
        """Whether a running request is prefilling at least one more full block of this
        request's prefix than the cache holds: waiting a step then shares it instead of
        computing it twice. Running requests always progress, so the wait is bounded."""
        B = self.config.block_size
        limit = (request.num_tokens - 1) // B * B         # the last token is always computed
        for other in self.running:
            if other.num_computed_tokens >= other.num_prompt_tokens:
                continue                                   # decoding: its prompt is cached
            shared = common_prefix_len(other.prompt_token_ids, request.all_token_ids)
            if min(shared // B * B, limit) >= num_matched + B:
                return True
        return False

    def _fork_completed_prompts(self, plan: _StepPlan) -> None:
        """After all allocation (no preemption can follow), so a forking parent is sure to run
        this step and its logits row is there for the children's first samples."""
        now = time.monotonic()
        for request_id, parent in list(plan.requests.items()):
            completes = (parent.num_computed_tokens + plan.num_scheduled_tokens[request_id]
                         == parent.num_tokens)
            if not (parent.pending_forks and completes):
                continue
            for child in parent.pending_forks:
                self.kv_manager.fork(request_id, child.request_id)
                del self._pending_fork_parent[child.request_id]
                child.status = RequestStatus.RUNNING
                child.first_scheduled_time = now
                self.running.append(child)
                plan.forked[child.request_id] = request_id
                plan.forked_requests.append(child)
            parent.pending_forks.clear()

    # ---- after the forward ---------------------------------------------------------------
    def update_from_output(self, output: SchedulerOutput,
                           sampled: dict[str, list[int]]) -> list[Request]:
        """Advance computed tokens and append sampled ids; returns the requests that got tokens.

        ``sampled`` must hold ids exactly for the requests whose computed tokens reach
        ``num_tokens`` this step and for the forked children. Requests finished while the step
        ran (e.g. aborted) are skipped.
        """
        advanced: list[tuple[Request, list[int]]] = []
        # a multi-step call that ended early (interrupted) ran fewer steps than the policy was
        # told at scheduling (on_step_scheduled): request_id -> decode steps not run
        unused: dict[str, int] = {}
        for request in output.scheduled:
            if request.status is not RequestStatus.RUNNING:
                continue
            num_ahead = _num_ahead(output, request.request_id)
            num_computed = (request.num_computed_tokens
                            + output.num_scheduled_tokens[request.request_id] - num_ahead)
            if num_computed > request.num_tokens:
                raise RuntimeError(f"{request!r} scheduled past its last token")
            tokens = sampled.get(request.request_id) or []
            if len(tokens) > num_ahead + 1:
                raise ValueError(f"request {request.request_id!r}: {len(tokens)} tokens for "
                                 f"{num_ahead} slots ahead of its last token")
            if (num_computed == request.num_tokens) != bool(tokens):
                raise ValueError(f"request {request.request_id!r}: sampled {tokens!r} but "
                                 f"computed {num_computed} of {request.num_tokens} tokens")
            if tokens and len(tokens) < num_ahead + 1:
                unused[request.request_id] = num_ahead + 1 - len(tokens)
            advanced.append((request, tokens))
        forked: list[tuple[Request, list[int]]] = []
        for child_id in output.forked:
            child = self.requests.get(child_id)
            if child is None or child.status is not RequestStatus.RUNNING:
                continue
            tokens = sampled.get(child_id) or []
            if not tokens:
                raise ValueError(f"forked request {child_id!r} got no sampled token")
            forked.append((child, tokens))

        if unused:
            self.waiting.on_decode_steps_unused(unused)
        now = time.monotonic()
        got_tokens: list[Request] = []
        for request, tokens in advanced:
            # speculative decoding: of the proposed tokens only the accepted ones (all emitted
            # tokens but the last) count as computed; their KV slots hold the right ids (so do
            # a multi-step decode's: every token it returns but the last was fed back in)
            num_ahead = _num_ahead(output, request.request_id)
            request.num_computed_tokens += (output.num_scheduled_tokens[request.request_id]
                                            - num_ahead + max(0, len(tokens) - 1))
            if tokens:
                self._append_tokens(request, tokens, now)
                got_tokens.append(request)
            # newly computed full blocks become shareable by later (and waiting) requests
            self.kv_manager.cache_computed_blocks(request)
            if num_ahead:                  # blocks holding only unused slots go back
                self.kv_manager.trim(request.request_id, request.num_tokens)
        for request in self.parked.values():
            if request.status is RequestStatus.RUNNING:
                request.status = RequestStatus.WAITING     # prefilled ahead: parked
        for child, tokens in forked:
            # it shares the parent's prompt KV, computed in this step
            child.num_computed_tokens = child.num_tokens
            self.kv_manager.cache_computed_blocks(child)
            self._append_tokens(child, tokens, now)
            got_tokens.append(child)
        return got_tokens

    @staticmethod
    def _append_tokens(request: Request, tokens: list[int], now: float) -> None:
        for token in tokens:
            request.append_output_token(token)
        if request.first_token_time is None:
            request.first_token_time = now

    # ---- invariants ----------------------------------------------------------------------
    def check_integrity(self) -> None:
        """KV accounting plus: each unfinished request is in exactly one place, running ones
        hold blocks, waiting and pending ones hold none, no block table is orphaned."""
        # blocks an outgoing swap copy still reads are referenced by the swapper
        self.kv_manager.check_integrity(self.swapper.held_block_refs() if self.swapper else None)
        prefetched = self.swapper.prefetched_ids() if self.swapper is not None else set()
        running_ids = [r.request_id for r in self.running]
        waiting_ids = [r.request_id for r in self.waiting]
        pending_ids = list(self._pending_fork_parent)
        places = running_ids + waiting_ids + pending_ids
        assert len(places) == len(set(places)), f"a request is in two places: {sorted(places)}"
        assert set(places) == set(self.requests), (
            f"tracked {sorted(self.requests)} but placed {sorted(places)}")
        for request in self.running:
            assert self.requests[request.request_id] is request
            assert request.status is RequestStatus.RUNNING, f"{request!r} in running list"
            assert self.kv_manager.has_blocks(request.request_id), f"running {request!r} has no blocks"
            assert 0 <= request.num_computed_tokens <= request.num_tokens, f"{request!r}"
            num_blocks = len(self.kv_manager.get_block_ids(request.request_id))
            assert num_blocks >= cdiv(request.num_computed_tokens, self.config.block_size), (
                f"{request!r} has computed KV beyond its {num_blocks} blocks")
            self.kv_manager.check_window(request.request_id, request.num_computed_tokens)
        for request in self.waiting:
            assert self.requests[request.request_id] is request
            if request.request_id in self.parked:
                assert request.status in (RequestStatus.WAITING, RequestStatus.RUNNING), (
                    f"parked {request!r}")
                assert self.kv_manager.has_blocks(request.request_id), f"parked {request!r}"
                if request.status is RequestStatus.WAITING:
                    assert request.num_computed_tokens == request.num_tokens - 1, (
                        f"parked {request!r} must hold all its KV but the sampled token's")
                continue
            assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED), f"{request!r}"
            assert (request.request_id in prefetched
                    or not self.kv_manager.has_blocks(request.request_id)), (
                f"waiting {request!r} holds blocks")
            assert request.num_computed_tokens == 0, f"waiting {request!r} kept computed tokens"
        for child_id, parent in self._pending_fork_parent.items():
            child = self.requests[child_id]
            assert child.status is RequestStatus.WAITING, f"pending fork {child!r}"
            assert any(c is child for c in parent.pending_forks), f"{child!r} lost by its parent"
            assert self.requests.get(parent.request_id) is parent, f"{child!r} has a finished parent"
            assert not self.kv_manager.has_blocks(child_id), f"pending fork {child!r} holds blocks"
        if self.swapper is not None:
            self.swapper.check_integrity(set(waiting_ids))
        assert set(self.parked) <= set(waiting_ids), (
            f"parked outside the queue: {sorted(self.parked)}")
        assert len(self.parked) <= self.config.prefill_ahead, "prefill_ahead exceeded"
        orphans = (set(self.kv_manager.request_ids()) - set(running_ids) - prefetched
                   - set(self.parked))
        assert not orphans, f"block tables of non-running requests: {sorted(orphans)}"
        assert self._num_seq_slots_used() <= self.config.max_num_seqs, "max_num_seqs exceeded"
