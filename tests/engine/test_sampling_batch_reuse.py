"""ModelRunner reuses the last step's SamplingBatch only when nothing in it can have changed."""
from __future__ import annotations

from types import SimpleNamespace

from kvforge.engine.model_runner import ModelRunner
from kvforge.engine.request import Request
from kvforge.sampling_params import SamplingParams

VOCAB = 50


def _runner():
    return SimpleNamespace(_last_sampling={}, device="cpu")


def _batch(runner, requests, vocab=VOCAB):
    return ModelRunner._sampling_batch(runner, requests, vocab)


def test_steady_greedy_and_plain_random_batches_are_reused():
    runner = _runner()
    reqs = [Request("a", [1, 2], SamplingParams(temperature=0, max_tokens=8)),
            Request("b", [3], SamplingParams(temperature=0.7, top_p=0.9, seed=3, max_tokens=8))]
    first = _batch(runner, reqs)
    reqs[0].append_output_token(5)
    assert _batch(runner, reqs) is first
    assert _batch(runner, reqs, vocab=VOCAB + 1) is not first        # another vocabulary
    other = _batch(runner, reqs[:1])                                  # a request left the batch
    assert other is not first and other.batch_size == 1
    same_id = Request("a", [1, 2], SamplingParams(temperature=0.5, max_tokens=8))
    rebuilt = _batch(runner, [same_id])                               # a new request, old id
    assert rebuilt is not other and not bool(rebuilt.is_greedy[0])


def test_penalties_and_min_tokens_rebuild_every_step():
    runner = _runner()
    pen = [Request("p", [1, 2], SamplingParams(temperature=0, repetition_penalty=1.3,
                                               max_tokens=8))]
    first = _batch(runner, pen)
    pen[0].append_output_token(7)
    second = _batch(runner, pen)
    assert second is not first and bool(second.seen_token_mask[0, 7])  # sees the new token
    runner = _runner()
    req = Request("m", [1], SamplingParams(temperature=0, min_tokens=1, max_tokens=8),
                  eos_token_ids=(2,))
    blocked = _batch(runner, [req])
    assert blocked.min_tokens_rows is not None and not blocked.reusable
    req.append_output_token(4)                                        # min_tokens reached
    free = _batch(runner, [req])
    assert free is not blocked and free.min_tokens_rows is None and free.reusable
    assert _batch(runner, [req]) is free
