"""Waiting-queue policies behind one interface, chosen by name through a registry."""
from __future__ import annotations

import bisect
import itertools
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence

from kvforge.engine.request import Request

_POLICIES: dict[str, type["RequestQueue"]] = {}


def register_queue_policy(name: str):
    def deco(cls: type[RequestQueue]) -> type[RequestQueue]:
        _POLICIES[name] = cls
        cls.policy_name = name
        return cls
    return deco


def available_policies() -> list[str]:
    return sorted(_POLICIES)


def create_request_queue(policy: str, **options) -> "RequestQueue":
    """``options`` go to the policy's constructor (mlfq: ``config=MLFQConfig(...)``)."""
    if policy not in _POLICIES:
        raise ValueError(f"unknown scheduling policy {policy!r}; known: {available_policies()}")
    return _POLICIES[policy](**options)


class RequestQueue(ABC):
    """The scheduler's waiting queue.

    Contract:
    - ``peek``/``pop`` give the request to admit next; both raise IndexError when empty.
    - ``add`` enqueues a new request; ``prepend`` re-enqueues a preempted one so that it is
      admitted no later than it would have been before preemption (FCFS: the very front).
    - ``remove`` takes out a request that is in the queue (ValueError otherwise), e.g. on abort.
    - iteration yields requests in admission order; ``len``/``bool`` count them.
    - ``select_preemption_victim(running)`` names the running request the policy gives up first
      when KV blocks run out.
    A request is in the queue at most once; the queue never changes a request's fields.
    """

    policy_name: str = "base"

    @abstractmethod
    def add(self, request: Request) -> None: ...

    @abstractmethod
    def prepend(self, request: Request) -> None: ...

    @abstractmethod
    def peek(self) -> Request: ...

    @abstractmethod
    def pop(self) -> Request: ...

    @abstractmethod
    def remove(self, request: Request) -> None: ...

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[Request]: ...

    def __bool__(self) -> bool:
        return len(self) > 0

    def bind_prefix_matcher(self, match_length: Callable[[Request], int]) -> None:
        """Cache-aware policies get ``match_length(request)`` = tokens of the request the prefix
        cache already holds; the default ignores it."""

    def select_preemption_victim(self, running: Sequence[Request]) -> Request:
        """Default: the most recently admitted (last in the running list)."""
        if not running:
            raise ValueError("no running request to preempt")
        return running[-1]

    # ---- preemptive-policy hooks (mlfq); the defaults keep FCFS-style behaviour -----------
    def requests_to_yield(self, running: Sequence[Request], free_seq_slots: int) -> list[Request]:
        """Running requests the scheduler should preempt at the start of a step so that
        higher-ranked waiting requests run (``free_seq_slots`` = unused ``max_num_seqs``)."""
        return []

    def decode_steps_bound(self, running: Sequence[Request]) -> int | None:
        """With every sequence slot taken and requests waiting: how many decode steps the
        running requests may take before this policy would preempt one for a waiting request
        (1 = it would now; None = it never does: FCFS and priority wait for a slot)."""
        return None

    def order_running(self, running: list[Request]) -> None:
        """Reorder the running list in place (earlier = first share of the token budget)."""

    def on_step_scheduled(self, num_scheduled_tokens: Mapping[str, int],
                          scheduled: Mapping[str, Request],
                          num_lookahead_tokens: Mapping[str, int] | None = None) -> None:
        """Called once per step with its final plan: tokens of work each request got
        (``num_lookahead_tokens``: of those, the multi-step decode slots after its last token)."""

    def on_decode_steps_unused(self, unused: Mapping[str, int]) -> None:
        """A multi-step decode call ran fewer steps than planned (interrupted by an arrival,
        engine/decode_steps.py, or run as one plain step): ``unused[request_id]`` of the decode
        steps ``on_step_scheduled`` charged that request did not run."""

    def forget(self, request: Request) -> None:
        """The request finished or was aborted: drop any state kept about it."""


@register_queue_policy("fcfs")
class FCFSRequestQueue(RequestQueue):
    """First come, first served; preempted requests jump back to the front."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def prepend(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek(self) -> Request:
        if not self._queue:
            raise IndexError("peek from an empty request queue")
        return self._queue[0]

    def pop(self) -> Request:
        if not self._queue:
            raise IndexError("pop from an empty request queue")
        return self._queue.popleft()

    def remove(self, request: Request) -> None:
        for i, queued in enumerate(self._queue):
            if queued is request:
                del self._queue[i]
                return
        raise ValueError(f"request {request.request_id!r} is not in the queue")

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


@register_queue_policy("priority")
class PriorityRequestQueue(RequestQueue):
    """Lower ``priority`` value first, then earlier ``arrival_time``, then insertion order.

    Kept as a sorted list: admission order is its iteration order, and removing from the middle
    needs no lazy-deletion bookkeeping. A preempted request simply goes back in at its key,
    which already places it ahead of every later arrival of equal priority.
    """

    def __init__(self) -> None:
        # (priority, arrival_time, insertion counter, request); the counter makes keys unique
        self._entries: list[tuple[int, float, int, Request]] = []
        self._counter = itertools.count()

    def add(self, request: Request) -> None:
        entry = (request.priority, request.arrival_time, next(self._counter), request)
        bisect.insort(self._entries, entry, key=lambda e: e[:3])

    def prepend(self, request: Request) -> None:
        self.add(request)

    def peek(self) -> Request:
        if not self._entries:
            raise IndexError("peek from an empty request queue")
        return self._entries[0][3]

    def pop(self) -> Request:
        if not self._entries:
            raise IndexError("pop from an empty request queue")
        return self._entries.pop(0)[3]

    def remove(self, request: Request) -> None:
        for i, entry in enumerate(self._entries):
            if entry[3] is request:
                del self._entries[i]
                return
        raise ValueError(f"request {request.request_id!r} is not in the queue")

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[Request]:
        return (entry[3] for entry in self._entries)

    def select_preemption_victim(self, running: Sequence[Request]) -> Request:
        """The lowest priority (largest value), latest arrival; ties go to the later admitted."""
        if not running:
            raise ValueError("no running request to preempt")
        index = max(range(len(running)),
                    key=lambda i: (running[i].priority, running[i].arrival_time, i))
        return running[index]


# cache-aware policies live in their own modules and register themselves on import
from kvforge.sched import lpm_queue as _lpm_queue  # noqa: E402,F401  ("lpm")
from kvforge.sched import mlfq as _mlfq  # noqa: E402,F401  ("mlfq")
