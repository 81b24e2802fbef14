"""Greedy output never depends on chunking, token budget, preemption, n > 1 forks or multi-step
decoding."""
from __future__ import annotations

import random

import pytest

from kvforge import LLM, SamplingParams

NUM_BLOCKS = 256
BLOCK = 4


def _prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(3, 49152) for _ in range(n)] for n in (5, 33, 18, 1, 47, 9)]


def _run(path, prompt_chunks=None, **engine_kwargs):
    """Greedy tokens per prompt. ``prompt_chunks``, if given, collects per prompt the sizes of
    the pieces its prompt was scheduled in (from the scheduler's own output)."""
    engine_kwargs.setdefault("num_kv_blocks", NUM_BLOCKS)
    llm = LLM(path, block_size=BLOCK, **engine_kwargs)
    if prompt_chunks is not None:
        _record_prompt_chunks(llm.engine.scheduler, prompt_chunks)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    outs = llm.generate(_prompts(), params, use_tqdm=False)
    llm.engine.check_integrity()
    assert llm.engine.num_free_blocks == llm.engine.runner.num_blocks, "leaked KV blocks"
    return [o.outputs[0].token_ids for o in outs], outs


def _record_prompt_chunks(scheduler, chunks: dict[tuple, list[int]]) -> None:
    """Wrap ``scheduler.schedule``: for each request still computing its prompt, note how many
    prompt tokens the step schedules (keyed by the prompt)."""
    schedule = scheduler.schedule

    def recording_schedule():
        out = schedule()
        for req in out.scheduled:
            prompt_left = req.num_prompt_tokens - req.num_computed_tokens
            if prompt_left > 0:
                n = min(prompt_left, out.num_query_tokens(req.request_id))
                chunks.setdefault(tuple(req.prompt_token_ids), []).append(n)
        return out

    scheduler.schedule = recording_schedule


@pytest.fixture(scope="module")
def tiny(tiny_model_factory):
    path, _ = tiny_model_factory("llama", num_hidden_layers=3)
    # one token a step; the variants below run with the default multi-step decoding on
    baseline, _ = _run(path, num_decode_steps=1)
    return path, baseline


def test_chunked_prefill_off_equals_on(tiny):
    path, _ = tiny
    # below two of the prompts (33, 47 tokens): some chunks are shorter than the decode
    # stack's query runs (16), others longer; prompt rows run the Python layers either way
    budget = 24
    whole, chunked = {}, {}
    tokens_off, _ = _run(path, prompt_chunks=whole, enable_chunked_prefill=False,
                         max_num_batched_tokens=budget)
    tokens_on, _ = _run(path, prompt_chunks=chunked, enable_chunked_prefill=True,
                        max_num_batched_tokens=budget)
    prompts = [tuple(p) for p in _prompts()]
    # off: every prompt in one piece (the engine raises the budget to the context)
    assert all(whole[p] == [len(p)] for p in prompts), whole
    # on: each prompt's chunks add up to it, none exceeds the budget, long ones are split
    assert all(sum(chunked[p]) == len(p) and max(chunked[p]) <= budget for p in prompts), chunked
    assert all(len(chunked[p]) > 1 for p in prompts if len(p) > budget), chunked
    assert tokens_on == tokens_off


