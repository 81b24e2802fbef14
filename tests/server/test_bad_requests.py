"""Requests that used to hang or crash the server get their 4xx (OpenAI error body) in under a
second, and leave the engine clean: prompt + max_tokens beyond the context, a chat message
without content, too many top_logprobs, lone surrogates; a non-streaming request whose client
hangs up is aborted in the engine as a stream is."""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from tests.server.conftest import recording_aborts
from tests.server.test_errors import assert_error

CONTEXT = 512          # the tiny model's context


def post_timed(http: httpx.Client, path: str, body: dict | bytes) -> httpx.Response:
    t0 = time.monotonic()
    if isinstance(body, bytes):
        resp = http.post(path, content=body, headers={"content-type": "application/json"})
    else:
        resp = http.post(path, json=body)
    elapsed = time.monotonic() - t0
    assert elapsed < 1.0, f"{path} took {elapsed:.2f} s to answer {resp.status_code}"
    return resp


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 10**9}, "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": [5] * 500, "max_tokens": 13}, "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": [[5, 6], [5] * 510], "max_tokens": 3},
     "max_tokens"),                                          # the longest prompt decides
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                              "max_tokens": 10**9}, "max_tokens"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                              "max_completion_tokens": CONTEXT}, "max_completion_tokens"),
])
def test_prompt_plus_max_tokens_beyond_context_is_400(http, server, path, body, param):
    err = assert_error(post_timed(http, path, body), 400, param)
    assert err["code"] == "context_length_exceeded"
    assert f"maximum context length is {CONTEXT} tokens" in err["message"]
    server.assert_clean()


def test_prompt_plus_max_tokens_exactly_the_context_is_accepted(http, server):
    resp = http.post("/v1/completions", json={"model": "tiny", "prompt": [5] * 500,
                                              "max_tokens": 12, "ignore_eos": True})
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == 12
    server.assert_clean()


def test_absent_max_tokens_is_capped_to_what_fits(http, server):
    # completions: the API default of 16, cut to the 4 tokens left in the context
    resp = http.post("/v1/completions", json={"model": "tiny", "prompt": [5] * 508,
                                              "ignore_eos": True})
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    assert resp.json()["usage"]["completion_tokens"] == 4 and choice["finish_reason"] == "length"
    # a short prompt gets the default 16
    resp = http.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "ignore_eos": True})
    assert resp.json()["usage"]["completion_tokens"] == 16
    # chat: no default, everything up to the context
    ids = http.post("/tokenize", json={"messages": [{"role": "user", "content": "x " * 450}]})
    room = CONTEXT - ids.json()["count"]
    assert 0 < room < 60
    resp = http.post("/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "x " * 450}], "ignore_eos": True})
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == room
    server.assert_clean()


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user"}]},
     "messages.0.content"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": None}]},
     "messages.1.content"),
    ("/tokenize", {"messages": [{"role": "user"}]}, "messages.0.content"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                              "logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                              "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"model": "tiny", "prompt": [-1], "echo": True}, "prompt"),
])
def test_malformed_requests_are_400_at_once(http, server, path, body, param):
    err = assert_error(post_timed(http, path, body), 400)
    assert err["param"].startswith(param)        # a union member may follow: content.str
    server.assert_clean()


@pytest.mark.parametrize("path, raw", [
    ("/v1/completions", rb'{"prompt": "\udcff"}'),
    ("/v1/completions", rb'{"model": "\ud800", "prompt": "hi"}'),
    ("/v1/completions", rb'{"prompt": "hi", "stop": ["ok", "\udfff"]}'),
    ("/v1/completions", rb'{"prompt": "hi", "\udcff": 1}'),
    ("/v1/chat/completions", rb'{"messages": [{"role": "user", "content": "a\udcffb"}]}'),
    ("/v1/chat/completions", rb'{"messages": [{"role": "user", "content": '
                             rb'[{"type": "text", "text": "\ud83d"}]}]}'),
    ("/tokenize", rb'{"prompt": "\udcff"}'),
    ("/detokenize", rb'{"tokens": [1], "model": "\udcff"}'),
], ids=["prompt", "model", "stop", "key", "content", "content-part", "tokenize", "detokenize"])
def test_lone_surrogates_are_400_not_500(http, server, path, raw):
    err = assert_error(post_timed(http, path, raw), 400)
    assert "lone surrogate" in err["message"]
    server.assert_clean()


