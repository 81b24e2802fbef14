"""Longest-prefix-match (LPM) waiting queue: admit the request the prefix cache helps most.

SGLang's cache-aware scheduling: among the waiting requests, the one with the longest cached
prefix goes first, so requests sharing a prefix run while that prefix is still cached instead of
being interleaved with others that evict it. Ties keep arrival order.

Aging bound (no starvation): every time a request is admitted ahead of an earlier arrival, that
earlier request's bypass count grows; once the oldest waiting request has been bypassed
``max_bypasses`` times it is admitted next regardless of matches. So a request waits for at most
``max_bypasses`` later arrivals per request ahead of it.

    waiting (arrival order):  r0 (match 0, bypassed 2)  r1 (match 96)  r2 (match 96)  r3 (match 0)
    peek -> r1   (longest match, earliest among ties); after pop r0 has bypassed 3
    ... once r0.bypassed == max_bypasses, peek -> r0

Preempted requests come back first (before any match), as in FCFS. Only the first
``scan_limit`` waiting requests are scored, so one peek costs O(scan_limit * prompt / B).
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator

from kvforge.engine.request import Request
from kvforge.sched.queues import RequestQueue, register_queue_policy


@register_queue_policy("lpm")
class LongestPrefixMatchQueue(RequestQueue):
    max_bypasses: int = 16
    scan_limit: int = 256

    def __init__(self) -> None:
        self._preempted: deque[Request] = deque()        # served first, in prepend order
        self._arrivals: list[Request] = []               # the rest, in arrival order
        self._bypassed: dict[str, int] = {}
        self._match_length: Callable[[Request], int] | None = None

    def bind_prefix_matcher(self, match_length: Callable[[Request], int]) -> None:
        self._match_length = match_length

    # ---- choice --------------------------------------------------------------------------
    def _order(self) -> list[Request]:
        """Admission order as the cache stands now."""
        head = self._arrivals[:self.scan_limit]
        if head and self._bypassed.get(head[0].request_id, 0) >= self.max_bypasses:
            rest = [head[0]], head[1:]
        else:
            rest = [], head
        if self._match_length is not None:
            scores = {r.request_id: self._match_length(r) for r in rest[1]}
            ranked = sorted(rest[1], key=lambda r: -scores[r.request_id])   # stable: arrival
        else:
            ranked = rest[1]
        return [*self._preempted, *rest[0], *ranked, *self._arrivals[self.scan_limit:]]

    def peek(self) -> Request:
        if not self:
            raise IndexError("peek from an empty request queue")
        if self._preempted:
            return self._preempted[0]
        return self._order()[0]

    def pop(self) -> Request:
        request = self.peek()
        if self._preempted and self._preempted[0] is request:
            return self._preempted.popleft()
        index = next(i for i, r in enumerate(self._arrivals) if r is request)
        for earlier in self._arrivals[:index]:
            self._bypassed[earlier.request_id] = self._bypassed.get(earlier.request_id, 0) + 1
        del self._arrivals[index]
        self._bypassed.pop(request.request_id, None)
        return request

    # ---- membership ----------------------------------------------------------------------
    def add(self, request: Request) -> None:
        self._arrivals.append(request)

    def prepend(self, request: Request) -> None:
        self._preempted.appendleft(request)

    def remove(self, request: Request) -> None:
        for i, queued in enumerate(self._preempted):
            if queued is request:
                del self._preempted[i]
                return
        for i, queued in enumerate(self._arrivals):
            if queued is request:
                del self._arrivals[i]
                self._bypassed.pop(request.request_id, None)
                return
        raise ValueError(f"request {request.request_id!r} is not in the queue")

    def __len__(self) -> int:
        return len(self._preempted) + len(self._arrivals)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._order())
