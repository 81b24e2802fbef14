"""A separate draft model end to end, on tiny random models: greedy output identical with n-gram
guesses and early stops, the draft's KV rolled back exactly (its proposals are its own greedy
continuation of the request, through rejections, preemption and prefix caching), its KV paid from
the same budget and checked by check_integrity, and drafts with another vocabulary refused."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from kvforge import LLM, SamplingParams
from kvforge.spec.base import DRAFT_PLACEHOLDER
from tests.spec.test_spec_engine import _run


@pytest.fixture(scope="module")
def pair(tiny_model_factory):
    """(target dir, draft dir, greedy baseline): the draft is another random model, so it
    disagrees often and its KV must be rolled back after most steps."""
    target, _ = tiny_model_factory("llama", num_hidden_layers=3)
    draft, _ = tiny_model_factory("llama", num_hidden_layers=2, seed=1)
    baseline, _, _ = _run(target)
    return target, draft, baseline


def _record_proposals(engine) -> list[tuple[list[int], list[int]]]:
    """Wrap the drafter: (request tokens before the step, the draft model's proposal)."""
    drafter, seen = engine.runner.drafter, []
    propose = drafter.propose

    def recording(sched, kv):
        # placeholders: the draft model fills them (the rest are n-gram guesses)
        before = {rid: list(r.all_token_ids) for r in sched.scheduled
                  if (rid := r.request_id) in sched.spec_token_ids
                  and sched.spec_token_ids[rid][0] == DRAFT_PLACEHOLDER}
        out = propose(sched, kv)
        seen.extend((ctx, list(sched.spec_token_ids[rid])) for rid, ctx in before.items())
        return out
    drafter.propose = recording
    return seen


def test_draft_plus_ngram_greedy_identical_with_preemption(pair):
    target, draft, baseline = pair
    tokens, outs, engine = _run(target, num_kv_blocks=18, speculative_method="draft",
                                speculative_draft_model=draft, num_speculative_tokens=3)
    assert tokens == baseline
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    stats, drafts = engine.spec_stats, engine.runner.drafter.stats
    assert stats.num_ngram_steps > 0, "the prompts repeat phrases: n-gram guesses expected"
    assert stats.num_verify_steps > stats.num_ngram_steps, "and draft-model proposals"
    assert drafts.num_model_drafts > 0 and drafts.num_passes > 0


def test_frequent_token_draft_head_proposes_only_its_tokens_and_changes_no_output(pair,
                                                                                 tmp_path,
                                                                                 monkeypatch):
    """FR-Spec: the draft's head over its N most frequent tokens (plus the special ones)
    proposes nothing else, and the target's verification keeps the output identical."""
    from kvforge.spec.frequent_vocab import resolve_size
    monkeypatch.setenv("KVFORGE_CACHE_DIR", str(tmp_path))      # the set is cached there
    target, draft, baseline = pair
    tokens, _, engine = _run(target, speculative_method="draft", speculative_draft_model=draft,
                             num_speculative_tokens=3, speculative_draft_vocab=2000,
                             speculative_draft_ngram=False)
    assert tokens == baseline
    head = engine.runner.draft_model.compute_logits
    kept = set(head.token_ids.tolist())
    assert 2000 <= len(kept) < 2000 + 10             # N + the special tokens, no duplicates
    assert engine.runner.drafter.stats.num_model_drafts > 0
    logits = head(torch.randn(3, engine.runner.draft_model.config.hidden_size))
    assert logits.shape[1] == engine.runner.draft_model.config.vocab_size
    assert set(torch.nonzero(torch.isfinite(logits[0])).flatten().tolist()) == kept
    assert list(tmp_path.glob("spec/frequent-*-2000.json"))
    assert resolve_size(None, 151936) == 65536 and resolve_size(0, 151936) == 0
    assert resolve_size(None, 49152) == 0 and resolve_size(70000, 49152) == 0
    with pytest.raises(ValueError, match="speculative_draft_vocab"):
        LLM(target, speculative_method="draft", speculative_draft_model=draft,
            speculative_draft_vocab=-3)


@pytest.mark.parametrize("num_kv_blocks", [256, 18])
def test_proposals_are_the_draft_models_own_greedy_continuation(pair, num_kv_blocks):
    """Exact rollback: whatever the target rejected, preempted or shared through the prefix
    cache, each proposal must be what the draft alone generates greedily from the request's
    tokens (stale draft KV would change them)."""
    target, draft, _ = pair
    llm = LLM(target, block_size=4, num_kv_blocks=num_kv_blocks, speculative_method="draft",
              speculative_draft_model=draft, num_speculative_tokens=3)
    llm.engine.spec.cost = None
    llm.engine.spec.min_acceptance = 0.0
    llm.engine.spec.guard = None
    seen = _record_proposals(llm.engine)
    prompts = [[5, 6, 7, 8, 9] * 3, [11, 12, 13] * 5, [21, 22, 23, 24, 25, 26, 27]]
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
                 use_tqdm=False)
    llm.engine.check_integrity()
    model_drafted = [(ctx, d) for ctx, d in seen if d]
    assert len(model_drafted) >= 10
    rejected = llm.engine.spec_stats.num_proposed - llm.engine.spec_stats.num_accepted
    assert rejected > 0, "the random draft was meant to be rejected"
    _check_against_draft_alone(draft, model_drafted)


