"""OpenAI's logit_bias through the engine: it holds on every path a request can decode by
(one step, multi-step decoding in the compiled stack, n-gram speculation), and a bad bias is
refused before anything is queued."""
from __future__ import annotations

import pytest

from kvforge import LLM, SamplingParams

PROMPTS = [[5, 17, 300, 42, 9, 5, 17, 300, 42, 9], list(range(100, 120))]


def _tokens(llm, **params):
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True,
                                                **params), use_tqdm=False)
    llm.engine.check_integrity()
    assert llm.engine.num_free_blocks == llm.engine.runner.num_blocks, "leaked KV blocks"
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("engine", [dict(num_decode_steps=1), dict(num_decode_steps=4),
                                    dict(speculative_method="ngram", num_speculative_tokens=3)])
def test_logit_bias_forces_and_bans_on_every_decode_path(tiny_model_factory, engine):
    path, _ = tiny_model_factory("llama")
    llm = LLM(path, block_size=4, num_kv_blocks=128, **engine)
    plain = _tokens(llm)
    assert _tokens(llm, logit_bias={777: 100.0}) == [[777] * 10] * 2
    banned = {t: -100.0 for t in set(plain[0] + plain[1])}
    for seq in _tokens(llm, logit_bias=banned):
        assert not set(seq) & set(banned)


def test_logit_bias_outside_the_vocabulary_is_refused(tiny_model_factory):
    path, _ = tiny_model_factory("llama")
    llm = LLM(path, block_size=4, num_kv_blocks=64)
    vocab = llm.engine.model_config.vocab_size
    with pytest.raises(ValueError, match=f"logit_bias token id {vocab} is outside"):
        llm.generate([PROMPTS[0]], SamplingParams(max_tokens=4, logit_bias={vocab: 5.0}),
                     use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.num_free_blocks == llm.engine.runner.num_blocks
