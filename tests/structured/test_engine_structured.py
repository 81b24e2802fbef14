"""Constrained decoding inside the engine: the sampler's grammar stage, per-sequence matchers
through n > 1, preemption, prefix caching and multi-step decoding; SamplingParams validation."""
from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from kvforge import LLM, SamplingParams
from kvforge.engine.decode_steps import decode_steps_for
from kvforge.engine.request import Request, RequestStatus
from kvforge.structured import StructuredOutputParams
from kvforge.structured.bitmask import (allowed_tokens, apply_grammars, apply_token_bitmask,
                                       fill_token_bitmask)
from tests.structured.schemas import SCHEMAS

SCHEMA = SCHEMAS["nested_object"]


@pytest.fixture(scope="module")
def tiny_path(tiny_model_factory) -> str:
    path, _ = tiny_model_factory("llama")
    return path


def _llm(path, **kwargs) -> LLM:
    return LLM(path, **{"block_size": 4, "num_kv_blocks": 256, "num_threads": 1, **kwargs})


def _texts(llm, prompts, params):
    outs = llm.generate(prompts, params, use_tqdm=False)
    llm.engine.check_integrity()
    assert llm.engine.num_free_blocks == llm.engine.runner.num_blocks, "leaked KV blocks"
    return [[c.text for c in o.outputs] for o in outs], outs


def test_structured_output_params_are_validated():
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputParams()
    with pytest.raises(ValueError, match="not valid JSON"):
        StructuredOutputParams(json="{nope")
    with pytest.raises(ValueError, match="non-empty list"):
        StructuredOutputParams(choice="yes")
    with pytest.raises(ValueError, match="unknown structured output field"):
        SamplingParams(structured_output={"schema": {}})
    with pytest.raises(ValueError, match="must be a StructuredOutputParams or a dict"):
        SamplingParams(structured_output="json")
    with pytest.raises(ValueError, match="min_tokens .* cannot be combined"):
        SamplingParams(min_tokens=2, structured_output={"regex": "a+"})
    params = SamplingParams(structured_output={"json": json.dumps(SCHEMA)})
    assert params.structured_output.json == SCHEMA
    assert (params.structured_output.cache_key()
            == StructuredOutputParams(json=SCHEMA).cache_key())


def test_grammar_stage_masks_only_constrained_rows(tiny_path):
    llm = _llm(tiny_path)
    compiler = llm.engine.grammar_compiler
    tok = llm.tokenizer
    matcher = compiler.matcher(StructuredOutputParams(choice=["yes", "no"]))
    vocab = llm.engine.model_config.vocab_size
    rows, bitmask = fill_token_bitmask([None, matcher], vocab)
    assert rows == [1]
    allowed = allowed_tokens(bitmask, vocab, "cpu")[0].nonzero().flatten().tolist()
    # every allowed token starts "yes" or "no" (or is one of their prefixes)
    texts = [tok.decode([t]) for t in allowed]
    assert allowed and all("yes".startswith(t) or "no".startswith(t) for t in texts), texts
    logits = torch.randn(2, vocab)
    masked = apply_grammars(logits, [None, matcher])
    assert torch.equal(masked[0], logits[0])
    assert set(torch.isfinite(masked[1]).nonzero().flatten().tolist()) == set(allowed)
    # once the grammar is complete only the end-of-sequence tokens remain
    for t in tok.encode("yes", add_special_tokens=False):
        assert matcher.consume(t)
    assert matcher.is_accepting
    rows, bitmask = fill_token_bitmask([matcher], vocab)
    left = allowed_tokens(bitmask, vocab, "cpu")[0].nonzero().flatten().tolist()
    assert set(left) == set(llm.engine.eos_token_ids)


def test_n_samples_preemption_and_prefix_cache_keep_their_matchers(tiny_path):
    """Eight constrained sequences (n = 4, the same prompt twice: prefix cache hits) in a KV
    pool too small for all: preempted sequences recompute and keep their grammar state."""
    params = SamplingParams(temperature=0.8, seed=3, n=4, max_tokens=96,
                            structured_output={"json": SCHEMA})
    prompts = ["Write a user record as JSON: "] * 2
    small = _llm(tiny_path, num_kv_blocks=40, max_num_seqs=8)
    texts, outs = _texts(small, prompts, params)
    assert sum(o.metrics.num_preemptions for o in outs) > 0, "the pool did not force preemption"
    assert small.engine.prefix_cache_stats.hit_rate > 0
    for text in (t for sample in texts for t in sample):
        jsonschema.validate(json.loads(text), SCHEMA)
    # seeded sampling does not depend on the batch: the roomy engine writes the same outputs
    roomy_texts, roomy = _texts(_llm(tiny_path), prompts, params)
    assert sum(o.metrics.num_preemptions for o in roomy) == 0
    assert roomy_texts == texts


def test_multi_step_decoding_falls_back_to_single_steps_for_constrained_rows(tiny_path):
    prompts = ["Some JSON: ", "More JSON: "]
    constrained = SamplingParams(temperature=0, max_tokens=64, structured_output={"json": SCHEMA})
    free = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want, _ = _texts(_llm(tiny_path, num_decode_steps=1), prompts, [constrained, free])
    llm = _llm(tiny_path, num_decode_steps=4)
    got, _ = _texts(llm, prompts, [constrained, free])
    assert got == want
    jsonschema.validate(json.loads(got[0][0]), SCHEMA)
    # the planner gives a decoding request k steps, a constrained one a single step
    for params, steps in ((free, 4), (constrained, 1)):
        req = Request("r", [5, 6, 7], params)
        req.status = RequestStatus.RUNNING
        req.num_computed_tokens = 2
        assert decode_steps_for(req, 4, 512) == steps


def test_bad_grammar_leaves_the_engine_clean(tiny_path):
    llm = _llm(tiny_path)
    with pytest.raises(ValueError, match="invalid regex"):
        llm.engine.add_request(None, "x", SamplingParams(structured_output={"regex": "a(b"}))
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.num_free_blocks == llm.engine.runner.num_blocks


def test_bitmask_unpacking_matches_bit_shifts():
    """Bit t % 32 of word t // 32 (the sign bit included) allows token t, on the rows given."""
    torch.manual_seed(0)
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, 5), dtype=torch.int32)
    bitmask[0, 0] = -2**31                      # only bit 31 of the first word
    shifts = torch.arange(32, dtype=torch.int32)
    want = ((bitmask.unsqueeze(-1) >> shifts) & 1).view(3, -1)[:, :150].bool()
    assert torch.equal(allowed_tokens(bitmask, 150, "cpu"), want)
    assert want[0, :32].nonzero().flatten().tolist() == [31]
    logits = torch.randn(4, 150)
    masked = apply_token_bitmask(logits, [0, 2, 3], bitmask)
    assert torch.equal(masked[1], logits[1])
    for row, mask_row in ((0, 0), (2, 1), (3, 2)):
        assert torch.equal(masked[row], logits[row].masked_fill(~want[mask_row], -float("inf")))
