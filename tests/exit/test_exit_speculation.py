"""Lossless self-speculation from an exit head: greedy output identical to plain decoding,
drafts proposed and some accepted, KV accounting exact; an untrained layer is refused."""
from __future__ import annotations

import pytest

from kvforge import LLM, SamplingParams
from tests.exit.test_early_exit import PROMPTS


def _run(path, **kwargs):
    llm = LLM(path, block_size=4, num_kv_blocks=128, **kwargs)
    if llm.engine.spec is not None:
        llm.engine.spec.min_acceptance = 0.0      # keep proposing: exercise verification
        llm.engine.spec.max_verify_rows = None
        llm.engine.spec.guard = None
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    llm.engine.check_integrity()
    assert llm.engine.num_free_blocks == llm.engine.runner.num_blocks, "leaked KV blocks"
    return [o.outputs[0].token_ids for o in outs], llm.engine


@pytest.mark.parametrize("layer", [None, 2])
def test_greedy_identical_to_plain(tiny_path, saved_heads, layer):
    plain, _ = _run(tiny_path)
    tokens, engine = _run(tiny_path, speculative_method="early-exit", num_speculative_tokens=3,
                          speculative_draft_layers=layer)
    assert engine.runner.drafter.model.num_layers == (layer or 1)
    assert engine.spec_stats.num_proposed > 0
    assert tokens == plain


def test_untrained_exit_layer_is_refused(tiny_path, saved_heads):
    with pytest.raises(ValueError, match="no trained exit head after layer 3"):
        LLM(tiny_path, block_size=4, num_kv_blocks=32, speculative_method="early-exit",
            speculative_draft_layers=3)


def test_streaming_llm_with_early_exit_drafts_matches_streaming_alone(tiny_path, saved_heads):
    """The exit draft runs the target's own first layers, windowed like the rest: under
    StreamingLLM (4 sinks, window 16, blocks behind it freed) the tokens are StreamingLLM's."""
    window = dict(attention_sinks=4, sliding_window=16, max_num_batched_tokens=16)
    plain, _ = _run(tiny_path, **window)
    tokens, engine = _run(tiny_path, speculative_method="early-exit", num_speculative_tokens=3,
                          **window)
    assert engine.spec_stats.num_proposed > 0 and engine.spec_stats.num_accepted > 0
    assert tokens == plain


@pytest.mark.parametrize("method", ["early-exit", "draft"])
def test_drafts_from_the_targets_layers_borrow_a_frequent_token_head(tiny_path, saved_heads,
                                                                     tmp_path, monkeypatch,
                                                                     method):
    """The exit draft and the self-draft read the target's LM head; with
    ``speculative_draft_vocab`` only its rows of the N most frequent tokens (FR-Spec): drafts
    propose nothing else and the output stays the target's."""
    import torch
    monkeypatch.setenv("KVFORGE_CACHE_DIR", str(tmp_path))      # the set is cached there
    plain, _ = _run(tiny_path)
    tokens, engine = _run(tiny_path, speculative_method=method, num_speculative_tokens=3,
                          speculative_draft_layers=2, speculative_draft_vocab=2000)
    assert tokens == plain
    draft = engine.runner.drafter.model
    kept = set(draft.compute_logits.token_ids.tolist())
    assert 2000 <= len(kept) < 2010                   # N + the special tokens
    hidden = torch.randn(2, engine.runner.model.config.hidden_size)
    logits = draft.compute_logits(hidden)
    assert set(torch.nonzero(torch.isfinite(logits[0])).flatten().tolist()) == kept
    # the kept tokens' logits are the target's own (Gemma 3's soft-cap included)
    ids = sorted(kept)
    torch.testing.assert_close(logits[:, ids], engine.runner.model.compute_logits(hidden)[:, ids])
    assert engine.spec_stats.num_proposed > 0
