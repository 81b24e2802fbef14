"""Shut a server down after it has been idle for a while: what a kept-alive engine
(``kvforge generate --keep-alive``, kvforge/keep_alive.py) does when nobody has used it.

Idle means no HTTP request in flight and none finished within ``timeout_s``. Requests are
counted by an ASGI middleware around the whole app, so a streaming response counts until its
last chunk is sent (or its client goes away), not only until its handler returns. The watch
is a task on the server's event loop that sets uvicorn's ``should_exit``: the same graceful
path as SIGTERM (the lifespan hook stops the engine)."""
from __future__ import annotations

import asyncio
import time

import uvicorn


class IdleTracker:
    """ASGI middleware: in-flight HTTP requests and the time the last one ended."""

    def __init__(self, app) -> None:
        self.app = app
        self.in_flight = 0
        self.last_activity = time.monotonic()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1
            self.last_activity = time.monotonic()

    def idle_for(self) -> float:
        """Seconds since the server last had a request in flight (0 while one is)."""
        return 0.0 if self.in_flight else time.monotonic() - self.last_activity


async def exit_when_idle(server, tracker: IdleTracker, timeout_s: float) -> None:
    """Set ``server.should_exit`` once ``tracker`` has been idle for ``timeout_s``."""
    if timeout_s <= 0:
        raise ValueError(f"the idle timeout must be > 0 seconds, got {timeout_s}")
    poll = min(1.0, timeout_s / 4)
    while not server.should_exit:
        if tracker.idle_for() >= timeout_s:
            server.should_exit = True
            return
        await asyncio.sleep(poll)


class IdleExitServer(uvicorn.Server):
    """A uvicorn server that exits once ``tracker`` has been idle for ``timeout_s``."""

    def __init__(self, config: uvicorn.Config, tracker: IdleTracker, timeout_s: float) -> None:
        super().__init__(config)
        self.tracker = tracker
        self.timeout_s = timeout_s

    async def serve(self, sockets=None) -> None:
        watch = asyncio.create_task(exit_when_idle(self, self.tracker, self.timeout_s))
        try:
            await super().serve(sockets)
        finally:
            watch.cancel()
