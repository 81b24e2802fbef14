"""A small copy engine for KV swaps: copies run off the scheduling thread and the caller waits
on a handle only when it needs the bytes.

    scheduler thread                                copy worker (one thread, FIFO)
    submit(fn) -> CopyHandle ──── queue ──────────► fn()      CUDA: on a side stream, after the
    ... the model's forward runs ...                  │        work queued on the compute stream
    wait(handle)  (only when the blocks are needed) ◄─┘ done   at submit time (an event)

- CPU: torch tensor copies (index_select / index_copy_) and numpy memmap writes release the GIL,
  so the worker's copies overlap the forward (given a core to run on).
- CUDA: the worker issues the copies on its own stream, which first waits for an event recorded
  on the submitter's stream (so a swap-out reads blocks only after the forwards that wrote them),
  then synchronizes that stream before the handle reports done (so a waiter may use the bytes).
  UNTESTED: the suite runs on CPU only (tests/kvcache/test_copy_engine.py covers the CPU worker
  and sync mode); no test has run this stream / event path on a GPU.
- One worker, FIFO: a request's swap-in is always queued after its swap-out and reads complete
  bytes without any extra ordering.
- ``sync`` mode runs every copy inline at submit: the same code path, nothing overlapped.

``stats``: copy seconds (time spent inside copies, on whichever thread), exposed seconds (time
the scheduling thread was blocked: inline copies or waits) and their difference, the copy time
hidden behind other work.
"""
from __future__ import annotations

import os
import queue
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

COPY_MODES = ("auto", "async", "sync")


@dataclass
class CopyStats:
    num_copies: int = 0
    copy_seconds: float = 0.0       # inside copies (worker or inline)
    exposed_seconds: float = 0.0    # the scheduling thread blocked on copies

    @property
    def overlapped_seconds(self) -> float:
        """Copy time that ran while the scheduling thread did other work."""
        return max(0.0, self.copy_seconds - self.exposed_seconds)


class CopyHandle:
    """Completion of one submitted copy; ``wait`` through the engine (it counts the time)."""

    __slots__ = ("_done", "_error")

    def __init__(self) -> None:
        self._done = threading.Event()
        self._error: BaseException | None = None

    def done(self) -> bool:
        return self._done.is_set()

    def _finish(self, error: BaseException | None) -> None:
        self._error = error
        self._done.set()


def resolve_copy_mode(mode: str, device: torch.device) -> str:
    """``auto``: async on CUDA (a side stream is free), and on CPU when torch's intra-op threads
    leave a core for the worker; with every core busy in GEMMs the copies would only steal
    time from the forward, so sync."""
    if mode not in COPY_MODES:
        raise ValueError(f"swap copy mode must be one of {COPY_MODES}, got {mode!r}")
    if mode != "auto":
        return mode
    if device.type == "cuda":
        return "async"
    return "async" if torch.get_num_threads() < (os.cpu_count() or 1) else "sync"


class KVCopyEngine:
    """Runs copy callables inline (``sync``) or on one background worker (``async``)."""

    def __init__(self, mode: str = "sync", device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.mode = resolve_copy_mode(mode, self.device)
        self.stats = CopyStats()
        self._queue: queue.SimpleQueue | None = None
        self._stream = None

    @property
    def is_async(self) -> bool:
        return self.mode == "async"

    def submit(self, fn: Callable[[], None]) -> CopyHandle:
        handle = CopyHandle()
        self.stats.num_copies += 1
        if not self.is_async:
            start = time.perf_counter()
            try:
                with torch.inference_mode():
                    fn()
            finally:
                spent = time.perf_counter() - start
                self.stats.copy_seconds += spent
                self.stats.exposed_seconds += spent
            handle._finish(None)
            return handle
        ready = None
        if self.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
        self._worker_queue().put((fn, handle, ready))
        return handle

    def wait(self, handle: CopyHandle) -> None:
        """Block until the copy is done (counted as exposed time); re-raise its error."""
        if not handle.done():
            start = time.perf_counter()
            handle._done.wait()
            self.stats.exposed_seconds += time.perf_counter() - start
        if handle._error is not None:
            raise RuntimeError("a KV swap copy failed") from handle._error

    def _worker_queue(self) -> queue.SimpleQueue:
        if self._queue is None:
            self._queue = queue.SimpleQueue()
            if self.device.type == "cuda":
                self._stream = torch.cuda.Stream(self.device)
            # the worker holds the queue and the stats, never the engine: when the engine is
            # collected the finalizer's sentinel ends the thread
            worker = threading.Thread(target=_run_worker,
                                      args=(self._queue, self.stats, self._stream),
                                      name="kvforge-kv-copy", daemon=True)
            worker.start()
            self._finalizer = weakref.finalize(self, _stop_worker, self._queue, worker)
        return self._queue

    def close(self) -> None:
        """Stop the worker after the copies already queued (idempotent)."""
        if self._queue is not None:
            self._finalizer()
            self._queue = None


def _run_worker(jobs: queue.SimpleQueue, stats: CopyStats, stream) -> None:
    while True:
        job = jobs.get()
        if job is None:
            return
        _run_job(*job, stats, stream)
        # drop the finished job while blocked on the next one: its callable references the
        # swapper, which owns this engine, and must not keep it alive
        del job


def _run_job(fn: Callable[[], None], handle: CopyHandle, ready, stats: CopyStats, stream) -> None:
    start = time.perf_counter()
    error = None
    try:
        if stream is None:
            with torch.inference_mode():
                fn()
        else:
            with torch.inference_mode(), torch.cuda.stream(stream):
                stream.wait_event(ready)
                fn()
            stream.synchronize()
    except BaseException as exc:    # handed to the waiter, never lost in the thread
        error = exc
    stats.copy_seconds += time.perf_counter() - start
    handle._finish(error)


def _stop_worker(jobs: queue.SimpleQueue, worker: threading.Thread) -> None:
    """Finalizer of an engine (collected, closed, or at interpreter exit): the worker runs the
    copies already queued, then ends; joined so that it never outlives the interpreter."""
    jobs.put(None)
    if worker is not threading.current_thread():
        worker.join(timeout=60.0)   # bounded: a copy stuck on I/O must not hang the exit
