"""LLM.generate accepts vLLM's prompt dicts ({"prompt": ...} / {"prompt_token_ids": ...}) beside
strings and token-id lists, and refuses malformed ones without leaving requests behind."""
from __future__ import annotations

import pytest

from kvforge import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_model_factory):
    hf_dir, _ = tiny_model_factory("llama")
    return LLM(hf_dir, num_kv_blocks=64, block_size=4)


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_prompt_dicts_match_plain_prompts(llm):
    text, ids = "The quick brown fox", [5, 17, 300, 42, 9]
    plain = _tokens(llm.generate([text, ids], GREEDY, use_tqdm=False))
    dicts = _tokens(llm.generate([{"prompt": text}, {"prompt_token_ids": ids}], GREEDY,
                                 use_tqdm=False))
    assert dicts == plain
    assert _tokens(llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)) == plain[1:]
    out = llm.generate({"prompt": text}, GREEDY, use_tqdm=False)
    assert len(out) == 1 and out[0].prompt_token_ids == llm.tokenizer.encode(text)


@pytest.mark.parametrize("prompt,match", [
    ({"prompt": "hi", "multi_modal_data": {"image": None}}, "multi_modal_data"),
    ({"prompt": "hi", "prompt_token_ids": [1, 2]}, "exactly one"),
    ({}, "exactly one"),
    ({"text": "hi"}, "unknown prompt keys"),
    ({"prompt": 5}, "'prompt' must be a string"),
    ({"prompt_token_ids": ["a"]}, "list of ints"),
    (3.5, "got float"),
])
def test_bad_prompt_dicts_are_refused_cleanly(llm, prompt, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(["fine prompt", prompt], GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()        # the good prompt was not left queued
    llm.engine.check_integrity()