def _check_against_draft_alone(draft, model_drafted) -> None:
    """Each (context, proposal) must be what the draft alone generates greedily from it."""
    reference = LLM(draft, block_size=4, num_kv_blocks=256, enable_prefix_caching=False)
    outs = reference.generate([ctx for ctx, _ in model_drafted],
                              [SamplingParams(temperature=0.0, max_tokens=len(d), ignore_eos=True)
                               for _, d in model_drafted], use_tqdm=False)
    for (ctx, drafts), out in zip(model_drafted, outs):
        assert drafts == out.outputs[0].token_ids, f"after {len(ctx)} tokens"


@pytest.mark.parametrize("num_kv_blocks", [256, 24])
def test_prefix_cache_hits_reuse_the_drafts_kv_and_proposals_stay_exact(pair, num_kv_blocks):
    """A chat's next turn hits the prefix cache: the draft starts after the blocks it filled
    in the previous turn instead of re-running the whole conversation; with a pool small
    enough that other prompts evict and reuse those blocks, nothing stale is trusted (every
    proposal is the draft alone's greedy continuation)."""
    target, draft, _ = pair
    llm = LLM(target, block_size=4, num_kv_blocks=num_kv_blocks, speculative_method="draft",
              speculative_draft_model=draft, num_speculative_tokens=3,
              speculative_draft_ngram=False)
    engine = llm.engine
    engine.spec.cost, engine.spec.min_acceptance, engine.spec.guard = None, 0.0, None
    drafter = engine.runner.drafter
    assert engine.kv_manager.pool.on_block_reused == drafter.forget_block
    seen = _record_proposals(engine)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    first = [3 + (7 * i) % 500 for i in range(41)]
    other = [600 + (11 * i) % 300 for i in range(45)]
    answer = llm.generate([first], params, use_tqdm=False)[0].outputs[0].token_ids
    rows_before = drafter.stats.num_rows
    second = first + list(answer) + [9, 10, 11]              # the next turn of the chat
    llm.generate([second], params, use_tqdm=False)
    second_rows = drafter.stats.num_rows - rows_before
    llm.generate([other], params, use_tqdm=False)            # evicts and reuses in a small pool
    llm.generate([second + [12, 13]], params, use_tqdm=False)
    engine.check_integrity()
    if num_kv_blocks == 256:
        # 12 tokens of passes 1..3 per step at most, plus what the filled blocks do not cover
        assert second_rows < len(second) - 24, (second_rows, len(second))
    _check_against_draft_alone(draft, [(ctx, d) for ctx, d in seen if d])


def test_low_confidence_drafts_stop_early_and_output_stays_identical(pair):
    target, draft, baseline = pair
    tokens, _, engine = _run(target, speculative_method="draft", speculative_draft_model=draft,
                             num_speculative_tokens=4, speculative_draft_ngram=False,
                             speculative_draft_min_confidence=0.5)
    assert tokens == baseline
    stats = engine.runner.drafter.stats
    # a random model's distributions are flat: its first draft is already below 0.5
    assert stats.num_early_stops > 0
    assert engine.spec_stats.num_proposed < 4 * engine.spec_stats.num_verify_steps