def test_tiny_token_budget_forces_chunks(tiny):
    path, baseline = tiny
    chunks = {}
    tokens, _ = _run(path, prompt_chunks=chunks, max_num_batched_tokens=7, max_num_seqs=3)
    assert all(len(chunks[tuple(p)]) >= -(-len(p) // 7) for p in _prompts()), chunks
    assert tokens == baseline


def test_small_kv_pool_forces_preemption(tiny):
    path, baseline = tiny
    # the longest request needs (47 + 20) / 4 = 17 blocks; 20 blocks cannot hold two of them
    tokens, outs = _run(path, num_kv_blocks=20)
    assert tokens == baseline
    assert sum(o.metrics.num_preemptions for o in outs) > 0, "pool was meant to force preemption"


def test_n_forks_share_prompt_and_match(tiny):
    path, baseline = tiny
    llm = LLM(path, block_size=BLOCK, num_kv_blocks=NUM_BLOCKS)
    params = SamplingParams(n=3, temperature=0.0, max_tokens=20, ignore_eos=True)
    outs = llm.generate(_prompts(), params, use_tqdm=False)
    for out, expected in zip(outs, baseline):
        assert [c.index for c in out.outputs] == [0, 1, 2]
        for c in out.outputs:
            assert c.token_ids == expected
    llm.engine.check_integrity()
    assert llm.engine.num_free_blocks == NUM_BLOCKS


def test_n_forks_sampled_are_independent_and_seeded(tiny):
    path, _ = tiny
    llm = LLM(path, block_size=BLOCK, num_kv_blocks=NUM_BLOCKS)
    params = SamplingParams(n=4, temperature=1.0, max_tokens=8, seed=123, ignore_eos=True)
    a = llm.generate([_prompts()[1]], params, use_tqdm=False)[0]
    b = llm.generate([_prompts()[0], _prompts()[1]], params, use_tqdm=False)[1]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert len({tuple(c.token_ids) for c in a.outputs}) > 1, "forks should sample differently"
    llm.engine.check_integrity()
    assert llm.engine.num_free_blocks == NUM_BLOCKS


@pytest.mark.parametrize("context", [40, 300, 700])
def test_native_gguf_rows_are_bitwise_batch_invariant(default_model_path, context):
    """The default GGUF file in its own blocks: k tokens fed as one multi-row step of a sequence
    (speculative verification) give bit-for-bit the logits of feeding them one decode step at
    a time, beside other sequences or alone. (Attention chunks that followed the batch moved
    logits by up to ~0.5 here, and 8-bit activations amplify any such rounding.)"""
    import torch
    from kvforge.attention.metadata import AttentionMetadata
    llm = LLM(default_model_path, num_kv_blocks=128, max_num_seqs=8)
    runner = llm.engine.runner
    model, caches, block = runner.model, runner.kv_caches, runner.block_size
    assert model.quant_config.name == "gguf"
    rng = random.Random(context)
    prompt = [rng.randrange(100, 20000) for _ in range(context)]
    other = [rng.randrange(100, 20000) for _ in range(25)]
    extra = [rng.randrange(100, 20000) for _ in range(5)]
    table = list(range((context + 8) // block + 1))
    other_table = list(range(len(table), len(table) + 3))

    def forward(chunks, contexts, tables):
        meta = AttentionMetadata.build([len(c) for c in chunks], contexts, tables, block)
        with torch.inference_mode():
            return model.compute_logits(
                model(torch.tensor([t for c in chunks for t in c]), meta.positions(), caches,
                      meta))

    forward([prompt, other], [0, 0], [table, other_table])
    one_at_a_time = [forward([[t], [other[i]]], [context + i, 20 + i], [table, other_table])[0]
                     for i, t in enumerate(extra)]
    together = forward([extra], [context], [table])
    for i in range(len(extra)):
        assert torch.equal(together[i], one_at_a_time[i]), f"row {i} of {len(extra)}"


def test_native_gguf_decode_batches_on_int8_panels(default_model_path, monkeypatch):
    """Decode steps of 16+ rows take int8 panels inside the compiled decode stack (set here; the
    engine measures the crossover per machine): a row's logits do not depend on the other rows
    of the batch, and they stay near what the dot kernels give the same rows below the
    crossover (other activation rounding, so not equal)."""
    import torch
    from kvforge.attention.metadata import AttentionMetadata
    monkeypatch.setenv("KVFORGE_GGUF_GEMM_ROWS", "16")
    monkeypatch.setenv("KVFORGE_GGUF_GEMM_KERNEL", "panels")
    llm = LLM(default_model_path, num_kv_blocks=256, max_num_seqs=32)
    runner = llm.engine.runner
    model, caches, block = runner.model, runner.kv_caches, runner.block_size
    assert model.quant_config.name == "gguf"
    rng = random.Random(3)
    prompts = [[rng.randrange(100, 20000) for _ in range(9)] for _ in range(20)]
    tables = [list(range(4 * i, 4 * i + 4)) for i in range(20)]

    def forward(chunks, contexts, rows):
        meta = AttentionMetadata.build([len(c) for c in chunks], contexts,
                                       [tables[i] for i in rows], block)
        with torch.inference_mode():
            return model.compute_logits(
                model(torch.tensor([t for c in chunks for t in c]), meta.positions(), caches,
                      meta))

    forward(prompts, [0] * 20, range(20))                       # 180 prefill rows: panels too
    step = [[rng.randrange(100, 20000)] for _ in range(20)]
    batch_20 = forward(step, [9] * 20, range(20))
    assert model._decode_stack is not None, "decode steps run in the compiled stack"
    batch_17 = forward(step[:17], [9] * 17, range(17))
    assert torch.equal(batch_17, batch_20[:17])
    dots_8 = forward(step[:8], [9] * 8, range(8))                # below the crossover
    difference = (dots_8 - batch_20[:8]).abs().max()
    assert 0 < difference < 0.05 * batch_20[:8].abs().max()
