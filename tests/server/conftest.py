"""A real kvforge server on a free loopback port: uvicorn in a thread, engine in-process (so tests
can reach the engine for check_integrity), plus an offline LLM on the same model as the oracle."""
from __future__ import annotations

import contextlib

import httpx
import pytest

from kvforge.server.background import BackgroundServer, free_port  # noqa: F401 - used by tests

TINY_ENGINE = dict(block_size=4, num_kv_blocks=256, max_num_batched_tokens=64, max_num_seqs=64,
                   num_threads=1)


class ServerThread(BackgroundServer):
    def __init__(self, model: str, *, engine_kwargs: dict, **server_kwargs) -> None:
        super().__init__({"model": model, **engine_kwargs},
                         **{"served_model_name": "tiny", **server_kwargs})

    def assert_clean(self) -> None:
        self.check_clean()


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


@contextlib.contextmanager
def recording_aborts(server):
    """Yields a list that receives, for every request the engine aborts while it still runs, its
    output length at that moment: a spy on ``LLMEngine.abort_request`` installed on the engine
    thread and removed afterwards (the server is shared between tests)."""
    aborted_at: list[int] = []

    def spy(e):
        def abort_request(rid: str, inner=e.abort_request) -> None:
            group = e._groups.get(rid)
            if group is not None:
                aborted_at.extend(s.request.num_output_tokens for s in group.seqs
                                  if not s.request.is_finished)
            inner(rid)
        e.abort_request = abort_request

    server.in_engine(spy)
    try:
        yield aborted_at
    finally:
        server.in_engine(lambda e: e.__dict__.pop("abort_request"))
