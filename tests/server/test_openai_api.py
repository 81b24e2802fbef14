"""The OpenAI client (sync and async, streaming and not) against a real server: greedy results
equal offline LLM.generate / LLM.chat on the same inputs; streams add up; usage and logprobs."""
from __future__ import annotations

import asyncio

import pytest

from kvforge import SamplingParams
from kvforge.server import responses

PROMPT = "The capital of France is"
MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": "Blue."},
            {"role": "user", "content": "Another one?"}]


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kw)


def test_completion_greedy_equals_offline(client, offline):
    want = offline.generate([PROMPT], greedy(12), use_tqdm=False)[0].outputs[0]
    got = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0)
    assert got.choices[0].text == want.text
    assert got.choices[0].finish_reason == want.finish_reason
    assert got.usage.prompt_tokens == len(offline.tokenizer.encode(PROMPT))
    assert got.usage.completion_tokens == len(want.token_ids)
    assert got.usage.total_tokens == got.usage.prompt_tokens + got.usage.completion_tokens


def test_logit_bias_as_the_offline_engine_applies_it(client, offline, server):
    """OpenAI's logit_bias (string keys of token ids): the completion is the offline engine's
    under the same bias; a key outside the vocabulary or a value outside [-100, 100] is a 400
    naming logit_bias, and the engine is left clean."""
    import openai
    bias = {777: 100.0, 778: -100.0}
    want = offline.generate([PROMPT], greedy(6, logit_bias=bias), use_tqdm=False)[0].outputs[0]
    assert want.token_ids == [777] * 6
    got = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0,
                                    logit_bias={str(k): v for k, v in bias.items()})
    assert got.choices[0].text == want.text
    for bad in ({"99999999": 1}, {"5": 101}, {"five": 1}):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, logit_bias=bad)
        assert e.value.body["param"].startswith("logit_bias"), e.value.body
    server.assert_clean()


def test_prediction_is_accepted_and_changes_nothing(client, server, offline):
    """Predicted Outputs through the OpenAI client (text and text parts): the same completion
    and chat reply as without (this server does not speculate: the hint is unused)."""
    plain = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0)
    text = plain.choices[0].text
    got = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0,
                                    extra_body={"prediction": {"type": "content",
                                                               "content": text}})
    assert got.choices[0].text == text
    chat = dict(model="tiny", messages=MESSAGES, max_tokens=8, temperature=0)
    reply = client.chat.completions.create(**chat).choices[0].message.content
    parts = [{"type": "text", "text": reply[:3]}, {"type": "text", "text": reply[3:]}]
    again = client.chat.completions.create(prediction={"type": "content", "content": parts},
                                           **chat)
    assert again.choices[0].message.content == reply
    # usage says how much of the prediction the reply reproduced: all of it here, none without
    pred_tokens = len(offline.tokenizer.encode(reply, add_special_tokens=False))
    details = again.usage.completion_tokens_details
    assert (details.accepted_prediction_tokens, details.rejected_prediction_tokens) == (
        pred_tokens, 0)
    details = client.chat.completions.create(**chat).usage.completion_tokens_details
    assert (details.accepted_prediction_tokens, details.rejected_prediction_tokens) == (0, 0)
    # a prediction with a word the reply lacks: those tokens are rejected, the rest accepted
    wrong = " zebra" + text
    got = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0,
                                    extra_body={"prediction": {"type": "content",
                                                               "content": wrong}})
    details = got.usage.completion_tokens_details
    wrong_tokens = len(offline.tokenizer.encode(wrong, add_special_tokens=False))
    assert details.rejected_prediction_tokens >= 1
    assert details.accepted_prediction_tokens + details.rejected_prediction_tokens == wrong_tokens
    server.assert_clean()


def test_prediction_usage_counts_tokens_in_order():
    """Accepted: the prediction's tokens the completion has in the same order; per choice."""
    got = responses.usage(3, [[1, 2, 9, 4, 5, 6], [5, 4]], [1, 2, 3, 4, 5])
    assert got["completion_tokens"] == 8 and got["total_tokens"] == 11
    # choice 0 keeps 1 2 4 5 (3 missing); choice 1 keeps one of 5, 4 (the order is reversed)
    assert got["completion_tokens_details"] == {"accepted_prediction_tokens": 5,
                                                "rejected_prediction_tokens": 5}


