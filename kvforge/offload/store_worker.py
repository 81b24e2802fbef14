"""Write-behind: KV blocks a batch just wrote go back to the disk tier on a thread of their
own, overlapping the next batch's compute (FlexGen's store lane)."""
from __future__ import annotations

import queue
import threading
from typing import Callable

from kvforge.offload.trace import TraceRecorder


class StoreWorker:
    def __init__(self, trace: TraceRecorder) -> None:
        self.trace = trace
        self._queue: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kvforge-offload-store",
                                        daemon=True)
        self._thread.start()

    def submit(self, name: str, write: Callable[[], None], done: Callable[[], None]) -> None:
        if self._error is not None:
            raise RuntimeError("offload store failed") from self._error
        self._queue.put((name, write, done))

    def flush(self) -> None:
        """Wait until every submitted write is on disk (before the next step reads it)."""
        self._queue.join()
        if self._error is not None:
            raise RuntimeError("offload store failed") from self._error

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                self._queue.task_done()
                return
            name, write, done = item
            try:
                start = self.trace.now()
                write()
                self.trace.add("store", name, start, self.trace.now())
            except BaseException as e:
                self._error = e
            finally:
                done()
                self._queue.task_done()
