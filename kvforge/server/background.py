"""The OpenAI server in a thread of this process, on loopback: uvicorn serves from a daemon
thread while the engine stays at hand, so that tests and the soak benchmark can check it from
outside the API (``check_integrity``, block counts) without an endpoint for that.
"""
from __future__ import annotations

import asyncio
import socket
import threading
import time
from typing import Any, Callable, TypeVar

T = TypeVar("T")


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` now (the interface the server will bind: a port free on the
    loopback can be taken on another address)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def serve_in_thread(server, start_timeout: float = 120.0) -> threading.Thread:
    """Run a ``uvicorn.Server`` in a daemon thread and return once it listens. RuntimeError when
    its thread ends first (uvicorn ends it when the bind fails: a port taken by another
    process) or it is not listening within ``start_timeout`` seconds: the caller gets an error,
    never an endless wait."""
    thread = threading.Thread(target=server.run, name="kvforge-http", daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"the server did not start on "
                               f"{server.config.host}:{server.config.port}")
        time.sleep(0.05)
    return thread


class BackgroundServer:
    """``kvforge serve`` minus the process: engine + API on ``http://127.0.0.1:<port>``."""

    def __init__(self, engine_kwargs: dict[str, Any], *, served_model_name: str = "model",
                 log_level: str = "warning", start_timeout: float = 120.0,
                 **server_kwargs) -> None:
        import uvicorn

        from kvforge.config import EngineConfig
        from kvforge.engine.async_engine import AsyncLLMEngine
        from kvforge.engine.factory import create_engine
        from kvforge.server.metrics import ServerMetrics
        from kvforge.server.openai_api import ServerConfig, create_app

        self.config = ServerConfig(served_model_name=served_model_name, **server_kwargs)
        metrics = ServerMetrics(self.config.served_model_name)
        self.engine = AsyncLLMEngine(create_engine(EngineConfig.from_kwargs(**engine_kwargs)),
                                     step_callback=metrics.on_step)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(
            create_app(self.engine, self.config, metrics), host="127.0.0.1", port=self.port,
            log_level=log_level, timeout_graceful_shutdown=5))
        try:
            self.thread = serve_in_thread(self.server, start_timeout)
        except RuntimeError:
            self.engine.shutdown()
            raise

    def in_engine(self, fn: Callable[..., T]) -> T:
        """Run ``fn(llm_engine)`` on the engine thread (between steps) and return its result."""
        return asyncio.run(self.engine.call(fn))

    def wait_idle(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while self.in_engine(lambda e: e.has_unfinished_requests()):
            if time.monotonic() > deadline:
                raise AssertionError(f"the engine still has unfinished requests after {timeout} s")
            time.sleep(0.05)

    def check_clean(self) -> None:
        """No request left, every KV block free (cached ones count as free), invariants hold;
        AssertionError otherwise."""
        self.wait_idle()

        def check(e):
            e.check_integrity()
            return e.num_free_blocks, e.kv_manager.num_blocks, e.kv_cache_usage
        free, total, usage = self.in_engine(check)
        assert free == total, f"{total - free} KV blocks still held"
        assert usage == 0.0, f"KV usage {usage} with no request"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.engine.shutdown()