def test_completion_prompt_forms_and_n(client, offline):
    ids = offline.tokenizer.encode("Hello there")
    want = [o.outputs[0].text for o in
            offline.generate(["One two", "Three", ids], greedy(6, ignore_eos=True), use_tqdm=False)]
    got = client.completions.create(model="tiny", prompt=["One two", "Three"], max_tokens=6,
                                    temperature=0, n=2, extra_body={"ignore_eos": True})
    # choice index = prompt_index * n + sample_index; greedy samples of one prompt agree
    assert [c.index for c in got.choices] == [0, 1, 2, 3]
    assert [c.text for c in got.choices] == [want[0], want[0], want[1], want[1]]
    assert got.usage.completion_tokens == 4 * 6
    got = client.completions.create(model="tiny", prompt=ids, max_tokens=6, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert got.choices[0].text == want[2] and got.usage.prompt_tokens == len(ids)
    assert got.choices[0].finish_reason == "length"


def test_chat_greedy_equals_offline(client, offline):
    want = offline.chat(MESSAGES, greedy(10), use_tqdm=False)[0]
    got = client.chat.completions.create(model="tiny", messages=MESSAGES, max_completion_tokens=10,
                                         temperature=0)
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == want.outputs[0].text
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)
    assert got.usage.completion_tokens == len(want.outputs[0].token_ids)


def test_streamed_chunks_concatenate_to_full_text(client):
    kw = dict(model="tiny", max_tokens=20, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(prompt=PROMPT, **kw)
    chunks = list(client.completions.create(prompt=PROMPT, stream=True,
                                            stream_options={"include_usage": True}, **kw))
    assert chunks[-1].usage is not None and chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 20 == full.usage.completion_tokens
    assert "".join(c.choices[0].text for c in chunks[:-1]) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks[:-1]][-1] == "length"
    assert len(chunks) > 3          # really streamed, not one blob

    full = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=15,
                                          temperature=0)
    stream = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=15,
                                            temperature=0, stream=True)
    parts = [c.choices[0].delta for c in stream]
    assert parts[0].role == "assistant"
    assert "".join(p.content or "" for p in parts) == full.choices[0].message.content


def test_stop_string_honoured(client):
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=30, temperature=0,
              extra_body={"ignore_eos": True})
    text = client.completions.create(**kw).choices[0].text
    assert len(text) > 6
    stop = text[3:6]                 # a string the greedy output is known to contain
    cut = text[:text.index(stop)]
    got = client.completions.create(stop=[stop], **kw).choices[0]
    assert got.text == cut and got.finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(stop=stop, stream=True, **kw))
    assert streamed == cut


def test_completion_logprobs_shape(client, offline):
    got = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0,
                                    logprobs=3, extra_body={"ignore_eos": True})
    lp = got.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == got.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    for tok, tlp, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert tlp <= 0.0 and len(top) == 3
        assert max(top.values()) == pytest.approx(tlp)   # greedy picks the most likely token


def test_chat_logprobs_shape(client):
    got = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4,
                                         temperature=0, logprobs=True, top_logprobs=2,
                                         extra_body={"ignore_eos": True})
    content = got.choices[0].logprobs.content
    assert len(content) == 4
    assert "".join(c.token for c in content) == got.choices[0].message.content
    for c in content:
        assert len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob == pytest.approx(c.logprob)
        assert c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob
        assert bytes(c.bytes).decode("utf-8") == c.token


def test_echo_and_seeded_sampling(client):
    got = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0,
                                    echo=True)
    assert got.choices[0].text.startswith(PROMPT)
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=8, temperature=1.0, top_p=0.9,
              seed=7, presence_penalty=0.5, frequency_penalty=0.5,
              extra_body={"top_k": 50, "min_p": 0.01, "repetition_penalty": 1.1})
    assert client.completions.create(**kw).choices[0].text == client.completions.create(**kw).choices[0].text


