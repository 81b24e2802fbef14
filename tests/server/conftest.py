"""A real kvforge server on a free loopback port: uvicorn in a thread, engine in-process (so tests
can reach the engine for check_integrity), plus an offline LLM on the same model as the oracle."""
from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest

TINY_ENGINE = dict(block_size=4, num_kv_blocks=256, max_num_batched_tokens=64, max_num_seqs=64,
                   num_threads=1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerThread:
    def __init__(self, model: str, *, engine_kwargs: dict, **server_kwargs) -> None:
        import uvicorn

        from kvforge.config import EngineConfig
        from kvforge.engine.async_engine import AsyncLLMEngine
        from kvforge.engine.llm_engine import LLMEngine
        from kvforge.server.metrics import ServerMetrics
        from kvforge.server.openai_api import ServerConfig, create_app

        self.config = ServerConfig(**{"served_model_name": "tiny", **server_kwargs})
        metrics = ServerMetrics(self.config.served_model_name)
        self.engine = AsyncLLMEngine(LLMEngine(EngineConfig.from_kwargs(model=model, **engine_kwargs)),
                                     step_callback=metrics.on_step)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(
            create_app(self.engine, self.config, metrics), host="127.0.0.1", port=self.port,
            log_level="warning", timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.05)

    def in_engine(self, fn):
        """Run fn(engine) on the engine thread (between steps) and return its result."""
        import asyncio
        return asyncio.run(self.engine.call(fn))

    def wait_idle(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while self.in_engine(lambda e: e.has_unfinished_requests()):
            if time.monotonic() > deadline:
                raise AssertionError("engine still has unfinished requests")
            time.sleep(0.05)

    def assert_clean(self) -> None:
        """No request left, every KV block free, allocator invariants hold."""
        self.wait_idle()

        def check(e):
            e.check_integrity()
            return e.num_free_blocks, e.kv_manager.num_blocks
        free, total = self.in_engine(check)
        assert free == total, f"{total - free} KV blocks still held"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.engine.shutdown()


@pytest.fixture(scope="package")
def tiny_path(tiny_model_factory) -> str:
    path, _ = tiny_model_factory("llama")
    return path


@pytest.fixture(scope="package")
def server(tiny_path):
    s = ServerThread(tiny_path, engine_kwargs=TINY_ENGINE)
    yield s
    s.stop()


@pytest.fixture(scope="package")
def offline(tiny_path):
    from kvforge import LLM
    return LLM(tiny_path, **TINY_ENGINE)


@pytest.fixture
def client(server):
    import openai
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c