def test_surrogate_pair_is_ordinary_text(http):
    # "\ud83d\ude00" is one character (U+1F600), not two lone surrogates
    resp = http.post("/tokenize", content=rb'{"prompt": "\ud83d\ude00"}',
                     headers={"content-type": "application/json"})
    assert resp.status_code == 200
    assert resp.json()["tokens"] == http.post("/tokenize", json={"prompt": "\U0001F600"}).json()["tokens"]


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"model": "tiny", "prompt": "Once upon a time"}),
    ("/v1/chat/completions", {"model": "tiny",
                              "messages": [{"role": "user", "content": "Once upon a time"}]}),
])
def test_non_streaming_request_is_aborted_when_its_client_leaves(server, path, body):
    body = {**body, "max_tokens": 450, "ignore_eos": True, "temperature": 0}
    async def leave_after_a_few_tokens():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
            task = asyncio.create_task(c.post(path, json=body))
            deadline = time.monotonic() + 60
            # until the engine has generated something for it (not merely queued it)
            while not await server.engine.call(
                    lambda e: any(s.request.num_output_tokens >= 3 for s in e._seq_states.values())):
                assert time.monotonic() < deadline and not task.done()
                await asyncio.sleep(0.01)
            task.cancel()                       # closes the connection without a response
            with pytest.raises(asyncio.CancelledError):
                await task

    with recording_aborts(server) as aborted_at:
        asyncio.run(leave_after_a_few_tokens())
        # it would run on for ~447 more tokens had it not been aborted
        server.wait_idle(timeout=20)
    assert len(aborted_at) == 1 and 3 <= aborted_at[0] < 450, aborted_at
    server.assert_clean()


def test_every_bad_request_is_fast_and_leaves_no_trace(http, server):
    """After a mix of all of the above, /metrics shows nothing running and no KV in use."""
    for body in ({"model": "tiny", "prompt": "hi", "max_tokens": 10**9},
                 {"model": "tiny", "prompt": "hi", "n": 99}):
        assert_error(post_timed(http, "/v1/completions", body), 400)
    assert_error(post_timed(http, "/v1/chat/completions", {"messages": [{"role": "user"}]}), 400)
    server.assert_clean()
    metrics = http.get("/metrics").text
    gauges = {line.split("{")[0]: float(line.split()[-1]) for line in metrics.splitlines()
              if line.startswith(("kvforge:num_requests_running", "kvforge:kv_cache_usage_perc"))}
    assert gauges == {"kvforge:num_requests_running": 0.0, "kvforge:kv_cache_usage_perc": 0.0}
    json.loads(http.get("/v1/models").text)          # still serving


@pytest.mark.parametrize("extra, message", [({"best_of": 3}, "best_of = 3"),
                                            ({"suffix": "tail"}, "suffix")])
def test_openai_fields_that_would_change_the_result_are_refused(client, server, extra, message):
    """best_of > n and suffix are OpenAI fields this server does not implement: a 400 naming
    them, not a completion that quietly is something else; best_of = n is accepted."""
    import openai
    with pytest.raises(openai.BadRequestError, match=message):
        client.completions.create(model="tiny", prompt="Hi", max_tokens=2, extra_body=extra)
    ok = client.completions.create(model="tiny", prompt="Hi", max_tokens=2, n=2, best_of=2)
    assert len(ok.choices) == 2
    server.assert_clean()
