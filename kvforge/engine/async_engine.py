"""AsyncLLMEngine: the engine loop on its own thread, one async stream of outputs per request.

    asyncio side (server)                     engine thread (owns the LLMEngine)
    ─────────────────────                     ──────────────────────────────────
    generate() ──add cmd──► commands queue ─► drain: add_request / abort_request / call
       ▲                                       │ step() while requests are unfinished
       │ per-request asyncio.Queue ◄─ call_soon_threadsafe(put RequestOutput)
       └ cancelled (client gone) ──abort cmd──►

Only the engine thread touches the LLMEngine, so nothing in it needs a lock. Commands run
between steps; an add never waits for other requests to finish, only for the current step:
an add or abort also interrupts a multi-step decode call after its step in flight
(``LLMEngine.interrupt_decode_steps``, a flag the compiled call reads between steps).
Torch kernels release the GIL, so the event loop keeps serving while a step runs.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable, TypeVar

from kvforge.engine.llm_engine import LLMEngine
from kvforge.engine.outputs import RequestOutput
from kvforge.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
T = TypeVar("T")


class EngineDeadError(RuntimeError):
    """The engine thread stopped (shutdown or a crash); no new requests can run."""


@dataclass
class EngineStats:
    """A snapshot taken by the engine thread after every step and after every batch of
    commands (so an abort that empties the engine shows at once; read by metrics / admission)."""
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0         # blocks requests reference / all blocks (0 when idle)
    num_free_blocks: int = 0            # free + evictable cached blocks
    num_preemptions_total: int = 0
    num_steps: int = 0
    # prefix cache (all 0 with it off): blocks it holds, those of them no request uses, and
    # the tokens admissions asked for / found cached since start
    prefix_cache_blocks: int = 0
    prefix_cache_evictable_blocks: int = 0
    prefix_cache_query_tokens: int = 0
    prefix_cache_hit_tokens: int = 0

    @property
    def prefix_cache_hit_rate(self) -> float:
        q = self.prefix_cache_query_tokens
        return self.prefix_cache_hit_tokens / q if q else 0.0


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine,
                 step_callback: Callable[[EngineStats], None] | None = None) -> None:
        self.engine = engine
        self.stats = EngineStats(num_free_blocks=engine.num_free_blocks)
        self._step_callback = step_callback
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="kvforge-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ public, any thread
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._stop.is_set()

    async def call(self, fn: Callable[[LLMEngine], T], *, interrupt: bool = False) -> T:
        """Run ``fn(engine)`` on the engine thread between steps; its exception is re-raised.
        ``interrupt``: end a multi-step decode call in flight after its current step instead
        of waiting for all its steps (what an arrival does; a stats read need not)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._submit(("call", fn, fut), interrupt=interrupt)
        return await asyncio.wrap_future(fut)

    async def add_request(self, request_id: str, prompt: str | list[int],
                          params: SamplingParams, *, arrival_time: float | None = None,
                          priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Validate and queue a request (a bad one raises ValueError here, nothing is queued);
        returns the stream of its outputs. Closing the stream early aborts the request."""
        loop = asyncio.get_running_loop()
        out_queue: asyncio.Queue = asyncio.Queue()
        arrival = time.monotonic() if arrival_time is None else arrival_time

        def add(engine: LLMEngine) -> None:
            engine.add_request(request_id, prompt, params, arrival_time=arrival, priority=priority)
            self._streams[request_id] = (loop, out_queue)   # engine thread: registered atomically

        await self.call(add, interrupt=True)
        return self._stream(request_id, out_queue)

    async def generate(self, prompt: str | list[int], params: SamplingParams,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        stream = await self.add_request(request_id, prompt, params)
        async for out in stream:
            yield out

    def abort(self, request_id: str) -> None:
        if self.is_running:         # never raises: closing streams call it while shutting down
            self._commands.put(("abort", request_id, None))
            self.engine.interrupt_decode_steps()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop; unfinished requests are aborted and their streams end."""
        self._stop.set()
        self._commands.put(("wake", None, None))
        self._thread.join(timeout)

    # ------------------------------------------------------------------ private
    def _submit(self, cmd, interrupt: bool = False) -> None:
        if not self.is_running:
            raise EngineDeadError(f"the engine is not running ({self._error or 'shut down'})")
        self._commands.put(cmd)
        if interrupt:         # after the put: the call it ends finds the command queued
            self.engine.interrupt_decode_steps()

    async def _stream(self, request_id: str, out_queue: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while True:
                item = await out_queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:          # client went away (cancelled / closed): free its KV now
                self.abort(request_id)

    def _deliver(self, request_id: str, item) -> None:
        target = self._streams.get(request_id)
        if target is None:
            return
        loop, out_queue = target
        try:
            loop.call_soon_threadsafe(out_queue.put_nowait, item)
        except RuntimeError:          # the caller's event loop is closed: nobody listens
            self._streams.pop(request_id, None)
            self.engine.abort_request(request_id)

    def _run_command(self, cmd) -> None:
        kind, arg, fut = cmd
        if kind == "abort":
            self.engine.abort_request(arg)
            self._streams.pop(arg, None)
        elif kind == "call":
            if not fut.set_running_or_notify_cancel():
                return
            try:
                fut.set_result(arg(self.engine))
            except BaseException as e:          # noqa: BLE001 - handed to the caller
                fut.set_exception(e)

    def _drain(self, block: bool) -> bool:
        """Run the queued commands; whether there were any."""
        try:
            cmd = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return False
        while True:
            self._run_command(cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                # before the drain: a command queued after it interrupts the next call
                self.engine.clear_decode_interrupt()
                if self._drain(block=not self.engine.has_unfinished_requests()):
                    self._update_stats(stepped=False)   # adds and aborts show before a step
                if self._stop.is_set() or not self.engine.has_unfinished_requests():
                    continue
                outputs = self.engine.step()
                self._update_stats(stepped=True)
                for out in outputs:
                    self._deliver(out.request_id, out)
                    if out.finished:
                        self._streams.pop(out.request_id, None)
        except BaseException as e:              # noqa: BLE001 - reported to every waiter
            logger.exception("engine loop crashed")
            self._error = e
        finally:
            self._stop.set()
            self._close_all()
            self.engine.shutdown()      # tensor-parallel workers stop with the loop

    def _close_all(self) -> None:
        """Abort what is left, end every stream and fail queued commands."""
        err = EngineDeadError(f"the engine stopped ({self._error or 'shut down'})")
        for rid in list(self._streams):
            self.engine.abort_request(rid)
            self._deliver(rid, err)
        self._streams.clear()
        while True:
            try:
                kind, arg, fut = self._commands.get_nowait()
            except queue.Empty:
                break
            if fut is not None and fut.set_running_or_notify_cancel():
                fut.set_exception(err)
        self._update_stats(stepped=False)

    def _update_stats(self, stepped: bool) -> None:
        e = self.engine
        s = self.stats
        s.num_running = e.scheduler.num_running
        s.num_waiting = e.scheduler.num_waiting
        s.kv_cache_usage = e.kv_cache_usage
        s.num_free_blocks = e.num_free_blocks
        s.num_preemptions_total = getattr(e, "num_preemptions_total", 0)
        s.num_steps += stepped
        prefix = e.prefix_cache_stats
        if prefix is not None:
            s.prefix_cache_blocks = prefix.cached_blocks
            s.prefix_cache_evictable_blocks = prefix.evictable_blocks
            s.prefix_cache_query_tokens = prefix.query_tokens
            s.prefix_cache_hit_tokens = prefix.hit_tokens
        if self._step_callback is not None:
            self._step_callback(s)
