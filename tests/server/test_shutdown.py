"""SIGTERM: the server stops accepting, lets the in-flight stream finish, and exits 0."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from tests.server.conftest import free_port


@pytest.mark.slow
def test_sigterm_finishes_in_flight_stream_then_exits_cleanly(tiny_path):
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvforge.cli", "serve", tiny_path, "--port", str(port),
         "--block-size", "4", "--num-kv-blocks", "256", "--num-threads", "1",
         "--served-model-name", "tiny", "--shutdown-timeout", "60", "--log-level", "warning"],
        env={**os.environ, "HF_HUB_OFFLINE": "1"}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.2)
        body = {"model": "tiny", "prompt": "Once", "max_tokens": 60, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        usage = None
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as resp:
            for i, line in enumerate(resp.iter_lines()):
                if i == 2:
                    proc.send_signal(signal.SIGTERM)       # mid-stream
                if line.startswith("data: {"):
                    usage = json.loads(line[6:]).get("usage") or usage
        assert usage is not None and usage["completion_tokens"] == 60   # finished, not cut
        assert proc.wait(timeout=60) == 0
        with pytest.raises(httpx.TransportError):                    # no longer accepting
            httpx.get(url + "/health", timeout=2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# uvicorn's SystemExit in the server thread is the failure being tested
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_server_whose_port_is_taken_fails_to_start_instead_of_waiting():
    """uvicorn ends its thread when the bind fails (another process took the port after
    free_port): serve_in_thread raises at once, where a wait for ``started`` hung forever."""
    import socket

    import uvicorn
    from fastapi import FastAPI

    from kvforge.server.background import free_port, serve_in_thread
    with socket.socket() as taken:
        port = free_port()
        taken.bind(("127.0.0.1", port))
        taken.listen()
        server = uvicorn.Server(uvicorn.Config(FastAPI(), host="127.0.0.1", port=port,
                                               log_level="critical"))
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=f"did not start on 127.0.0.1:{port}"):
            serve_in_thread(server, start_timeout=60.0)
        assert time.monotonic() - start < 30.0
