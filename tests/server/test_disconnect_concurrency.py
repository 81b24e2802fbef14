"""Streams that the client drops mid-generation are aborted and free their KV at once; the other
streams finish correctly; many concurrent streams get correct, independent outputs."""
from __future__ import annotations

import asyncio
import json

import httpx

from kvforge import SamplingParams
from tests.server.conftest import recording_aborts


async def read_stream(client: httpx.AsyncClient, body: dict, stop_after: int | None = None):
    """Concatenated text of a completion stream, or None if we hung up after stop_after chunks."""
    text, n = "", 0
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            text += json.loads(line[6:])["choices"][0]["text"]
            n += 1
            if stop_after is not None and n >= stop_after:
                return None          # leaving the block closes the connection mid-stream
    return text


def prompts(k: int) -> list[str]:
    return [f"Story number {i} begins with" for i in range(k)]


def test_dropped_streams_are_aborted_and_free_their_blocks(server, offline):
    ps = prompts(8)
    want = [o.outputs[0].text for o in offline.generate(
        ps, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)]

    def aborted_count() -> float:
        text = httpx.get(server.url + "/metrics").text
        return sum(float(l.split()[-1]) for l in text.splitlines()
                   if l.startswith("kvforge:request_success_total") and '"abort"' in l)

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
            # the dropped half asks for 450 tokens: had they not been aborted they would still
            # be running long after the kept half's 40 tokens
            body = lambda p, n: {"model": "tiny", "prompt": p, "max_tokens": n, "temperature": 0,
                                 "ignore_eos": True}
            return await asyncio.gather(*[
                read_stream(c, body(p, 450), stop_after=3) if i % 2 else read_stream(c, body(p, 40))
                for i, p in enumerate(ps)])
    # what the engine itself saw: the output length of every request it aborted while that request
    # still ran
    before = aborted_count()
    with recording_aborts(server) as aborted_at:
        got = asyncio.run(main())
        # the server learns of a hang-up when its next write fails, a step or a few after the
        # client closed (more on a loaded machine, where the engine thread runs on meanwhile)
        server.wait_idle()
    for i in range(8):
        assert got[i] == (None if i % 2 else want[i])
    # exactly the four dropped requests were cut short, each after the 3 chunks we read and
    # before its 450 tokens; the kept ones ran to their end
    assert len(aborted_at) == 4, aborted_at
    assert all(3 <= n < 450 for n in aborted_at), aborted_at
    assert aborted_count() - before == 4
    server.assert_clean()          # aborted requests gave back every block


def test_32_concurrent_streams_are_correct_and_independent(server, offline):
    ps = prompts(32)
    lens = [5 + i % 7 for i in range(32)]
    want = [o.outputs[0].text for o in offline.generate(
        ps, [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lens],
        use_tqdm=False)]
    assert len(set(want)) > 16      # different prompts really give different texts

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
            return await asyncio.gather(*[
                read_stream(c, {"model": "tiny", "prompt": p, "max_tokens": n, "temperature": 0,
                                "ignore_eos": True}) for p, n in zip(ps, lens)])
    assert asyncio.run(main()) == want
    server.assert_clean()