def test_echo_with_logprobs_scores_the_prompt_too(client, server, offline):
    """echo + logprobs: the prompt's tokens first, the first with a null logprob, the rest the
    offline engine's prompt_logprobs; then the completion's. Streamed, the same tokens and
    values. max_tokens 0 (lm-evaluation-harness's loglikelihood requests): the prompt alone,
    no completion tokens billed."""
    ids = offline.tokenizer.encode(PROMPT)
    want = offline.generate([PROMPT], greedy(3, logprobs=1, prompt_logprobs=1),
                            use_tqdm=False)[0]
    got = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0,
                                    echo=True, logprobs=1)
    lp = got.choices[0].logprobs
    n = len(ids)
    assert got.choices[0].text == PROMPT + want.outputs[0].text
    assert len(lp.tokens) == n + 3
    assert "".join(lp.tokens[:n]) == PROMPT
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for pos in range(1, n):
        assert lp.token_logprobs[pos] == pytest.approx(want.prompt_logprobs[pos][ids[pos]],
                                                       abs=1e-5)
    assert lp.token_logprobs[n:] == pytest.approx(
        [e[t] for t, e in zip(want.outputs[0].token_ids, want.outputs[0].logprobs)], abs=1e-5)
    assert lp.text_offset[0] == 0 and lp.text_offset[n] == len(PROMPT)

    stream = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0,
                                       echo=True, logprobs=1, stream=True)
    tokens, values = [], []
    for ch in stream:
        if ch.choices and ch.choices[0].logprobs is not None:
            tokens += ch.choices[0].logprobs.tokens
            values += ch.choices[0].logprobs.token_logprobs
    assert tokens == lp.tokens
    assert values[0] is None and values[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-6)

    scored = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=0, echo=True,
                                       logprobs=1)
    assert scored.choices[0].text == PROMPT
    assert scored.choices[0].finish_reason == "length"
    assert scored.choices[0].logprobs.tokens == lp.tokens[:n]
    assert scored.choices[0].logprobs.token_logprobs[1:] == pytest.approx(
        lp.token_logprobs[1:n], abs=1e-6)
    assert scored.usage.completion_tokens == 0 and scored.usage.prompt_tokens == n
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=0,
                                            echo=True, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == PROMPT
    assert chunks[-1].choices[0].finish_reason == "length"
    server.assert_clean()


def test_async_client_streaming(server, offline):
    import openai
    want = offline.generate([PROMPT], greedy(8), use_tqdm=False)[0].outputs[0].text

    async def main():
        c = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        stream = await c.completions.create(model="tiny", prompt=PROMPT, max_tokens=8,
                                            temperature=0, stream=True)
        text = "".join([ch.choices[0].text async for ch in stream])
        full = await c.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0)
        await c.close()
        return text, full.choices[0].text
    assert asyncio.run(main()) == (want, want)


def test_models_health_tokenize_metrics(client, http, offline, server):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert http.get("/health").status_code == 200
    ids = http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    assert ids == offline.tokenizer.encode(PROMPT)
    assert http.post("/detokenize", json={"tokens": ids}).json()["prompt"] == offline.tokenizer.decode(ids)
    chat_ids = http.post("/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    assert chat_ids == offline.tokenizer.apply_chat_template(MESSAGES)
    client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0,
                              extra_body={"ignore_eos": True})
    text = http.get("/metrics").text
    for name in ("kvforge:request_success_total", "kvforge:prompt_tokens_total",
                 "kvforge:generation_tokens_total", "kvforge:time_to_first_token_seconds_bucket",
                 "kvforge:time_per_output_token_seconds_count", "kvforge:e2e_request_latency_seconds_sum",
                 "kvforge:request_queue_time_seconds_count", "kvforge:num_requests_running",
                 "kvforge:num_requests_waiting", "kvforge:kv_cache_usage_perc",
                 "kvforge:num_preemptions_total"):
        assert name in text, name
    line = next(l for l in text.splitlines()
                if l.startswith("kvforge:request_success_total") and 'finished_reason="length"' in l)
    assert float(line.split()[-1]) >= 1
    server.assert_clean()
