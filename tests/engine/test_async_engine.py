"""AsyncLLMEngine: requests join and leave a running loop; bad input and shutdown are clean."""
from __future__ import annotations

import asyncio

import pytest

from kvforge import SamplingParams
from kvforge.config import EngineConfig
from kvforge.engine.async_engine import AsyncLLMEngine, EngineDeadError
from kvforge.engine.llm_engine import LLMEngine


@pytest.fixture
def aengine(tiny_model_factory):
    path, _ = tiny_model_factory("llama")
    e = AsyncLLMEngine(LLMEngine(EngineConfig(model=path, block_size=4, num_kv_blocks=128,
                                              max_num_batched_tokens=32, num_threads=1)))
    yield e
    e.shutdown()


def test_short_request_added_later_finishes_first(aengine):
    async def main():
        order = []

        async def run(name, prompt, n):
            stream = await aengine.add_request(name, prompt, SamplingParams(
                temperature=0, max_tokens=n, ignore_eos=True))
            async for out in stream:
                if out.finished:
                    order.append(name)
                    return len(out.outputs[0].token_ids)
        long = asyncio.create_task(run("long", [5, 6, 7], 200))
        while aengine.stats.num_running == 0:            # the long one is generating
            await asyncio.sleep(0.01)
        short = await run("short", [8, 9], 3)
        assert await long == 200 and short == 3
        return order
    assert asyncio.run(main()) == ["short", "long"]
    assert asyncio.run(aengine.call(lambda e: e.num_free_blocks)) == 128


def test_an_arrival_ends_a_multi_step_call_after_its_step_in_flight(tiny_model_factory):
    """A request added while a k-step decode call runs interrupts it: the call returns after
    the step in flight (not k steps later), and the newcomer is scheduled next; the tokens
    are the one-step ones."""
    import threading

    from kvforge import LLM
    path, _ = tiny_model_factory("llama", num_hidden_layers=2)
    long_params = SamplingParams(temperature=0, max_tokens=150, ignore_eos=True)
    short_params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    reference = LLM(path, block_size=4, num_kv_blocks=128, num_decode_steps=1, num_threads=1)
    expected = [o.outputs[0].token_ids
                for o in reference.generate([[5, 6, 7], [8, 9]], [long_params, short_params],
                                            use_tqdm=False)]
    engine = LLMEngine(EngineConfig(model=path, block_size=4, num_kv_blocks=128,
                                    num_decode_steps=64, num_threads=1))
    model = engine.runner.model
    real_decode_steps = model.decode_steps
    calls = []                                   # (steps planned, steps returned)
    in_call, release = threading.Event(), threading.Event()

    def gated(ids, positions, num_steps, kv_caches, block_tables, stop=None):
        if num_steps == 64 and not in_call.is_set():    # the first long call waits for the add
            in_call.set()
            release.wait(60)
        out = real_decode_steps(ids, positions, num_steps, kv_caches, block_tables, stop)
        calls.append((num_steps, out.shape[1]))
        return out

    model.decode_steps = gated
    aengine = AsyncLLMEngine(engine)

    async def collect(stream):
        async for out in stream:
            if out.finished:
                return out.outputs[0].token_ids

    async def main():
        long = asyncio.create_task(collect(await aengine.add_request("long", [5, 6, 7],
                                                                     long_params)))
        await asyncio.to_thread(in_call.wait, 60)
        add = asyncio.create_task(aengine.add_request("short", [8, 9], short_params))
        while not engine.runner.decode_interrupt.item():    # the add interrupts the call
            await asyncio.sleep(0.001)
        release.set()
        short = await collect(await add)
        return [await long, short]

    try:
        assert asyncio.run(main()) == expected
    finally:
        aengine.shutdown()
    assert calls[0] == (64, 1), calls
    engine.check_integrity()
    assert engine.num_free_blocks == 128


def test_bad_request_raises_and_leaves_nothing(aengine):
    async def main():
        with pytest.raises(ValueError, match="outside the vocabulary"):
            await aengine.add_request("bad", [1, 10**9], SamplingParams(max_tokens=2))
        return await aengine.call(lambda e: (e.num_unfinished_requests, e.num_free_blocks))
    assert asyncio.run(main()) == (0, 128)


def test_closing_a_stream_aborts_and_shutdown_ends_streams(aengine):
    async def main():
        stream = await aengine.add_request("a", [3, 4], SamplingParams(max_tokens=300, ignore_eos=True))
        await stream.__anext__()
        await stream.aclose()                            # the reader goes away
        for _ in range(200):
            if await aengine.call(lambda e: e.num_unfinished_requests) == 0:
                break
            await asyncio.sleep(0.01)
        assert await aengine.call(lambda e: e.num_free_blocks) == 128
        other = await aengine.add_request("b", [3, 4], SamplingParams(max_tokens=300, ignore_eos=True))
        await other.__anext__()
        aengine.shutdown()
        with pytest.raises(EngineDeadError):
            async for _ in other:
                pass
        with pytest.raises(EngineDeadError):
            await aengine.add_request("c", [3], SamplingParams())
    asyncio.run(main())


def test_stats_show_an_abort_at_once_even_with_no_step_after_it(tiny_model_factory):
    path, _ = tiny_model_factory("llama")
    seen = []
    e = AsyncLLMEngine(LLMEngine(EngineConfig(model=path, block_size=4, num_kv_blocks=128,
                                              max_num_batched_tokens=32, num_threads=1)),
                       step_callback=lambda s: seen.append((s.num_running, s.kv_cache_usage)))

    async def main():
        prompt = list(range(100, 140))                   # 10 full blocks for the prefix cache
        stream = await e.add_request("a", prompt, SamplingParams(max_tokens=300, ignore_eos=True))
        for _ in range(3):
            await stream.__anext__()
        assert e.stats.num_running == 1 and e.stats.kv_cache_usage > 0
        await stream.aclose()                            # the only request goes: no more steps
        for _ in range(200):
            if e.stats.num_running == 0:
                break
            await asyncio.sleep(0.01)
        return e.stats
    try:
        stats = asyncio.run(main())
        # what the last snapshot (and so /metrics) shows: idle, nothing in use, cache warm
        assert (stats.num_running, stats.kv_cache_usage) == (0, 0.0) == seen[-1]
        assert stats.prefix_cache_blocks >= 10 and stats.prefix_cache_evictable_blocks >= 10
        assert stats.num_free_blocks == 128
        assert asyncio.run(e.call(lambda eng: eng.kv_cache_usage)) == 0.0
    finally:
        e.shutdown()
