"""OpenAI's Predicted Outputs: the predicted text is searched by n-gram lookup as if it stood
between the prompt and the output; the output never changes, and where it repeats the
prediction the guesses are accepted."""
from __future__ import annotations

import random

import pytest

from kvforge import LLM, SamplingParams

MAX_TOKENS = 40


def _run(llm, prompts, **params):
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                ignore_eos=True, **params), use_tqdm=False)
    llm.engine.check_integrity()
    assert llm.engine.num_free_blocks == llm.engine.runner.num_blocks, "leaked KV blocks"
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def setup(tiny_model_factory):
    path, _ = tiny_model_factory("llama", num_hidden_layers=2)
    rng = random.Random(5)
    prompt = [rng.randrange(3, 49152) for _ in range(24)]       # nothing to look up in it
    plain = _run(LLM(path, block_size=4, num_kv_blocks=128), [prompt])[0]
    return path, prompt, plain


def _spec_llm(path):
    llm = LLM(path, block_size=4, num_kv_blocks=128, speculative_method="ngram",
              num_speculative_tokens=4)
    llm.engine.spec.min_acceptance = 0.0
    llm.engine.spec.max_verify_rows = None
    llm.engine.spec.cost = None
    llm.engine.spec.guard = None
    return llm


def test_a_prediction_of_the_output_is_accepted_and_changes_nothing(setup):
    path, prompt, plain = setup
    llm = _spec_llm(path)
    assert _run(llm, [prompt]) == [plain]
    without = llm.engine.spec_stats.num_accepted
    assert _run(llm, [prompt], prediction=plain) == [plain]            # token ids
    accepted = llm.engine.spec_stats.num_accepted - without
    assert accepted >= MAX_TOKENS // 2 > without, (accepted, without)
    text = llm.tokenizer.decode(plain)
    assert _run(llm, [prompt], prediction=text) == [plain]             # text


def test_a_wrong_prediction_changes_nothing_and_engines_without_lookup_ignore_it(setup):
    path, prompt, plain = setup
    wrong = [(t + 1) % 49152 for t in plain]
    assert _run(_spec_llm(path), [prompt], prediction=wrong) == [plain]
    assert _run(LLM(path, block_size=4, num_kv_blocks=128), [prompt], prediction=plain) == [plain]


@pytest.mark.parametrize("bad, message", [([1, "x"], "prediction must be text or a list"),
                                          ({"a": 1}, "prediction must be text or a list")])
def test_bad_prediction_is_refused(bad, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(prediction=bad)


def test_prediction_outside_the_vocabulary_is_refused(setup):
    path, prompt, _ = setup
    llm = LLM(path, block_size=4, num_kv_blocks=64)
    with pytest.raises(ValueError, match="prediction token id 99999999 is outside"):
        llm.generate([prompt], SamplingParams(max_tokens=2, prediction=[5, 99999999]),
                     use_tqdm=False)
    assert llm.engine.num_free_blocks == llm.engine.runner.num_blocks
