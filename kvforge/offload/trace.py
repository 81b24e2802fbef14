"""A Chrome trace (chrome://tracing, Perfetto) of the offloaded run: one lane per activity
(load, compute, store) with an event per stage, and the overlap fraction it implies."""
from __future__ import annotations

import json
import threading
import time

LANES = {"load": 1, "compute": 2, "store": 3}


class TraceRecorder:
    """Thread-safe list of complete events; always on (a few per layer: cheap), written out
    only when asked."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._t0 = time.perf_counter()
        self.events: list[tuple[str, str, float, float]] = []   # (lane, name, start, end)

    def now(self) -> float:
        return time.perf_counter()

    def add(self, lane: str, name: str, start: float, end: float) -> None:
        if lane not in LANES:
            raise ValueError(f"unknown trace lane {lane!r}; lanes: {sorted(LANES)}")
        with self._lock:
            self.events.append((lane, name, start, end))

    def clear(self) -> None:
        with self._lock:
            self.events.clear()

    def busy_seconds(self, lane: str) -> float:
        return sum(e - s for ln, _, s, e in self.events if ln == lane)

    def overlap_fraction(self) -> float:
        """Share of the load lane's time during which compute ran too (1.0: every read hidden
        under compute; 0.0: none)."""
        loads = sorted((s, e) for ln, _, s, e in self.events if ln == "load")
        computes = _merge(sorted((s, e) for ln, _, s, e in self.events if ln == "compute"))
        total = sum(e - s for s, e in loads)
        if total <= 0:
            return 0.0
        hidden = 0.0
        j = 0
        for s, e in loads:
            while j < len(computes) and computes[j][1] <= s:
                j += 1
            k = j
            while k < len(computes) and computes[k][0] < e:
                hidden += min(e, computes[k][1]) - max(s, computes[k][0])
                k += 1
        return hidden / total

    def write(self, path: str) -> None:
        with self._lock:
            events = list(self.events)
        out = [{"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": lane}}
               for lane, tid in LANES.items()]
        out += [{"name": name, "cat": lane, "ph": "X", "pid": 1, "tid": LANES[lane],
                 "ts": (s - self._t0) * 1e6, "dur": (e - s) * 1e6}
                for lane, name, s, e in events]
        with open(path, "w") as f:
            json.dump({"traceEvents": out, "displayTimeUnit": "ms"}, f)


def _merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for s, e in intervals:
        if merged and s <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], e))
        else:
            merged.append((s, e))
    return merged
