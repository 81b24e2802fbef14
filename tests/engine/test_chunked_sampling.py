"""A runner that samples its rows a chunk at a time (``sample_rows_per_call``, the offloaded
runner's bound on the sampler's working copies) samples what one call over every row does:
greedy and seeded random tokens, logprobs, penalties, each request's own parameters."""
from __future__ import annotations

import pytest

from kvforge import LLM, SamplingParams

PROMPTS = [[5, 17, 3, 99], [8, 8, 2], [120, 4, 61, 7, 7, 30], [11], [42, 43], [9, 300, 2, 5, 1]]


def _params() -> list[SamplingParams]:
    return [SamplingParams(temperature=0, max_tokens=9, ignore_eos=True, logprobs=2),
            SamplingParams(temperature=0.8, seed=11, max_tokens=9, ignore_eos=True),
            SamplingParams(temperature=0, repetition_penalty=1.4, max_tokens=9, ignore_eos=True),
            SamplingParams(temperature=1.1, top_k=20, seed=4, max_tokens=9, ignore_eos=True,
                           logprobs=1),
            SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
            SamplingParams(temperature=0.6, top_p=0.8, seed=2, frequency_penalty=0.5,
                           max_tokens=9, ignore_eos=True)]


def _run(path, rows_per_call):
    llm = LLM(path, block_size=4, num_kv_blocks=128, num_decode_steps=1)
    llm.engine.runner.sample_rows_per_call = rows_per_call
    calls = []
    sampler = llm.engine.runner.sampler
    llm.engine.runner.sampler = lambda logits, batch: (calls.append(logits.shape[0]),
                                                       sampler(logits, batch))[1]
    outs = llm.generate(PROMPTS, _params(), use_tqdm=False)
    llm.engine.check_integrity()
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs], calls


@pytest.mark.parametrize("rows_per_call", [1, 4])
def test_chunked_sampling_equals_one_call(tiny_model_factory, rows_per_call):
    path, _ = tiny_model_factory("llama", num_hidden_layers=2)
    whole, whole_calls = _run(path, None)
    chunked, calls = _run(path, rows_per_call)
    assert max(calls) <= rows_per_call and max(whole_calls) > rows_per_call
    assert len(calls) > len(whole_calls)
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(chunked, whole):
        assert tokens == ref_tokens
        if ref_logprobs is None:
            assert logprobs is None
        else:
            assert len(logprobs) == len(ref_logprobs)
            for got, ref in zip(logprobs, ref_logprobs):
                assert got.keys() == ref.keys()
                assert all(abs(got[t] - ref[t]) < 1e-5 for t in ref)