def test_draft_kv_is_paid_from_the_same_budget(pair):
    target, draft, _ = pair
    alone = LLM(target, block_size=4, kv_cache_memory="1MiB").engine.runner
    both = LLM(target, block_size=4, kv_cache_memory="1MiB", speculative_method="draft",
               speculative_draft_model=draft).engine.runner
    per_block = (alone.model.kv_cache_bytes_per_block(4)
                 + both.draft_model.kv_cache_bytes_per_block(4))
    assert both.num_blocks == (1 << 20) // per_block < alone.num_blocks
    assert all(c.shape[1] == both.num_blocks for c in both.draft_kv_caches)


@pytest.mark.parametrize("corrupt", ["past_tokens", "too_many_drafts"])
def test_check_integrity_catches_draft_kv_past_what_was_written(pair, corrupt):
    target, draft, _ = pair
    _, _, engine = _run(target, speculative_method="draft", speculative_draft_model=draft,
                        num_speculative_tokens=3)
    written = next(iter(engine.runner.drafter._written.values()))
    if corrupt == "past_tokens":
        written.num_real = written.request.num_tokens + 1
    else:
        written.drafts = [7] * 3          # k = 3 proposals feed back at most 2
    with pytest.raises(AssertionError, match="draft KV of request"):
        engine.check_integrity()


def test_refuses_a_draft_with_another_vocabulary_size(pair, tiny_model_factory):
    target, _, _ = pair
    other, _ = tiny_model_factory("llama", num_hidden_layers=1, vocab_size=1000)
    with pytest.raises(ValueError, match="vocabulary of 1000 tokens, the target 49152"):
        LLM(target, speculative_method="draft", speculative_draft_model=other)


def test_refuses_a_draft_whose_tokenizer_maps_ids_differently(pair, tmp_path):
    target, draft, _ = pair
    swapped = tmp_path / "draft"
    shutil.copytree(draft, swapped)
    path = os.path.join(swapped, "tokenizer.json")
    with open(path) as f:
        tok = json.load(f)
    vocab = tok["model"]["vocab"]
    a, b = "hello", "world"
    vocab[a], vocab[b] = vocab[b], vocab[a]
    with open(path, "w") as f:
        json.dump(tok, f)
    with pytest.raises(ValueError, match="token id .* in its tokenizer but"):
        LLM(target, speculative_method="draft", speculative_draft_model=str(swapped))


def test_a_draft_model_needs_recompute_preemption():
    from kvforge.config import EngineConfig
    with pytest.raises(ValueError, match="preemption_mode 'recompute', got 'swap'"):
        EngineConfig(speculative_method="draft", speculative_draft_model="x",
                     preemption_mode="swap")


def test_cli_flags_reach_the_engine_config():
    from tests.helpers.cli import engine_config_from_flags
    config = engine_config_from_flags([
        "--speculative-method", "draft", "--speculative-draft-model", "qwen2.5-coder-0.5b-instruct",
        "--no-speculative-draft-ngram", "--speculative-draft-min-confidence", "0.3"])
    assert (config.speculative_draft_model, config.speculative_draft_ngram,
            config.speculative_draft_min_confidence) == ("qwen2.5-coder-0.5b-instruct", False, 0.3)
    assert engine_config_from_flags(["--speculative-method", "draft"]).speculative_draft_ngram
    from kvforge.config import EngineConfig
    with pytest.raises(ValueError, match="speculative_draft_min_confidence must be in"):
        EngineConfig(speculative_draft_min_confidence=1.5)


def test_each_tokenizer_is_read_once_at_start(pair, monkeypatch):
    """The engine, the draft's vocabulary check and its frequent-token head share one read of
    each model's tokenizer (ModelSource.load_tokenizer): a 152k-token vocabulary is ~0.3 s."""
    from kvforge.tokenizer import Tokenizer
    target, draft, _ = pair
    reads = []
    real = Tokenizer.from_pretrained.__func__

    def counting(cls, model_dir):
        reads.append(os.path.abspath(model_dir))
        return real(cls, model_dir)
    monkeypatch.setattr(Tokenizer, "from_pretrained", classmethod(counting))
    llm = LLM(target, speculative_method="draft", speculative_draft_model=draft,
              num_speculative_tokens=3)
    assert sorted(reads) == sorted([os.path.abspath(target), os.path.abspath(draft)])
    assert llm.engine.tokenizer is not None
