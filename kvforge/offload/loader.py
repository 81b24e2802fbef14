"""The loader: reads stages (a decoder layer's weights, a chunk of the LM head, a batch's KV
blocks of one layer) from the disk tier into a ring of aligned slot buffers, in the order
compute will want them.

With ``prefetch`` reader threads (one, or several for small stages) read ahead while compute
runs (``os.preadv`` releases the GIL, as do torch's kernels), so stage i + 1 loads while stage
i computes; the ring's size bounds how far ahead they read and so the fast tier's bytes.
Without it (the naive policy) ``acquire`` reads synchronously: load, then compute, never both.
A slot is released by whoever finishes with it last (compute, or the store thread writing a
batch's KV back), in any order."""
from __future__ import annotations

import collections
import threading
from dataclasses import dataclass
from typing import Callable

import torch

from kvforge.offload.direct_io import AlignedBuffer
from kvforge.offload.trace import TraceRecorder


@dataclass(frozen=True)
class Stage:
    name: str                                  # "layer 3", "head 0", "kv 3/1"
    read: Callable[[memoryview], None]         # fills a slot


class Slot:
    def __init__(self, nbytes: int) -> None:
        self.buffer = AlignedBuffer(nbytes)
        self.stage: Stage | None = None
        self.ready = False
        self.acquired = False

    @property
    def tensor(self) -> torch.Tensor:
        return self.buffer.tensor


class StageLoader:
    def __init__(self, slot_bytes: int, num_slots: int, prefetch: bool,
                 trace: TraceRecorder, threads: int = 1) -> None:
        if num_slots < 1 or (prefetch and num_slots < 2):
            raise ValueError(f"the loader needs >= 1 slot (>= 2 to prefetch), got {num_slots}")
        if prefetch and not 1 <= threads < num_slots:
            raise ValueError(f"the loader needs 1 <= threads < slots ({num_slots}), got {threads}")
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self.slots = [Slot(slot_bytes) for _ in range(num_slots)]
        self.prefetch = prefetch
        self.trace = trace
        self._cond = threading.Condition()
        self._pending: collections.deque[Stage] = collections.deque()   # not yet read
        self._issued: list[Slot] = []                                   # read or reading
        self._free = collections.deque(self.slots)
        self._error: BaseException | None = None
        self._closed = False
        # reader threads: each takes the next pending stage and a free slot; compute still
        # acquires slots in schedule order (``_issued``), whichever thread read them
        self._threads = [threading.Thread(target=self._run, name="kvforge-offload-loader",
                                          daemon=True)
                         for _ in range(threads if prefetch else 0)]
        for t in self._threads:
            t.start()

    # ------------------------------------------------------------ compute side
    def resize(self, slot_bytes: int) -> None:
        """Bigger slots; only between steps (nothing scheduled or held)."""
        with self._cond:
            if self._pending or self._issued:
                raise RuntimeError("resizing the loader's slots while stages are in flight")
            self.slot_bytes = slot_bytes
            self.slots = [Slot(slot_bytes) for _ in range(self.num_slots)]
            self._free = collections.deque(self.slots)

    def schedule(self, stages: list[Stage]) -> None:
        with self._cond:
            self._pending.extend(stages)
            self._cond.notify_all()

    def outstanding(self) -> int:
        """Stages scheduled and not yet acquired."""
        with self._cond:
            return len(self._pending) + sum(not s.acquired for s in self._issued)

    def acquire(self, name: str) -> Slot:
        """The slot of the next scheduled stage, which must be ``name``; waits for its read."""
        if not self.prefetch:
            with self._cond:
                stage = self._pending.popleft()
                slot = self._free.popleft()
                slot.acquired = True
                self._issued.append(slot)
            self._check(stage, name)
            self._read(slot, stage)
            return slot
        with self._cond:
            while True:
                if self._error is not None:
                    raise RuntimeError("offload loader failed") from self._error
                slot = next((s for s in self._issued if not s.acquired), None)
                if slot is not None and slot.ready:
                    break
                if slot is None and not self._pending:
                    raise RuntimeError(f"offload schedule: compute wants {name!r}, nothing is "
                                       f"scheduled")
                self._cond.wait()
            slot.acquired = True
        self._check(slot.stage, name)
        return slot

    def release(self, slot: Slot) -> None:
        with self._cond:
            self._issued.remove(slot)
            slot.stage, slot.ready, slot.acquired = None, False, False
            self._free.append(slot)
            self._cond.notify_all()

    def drain(self) -> None:
        """Consume every scheduled stage not yet acquired (a step that ended without them)."""
        while self.outstanding():
            with self._cond:
                slot = next((s for s in self._issued if not s.acquired), None)
                name = slot.stage.name if slot is not None else self._pending[0].name
            self.release(self.acquire(name))

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        for t in self._threads:
            t.join()

    def _check(self, stage: Stage | None, name: str) -> None:
        if stage is None or stage.name != name:
            raise RuntimeError(f"offload schedule out of order: compute wants {name!r}, the "
                               f"loader holds {stage.name if stage else None!r} "
                               f"({self._queue_state()})")

    def _queue_state(self) -> str:
        """What the loader holds, for the order check's message: a mismatch is a bug in the
        caller's schedule, and the queue around it names which stages were doubled or lost."""
        with self._cond:
            issued = [f"{s.stage.name if s.stage else None}"
                      f"{' (acquired)' if s.acquired else ''}" for s in self._issued]
            pending = [s.name for s in list(self._pending)[:4]]
            more = len(self._pending) - len(pending)
        return (f"issued {issued}, next pending {pending}"
                + (f" and {more} more" if more > 0 else ""))

    def _read(self, slot: Slot, stage: Stage) -> None:
        start = self.trace.now()
        stage.read(slot.buffer.view)
        self.trace.add("load", stage.name, start, self.trace.now())
        with self._cond:
            slot.stage, slot.ready = stage, True

    # ------------------------------------------------------------ loader thread
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closed and not (self._pending and self._free):
                    self._cond.wait()
                if self._closed:
                    return
                stage = self._pending.popleft()
                slot = self._free.popleft()
                slot.stage, slot.ready = stage, False
                self._issued.append(slot)
            try:
                self._read(slot, stage)
            except BaseException as e:          # surfaced to compute by acquire()
                with self._cond:
                    self._error = e
                    self._cond.notify_all()
                return
            with self._cond:
                self._cond.notify_all()
