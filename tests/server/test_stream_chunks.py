"""Streamed completions send a chunk for every step that produced tokens, also when the
tokens' text is held back (a special token, a character's first bytes): the client sees the
first token when the engine samples it (what TTFT measures), as vLLM's server does."""
import asyncio
from types import SimpleNamespace

from kvforge.sampling_params import SamplingParams
from kvforge.server.openai_api import _Job


class _FakeServing:
    """What a _Job reads of the server: the model name and the engine outputs' merge."""

    def __init__(self, outputs):
        self.config = SimpleNamespace(served_model_name="tiny")
        self.outputs = outputs

    async def merge(self, streams, params, prompt_lens):
        for out in self.outputs:
            yield 0, out


def _output(token_ids, delta, finished=False):
    choice = SimpleNamespace(index=0, token_ids=token_ids, logprobs=None, finished=finished,
                             finish_reason="length" if finished else None)
    return SimpleNamespace(outputs=[choice], deltas=[delta], finished=finished)


def _stream(outputs):
    job = _Job(_FakeServing(outputs), "cmpl", SimpleNamespace(echo=False, include_usage=True),
               SamplingParams(max_tokens=3), [[1, 2, 3]], [""])

    async def collect():
        return [chunk async for chunk in job.stream_completion([None])]
    return asyncio.run(collect())


def test_a_token_with_held_back_text_still_streams_a_chunk():
    chunks = _stream([_output([2], ""),              # e.g. <|im_end|> under ignore_eos
                      _output([2, 15], ""),          # an emoji's first bytes
                      _output([2, 15, 16], "ab", finished=True)])
    texts = [c["choices"][0]["text"] for c in chunks if c["choices"]]
    assert texts == ["", "", "ab"]
    assert chunks[-1]["usage"]["completion_tokens"] == 3


def test_an_output_without_new_tokens_sends_nothing():
    chunks = _stream([_output([7], "x"), _output([7], ""), _output([7, 8], "y", finished=True)])
    assert [c["choices"][0]["text"] for c in chunks if c["choices"]] == ["x", "y"]


def test_chat_streams_an_empty_delta_for_a_held_back_token():
    job = _Job(_FakeServing([_output([2], ""), _output([2, 15], "ab", finished=True)]), "chat",
               SimpleNamespace(include_usage=False), SamplingParams(max_tokens=2), [[1, 2]], [""])

    async def collect():
        return [chunk async for chunk in job.stream_chat([None])]
    deltas = [c["choices"][0]["delta"] for c in asyncio.run(collect())]
    assert deltas == [{"role": "assistant", "content": ""}, {}, {"content": "ab"}]
