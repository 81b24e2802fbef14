"""Client mistakes get 4xx with the OpenAI error body and leave the engine clean: 400/401/404/429."""
from __future__ import annotations

import httpx
import pytest

from tests.server.conftest import TINY_ENGINE, ServerThread


def assert_error(resp: httpx.Response, status: int, param: str | None = "any") -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param != "any":
        assert err["param"] == param
    return err


@pytest.mark.parametrize("body, param", [
    ({"model": "tiny", "prompt": "hi", "temperature": "hot"}, "temperature"),
    ({"model": "tiny", "prompt": "hi", "temperature": 3.5}, "temperature"),
    ({"model": "tiny", "prompt": "hi", "top_p": 0}, "top_p"),
    ({"model": "tiny", "prompt": "hi", "max_tokens": -1}, "max_tokens"),   # 0 scores the prompt
    ({"model": "tiny", "prompt": "hi", "logprobs": 99}, "logprobs"),
    ({"model": "tiny", "prompt": "hi", "stop": [""]}, "stop"),
    ({"model": "tiny"}, "prompt"),
    ({"model": "tiny", "prompt": [1, 2, 10**9]}, "prompt"),
    ({"model": "tiny", "prompt": "hi", "n": 17}, "n"),
    ({"model": "tiny", "prompt": "word " * 600}, "prompt"),     # longer than the 512 context
])
def test_bad_completion_requests_are_400(http, server, body, param):
    assert_error(http.post("/v1/completions", json=body), 400, param)
    server.assert_clean()


def test_bad_chat_requests_are_400(http, server):
    assert_error(http.post("/v1/chat/completions", json={"model": "tiny", "messages": []}), 400,
                 "messages")
    assert_error(http.post("/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "wizard", "content": "x"}]}), 400)
    assert_error(http.post("/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}), 400)
    server.assert_clean()


def test_invalid_json_and_unknown_model(http):
    resp = http.post("/v1/completions", content=b'{"prompt": "hi",', headers={
        "content-type": "application/json"})
    assert "JSON" in assert_error(resp, 400)["message"]
    err = assert_error(http.post("/v1/completions", json={"model": "gpt-9", "prompt": "hi"}), 404,
                       "model")
    assert err["code"] == "model_not_found"
    assert_error(http.get("/v1/nothing-here"), 404)


def test_openai_client_sees_typed_errors(client):
    import openai
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-9", prompt="hi")
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="hi", max_tokens=-1)
    assert e.value.body["param"] == "max_tokens"


def test_api_key_required(tiny_path):
    s = ServerThread(tiny_path, engine_kwargs=TINY_ENGINE, api_key="sekrit")
    try:
        with httpx.Client(base_url=s.url, timeout=30) as c:
            body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
            assert_error(c.post("/v1/completions", json=body), 401)
            assert_error(c.get("/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
            ok = c.post("/v1/completions", json=body, headers={"Authorization": "Bearer sekrit"})
            assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1
            assert c.get("/health").status_code == 200      # probes need no key
    finally:
        s.stop()


def test_full_waiting_queue_answers_429(tiny_path):
    # one sequence runs at a time; one more may wait; the third is refused, not queued
    s = ServerThread(tiny_path, engine_kwargs={**TINY_ENGINE, "max_num_seqs": 1},
                     max_waiting_requests=1)
    long = {"model": "tiny", "prompt": "a b c", "max_tokens": 400, "ignore_eos": True,
            "stream": True, "temperature": 0}
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            with c.stream("POST", "/v1/completions", json=long) as first:
                lines = first.iter_lines()
                next(line for line in lines if line.startswith("data:"))   # running now
                with c.stream("POST", "/v1/completions", json=long) as second:
                    assert second.status_code == 200                        # admitted, waiting
                    err = assert_error(c.post("/v1/completions", json={**long, "stream": False}), 429)
                    assert err["code"] == "queue_full"
        # both streams were dropped by the client: their requests were aborted
        s.assert_clean()
        assert "kvforge:request_rejected_total" in httpx.get(s.url + "/metrics").text
    finally:
        s.stop()
