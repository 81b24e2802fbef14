"""Speculative decoding end to end: greedy output identical with and without it (n-gram,
self-draft, a separate draft model; batched, with preemption, prefix cache on), stops inside an
accepted run truncate exactly, KV accounting stays exact."""
from __future__ import annotations

import random

import pytest

from kvforge import LLM, SamplingParams

BLOCK = 4
MAX_TOKENS = 16


def _prompts() -> list[list[int]]:
    """Prompts that repeat a phrase, so n-gram lookups find something, plus random ones."""
    rng = random.Random(11)
    out = []
    for n, reps in ((6, 3), (9, 2), (4, 5), (13, 1), (1, 1), (21, 2)):
        phrase = [rng.randrange(3, 49152) for _ in range(n)]
        out.append(phrase * reps)
    return out


def _run(path, num_kv_blocks=256, prompts=None, params=None, **engine_kwargs):
    llm = LLM(path, block_size=BLOCK, num_kv_blocks=num_kv_blocks, **engine_kwargs)
    if llm.engine.spec is not None:
        llm.engine.spec.min_acceptance = 0.0      # keep proposing: exercise verification
        llm.engine.spec.max_verify_rows = None    # ... at every batch size
        llm.engine.spec.cost = None               # ... whatever the measured costs say
        llm.engine.spec.guard = None              # ... or the measured step times
    params = params or SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate(prompts or _prompts(), params, use_tqdm=False)
    llm.engine.check_integrity()
    assert llm.engine.num_free_blocks == llm.engine.runner.num_blocks, "leaked KV blocks"
    return [o.outputs[0].token_ids for o in outs], outs, llm.engine


@pytest.fixture(scope="module")
def tiny(tiny_model_factory):
    path, _ = tiny_model_factory("llama", num_hidden_layers=3)
    baseline, _, engine = _run(path)
    assert engine.spec_stats is None
    return path, baseline


@pytest.mark.parametrize("k", [1, 4])
def test_ngram_greedy_identical_and_accepts(tiny, k):
    path, baseline = tiny
    tokens, _, engine = _run(path, speculative_method="ngram", num_speculative_tokens=k)
    assert tokens == baseline
    stats = engine.spec_stats
    assert stats.num_proposed > 0 and stats.num_accepted > 0, stats
    assert stats.mean_accepted_length > 1.0
    assert 0 < stats.acceptance_rate <= 1.0


def test_ngram_with_preemption_and_small_budget(tiny):
    path, baseline = tiny
    # the longest request needs (42 + 16) / 4 = 15 blocks: 18 blocks force preemption
    tokens, outs, engine = _run(path, num_kv_blocks=18, speculative_method="ngram",
                                num_speculative_tokens=3, max_num_batched_tokens=9)
    assert tokens == baseline
    assert sum(o.metrics.num_preemptions for o in outs) > 0, "pool was meant to force preemption"
    assert engine.spec_stats.num_accepted > 0


def test_ngram_without_prefix_cache(tiny):
    path, baseline = tiny
    tokens, _, _ = _run(path, speculative_method="ngram", enable_prefix_caching=False)
    assert tokens == baseline


def test_self_draft_greedy_identical(tiny):
    path, baseline = tiny
    tokens, _, engine = _run(path, speculative_method="draft", speculative_draft_layers=2,
                             num_speculative_tokens=3)
    assert tokens == baseline
    assert engine.spec_stats.num_proposed > 0


def test_self_draft_of_gemma3_greedy_identical(tiny_model_factory):
    """Gemma 3's first layers draft (models/layerwise.py: scaled embedding, RoPE by layer
    type, sliding windows shorter than the prompts); verification keeps the target's tokens."""
    from tests.exit.conftest import GEMMA3
    path, _ = tiny_model_factory("gemma3", num_hidden_layers=4, **GEMMA3)
    baseline, _, _ = _run(path)
    tokens, _, engine = _run(path, speculative_method="draft", speculative_draft_layers=2,
                             num_speculative_tokens=3)
    assert tokens == baseline
    assert engine.runner.drafter.model.num_layers == 2
    assert engine.spec_stats.num_proposed > 0


