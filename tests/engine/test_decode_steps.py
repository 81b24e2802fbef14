"""Multi-step decoding (engine/decode_steps.py) gives one-step greedy outputs token for token --
tied and untied embeddings, any thread count, stop strings / EOS / max_tokens landing mid-call,
a KV pool that forces preemption -- in fewer engine steps; batches it cannot take fall back to
one token a step."""
from __future__ import annotations

import random

import pytest

from kvforge import LLM, SamplingParams

BLOCK = 4
MAX_TOKENS = (20, 7, 13, 1, 30, 9)         # not multiples of the step counts


def _prompts() -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(3, 49152) for _ in range(n)] for n in (5, 33, 18, 2, 47, 9)]


def _generate(llm: LLM, prompts, params):
    """(outputs, engine steps taken); integrity checked and every block free at the end."""
    engine = llm.engine
    steps = 0
    step = engine.step

    def counting_step():
        nonlocal steps
        steps += 1
        return step()

    engine.step = counting_step
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        del engine.step
    engine.check_integrity()
    assert engine.num_free_blocks == engine.runner.num_blocks, "leaked KV blocks"
    return outs, steps


def _greedy(max_tokens=MAX_TOKENS):
    return [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def tiny(request, tiny_model_factory):
    path, _ = tiny_model_factory("llama", num_hidden_layers=3,
                                 tie_word_embeddings=request.param)
    outs, steps = _generate(LLM(path, block_size=BLOCK, num_kv_blocks=256, num_decode_steps=1),
                            _prompts(), _greedy())
    return path, [o.outputs[0].token_ids for o in outs], steps


@pytest.mark.parametrize("num_decode_steps,threads", [(2, 2), (8, 1), (8, 2), (8, 3)])
def test_multi_step_equals_one_step(tiny, num_decode_steps, threads):
    path, baseline, one_step_steps = tiny
    llm = LLM(path, block_size=BLOCK, num_kv_blocks=256, num_decode_steps=num_decode_steps,
              num_threads=threads)
    outs, steps = _generate(llm, _prompts(), _greedy())
    assert [o.outputs[0].token_ids for o in outs] == baseline
    assert [len(t) for t in baseline] == list(MAX_TOKENS)
    # the batch shrinks as requests finish; the last one (30 tokens) runs alone at the end
    assert steps < one_step_steps - 10, (steps, one_step_steps)


def test_small_kv_pool_preempts_and_still_matches(tiny):
    path, baseline, _ = tiny
    # 20 blocks of 4 cannot hold two of the long requests: lookahead slots are given up first,
    # then requests are preempted and recomputed
    llm = LLM(path, block_size=BLOCK, num_kv_blocks=20, num_decode_steps=8)
    outs, _ = _generate(llm, _prompts(), _greedy())
    assert [o.outputs[0].token_ids for o in outs] == baseline
    assert sum(o.metrics.num_preemptions for o in outs) > 0, "pool was meant to force preemption"


def test_batches_it_cannot_take_run_one_token_a_step(tiny):
    path, baseline, _ = tiny
    prompts = _prompts()[:3]
    # one sampled (seeded) request or one asking for logprobs keeps the whole batch on one
    # token a step: same outputs, same number of steps as with multi-step off
    for odd in (SamplingParams(temperature=0.8, seed=3, max_tokens=13, ignore_eos=True),
                SamplingParams(temperature=0.0, logprobs=2, max_tokens=13, ignore_eos=True)):
        params = [*_greedy(MAX_TOKENS[:2]), odd]
        runs = [_generate(LLM(path, block_size=BLOCK, num_kv_blocks=256, num_decode_steps=k),
                          prompts, params) for k in (1, 8)]
        (one, one_steps), (multi, multi_steps) = runs
        assert [o.outputs[0].token_ids for o in multi] == [o.outputs[0].token_ids for o in one]
        assert [o.outputs[0].token_ids for o in multi[:2]] == baseline[:2]
        # once the odd request (13 tokens) is done the others (20, 7) may go multi-step
        assert multi_steps <= one_steps
        if odd.logprobs:
            assert multi[2].outputs[0].logprobs == one[2].outputs[0].logprobs


def test_interrupted_calls_return_the_steps_they_ran_and_match_one_step(tiny):
    """``LLMEngine.interrupt_decode_steps`` ends a multi-step call after its step in flight:
    a call started with the flag set returns one token a row (slots given back, nothing
    leaked), and a flag set by another thread mid-call cuts it wherever it lands; the tokens
    are the one-step ones either way."""
    import threading
    path, baseline, _ = tiny
    llm = LLM(path, block_size=BLOCK, num_kv_blocks=256, num_decode_steps=8)
    engine, model = llm.engine, llm.engine.runner.model
    real_decode_steps = model.decode_steps
    calls = []                                   # (steps planned, steps returned)

    def recorded(ids, positions, num_steps, kv_caches, block_tables, stop=None):
        out = real_decode_steps(ids, positions, num_steps, kv_caches, block_tables, stop)
        calls.append((num_steps, out.shape[1]))
        return out

    model.decode_steps = recorded
    step, count = engine.step, 0

    def step_interrupting_every_other():
        nonlocal count
        count += 1
        engine.clear_decode_interrupt()
        if count % 2:
            engine.interrupt_decode_steps()
        return step()

    engine.step = step_interrupting_every_other
    outs, _ = _generate(llm, _prompts(), _greedy())
    assert [o.outputs[0].token_ids for o in outs] == baseline
    assert any(planned > 1 and ran == 1 for planned, ran in calls), calls
    assert any(planned > 1 and ran == planned for planned, ran in calls), calls

    # another thread sets the flag while the calls run (wherever it lands)
    calls.clear()

    def step_then_interrupt_soon():
        engine.clear_decode_interrupt()
        stop_setter = threading.Timer(0.002, engine.interrupt_decode_steps)
        stop_setter.start()
        try:
            return step()
        finally:
            stop_setter.join()

    engine.step = step_then_interrupt_soon
    outs, _ = _generate(llm, _prompts(), _greedy())
    assert [o.outputs[0].token_ids for o in outs] == baseline
    assert all(1 <= ran <= planned for planned, ran in calls) and calls


def test_smollm2_stops_mid_call_like_one_step(default_model_path):
    """Stop strings, EOS and max_tokens that land inside a multi-step call cut the output where
    one step at a time stops: same text, tokens and finish reasons."""
    prompts = ["The capital of France is", "List three colors:", "def fibonacci(n):",
               "Once upon a time"]
    params = [SamplingParams(temperature=0.0, max_tokens=40, stop=["."]),
              SamplingParams(temperature=0.0, max_tokens=37, stop=["\n\n", "4."]),
              SamplingParams(temperature=0.0, max_tokens=29),
              SamplingParams(temperature=0.0, max_tokens=50, stop_token_ids=[13])]
    runs = {}
    for k in (1, 8):
        llm = LLM(default_model_path, kv_cache_memory="64MiB", max_model_len=512,
                  num_decode_steps=k)
        outs, steps = _generate(llm, prompts, params)
        runs[k] = ([(o.outputs[0].text, o.outputs[0].token_ids, o.outputs[0].finish_reason,
                     o.outputs[0].stop_reason) for o in outs], steps)
        del llm
    assert runs[8][0] == runs[1][0]
    assert {r[2] for r in runs[1][0]} == {"stop", "length"}     # both kinds of stop happen
    assert runs[8][1] < runs[1][1]
