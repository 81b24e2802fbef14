"""Aborts at any time return every block; streamed deltas add up to the final text."""
from __future__ import annotations

import pytest

from kvforge import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_model_factory):
    path, _ = tiny_model_factory("llama")
    return LLM(path, block_size=4, num_kv_blocks=64, max_num_batched_tokens=8)


@pytest.mark.parametrize("abort_after_steps", [0, 1, 3, 8])
def test_abort_at_any_step_frees_blocks(llm, abort_after_steps):
    engine = llm.engine
    keep = engine.add_request(None, [5, 6, 7, 8, 9], SamplingParams(temperature=0, max_tokens=6))
    victim = engine.add_request(None, list(range(10, 40)),
                                SamplingParams(n=2, temperature=0.8, seed=1, max_tokens=30))
    finished = {}
    for _ in range(abort_after_steps):
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    engine.abort_request(victim)
    engine.check_integrity()
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id != victim
            if out.finished:
                finished[out.request_id] = out
            engine.check_integrity()
    assert keep in finished and len(finished[keep].outputs[0].token_ids) == 6
    assert engine.num_free_blocks == 64


def test_stream_deltas_concatenate_to_text(llm):
    engine = llm.engine
    rid = engine.add_request(None, "Once upon a time", SamplingParams(temperature=0.7, seed=3,
                                                                      max_tokens=25))
    pieces, final = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            pieces.append(out.deltas[0])
            final = out
    assert final is not None and final.finished and final.request_id == rid
    assert "".join(pieces) == final.outputs[0].text
    assert final.outputs[0].text == llm.tokenizer.decode(final.outputs[0].token_ids)