def test_draft_model_is_its_own_target_accepts_everything(tiny):
    """A separate draft model (here the target itself, loaded again with its own KV cache over
    the same blocks): every greedy proposal must be accepted, through chunked prefill and
    preemption, which only holds if the draft's cache keeps up with every step."""
    path, baseline = tiny
    tokens, outs, engine = _run(path, num_kv_blocks=18, speculative_method="draft",
                                speculative_draft_model=path, num_speculative_tokens=3,
                                speculative_draft_ngram=False)
    assert tokens == baseline
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    stats = engine.spec_stats
    assert stats.num_accepted == stats.num_proposed > 0
    assert stats.mean_accepted_length > 3.0


@pytest.mark.parametrize("batch", [1, 3])
def test_ngram_on_native_gguf_blocks_is_token_identical(default_model_path, batch):
    """On the GGUF file's own blocks (8-bit activations, integer dots) verification rows give
    the bits decoding the same tokens one at a time gives (row-invariant projections and
    attention), so speculation changes no token, not even at near ties."""
    prompts = _prompts()[:batch]
    base, _, engine = _run(default_model_path, prompts=prompts, max_model_len=256,
                           params=SamplingParams(temperature=0.0, max_tokens=48,
                                                 ignore_eos=True))
    assert engine.runner.model.quant_config.name == "gguf"
    tokens, _, engine = _run(default_model_path, prompts=prompts, max_model_len=256,
                             params=SamplingParams(temperature=0.0, max_tokens=48,
                                                   ignore_eos=True),
                             speculative_method="ngram", num_speculative_tokens=4)
    assert engine.spec_stats.num_proposed > 0
    assert tokens == base


def test_gguf_verification_rows_stay_below_the_many_row_kernels(default_model_path,
                                                               monkeypatch):
    """From its crossover a GGUF projection leaves the integer dots for int8 panels or fp32
    tiles, which round otherwise: a verification step of that many rows would score proposals
    with other bits than the plain step. The rows per step stay below the smallest crossover
    of the model (here 4 for every block type: 3 rows, k = 2 of the 7 asked; below the rows
    the fp32 kernel takes in one pass on either ISA, 4 with AVX2), so no token changes."""
    monkeypatch.setenv("KVFORGE_GGUF_GEMM_ROWS", "4")
    prompts = _prompts()[:1]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    base, _, _ = _run(default_model_path, prompts=prompts, max_model_len=256, params=params)
    llm = LLM(default_model_path, block_size=BLOCK, num_kv_blocks=256, max_model_len=256,
              speculative_method="ngram", num_speculative_tokens=7)
    assert llm.engine.spec.max_verify_rows == 3
    llm.engine.spec.guard = None                  # keep proposing whatever the step times say
    tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    llm.engine.check_integrity()
    stats = llm.engine.spec_stats
    assert 0 < stats.num_proposed <= 2 * stats.num_verify_steps
    assert tokens == base


def test_stop_token_inside_accepted_run_truncates(tiny):
    path, baseline = tiny
    # stop at a token the baseline emits late in some output: outputs end exactly there
    row = max(range(len(baseline)), key=lambda i: len(set(baseline[i])))
    stop_id = baseline[row][MAX_TOKENS // 2]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                            stop_token_ids=[stop_id])
    expected, _, _ = _run(path, params=params)
    tokens, outs, engine = _run(path, params=params, speculative_method="ngram")
    assert tokens == expected
    assert all(len(t) <= MAX_TOKENS for t in tokens)
    assert any(o.outputs[0].finish_reason == "stop" for o in outs)


def test_max_tokens_respected(tiny):
    path, baseline = tiny
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    tokens, _, _ = _run(path, params=params, speculative_method="ngram")
    assert tokens == [b[:5] for b in baseline]


def test_bad_speculative_config():
    from kvforge.config import EngineConfig
    with pytest.raises(ValueError, match="speculative_method"):
        EngineConfig(speculative_method="medusa")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        EngineConfig(num_speculative_tokens=0)


def test_cli_flags_reach_the_engine_config():
    from tests.helpers.cli import engine_config_from_flags
    config = engine_config_from_flags(["--speculative-method", "draft", "--num-speculative-tokens",
                                       "3", "--speculative-draft-layers", "2"])
    assert (config.speculative_method, config.num_speculative_tokens,
            config.speculative_draft_layers) == ("draft", 3, 2)
