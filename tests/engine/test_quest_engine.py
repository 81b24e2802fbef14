"""QUEST through the engine: config, layer indices, and greedy output vs dense."""
from __future__ import annotations

import random

import pytest

from kvforge import LLM, SamplingParams
from kvforge.attention.quest import QuestAttentionBackend
from kvforge.config import EngineConfig

BLOCK = 4


def _prompts() -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(3, 49152) for _ in range(n)] for n in (70, 9, 41, 120)]


def _run(path, **kwargs):
    llm = LLM(path, block_size=BLOCK, num_kv_blocks=200, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outs = llm.generate(_prompts(), params, use_tqdm=False)
    llm.engine.check_integrity()
    assert llm.engine.num_free_blocks == llm.engine.runner.num_blocks, "leaked KV blocks"
    return llm, [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def tiny(tiny_model_factory):
    path, _ = tiny_model_factory("llama", num_hidden_layers=4)
    _, dense = _run(path)
    return path, dense


def test_full_budget_greedy_identical_to_dense(tiny):
    path, dense = tiny
    llm, tokens = _run(path, sparse_attention="quest", sparse_token_budget=512,
                       max_num_batched_tokens=16)     # chunked prefill writes the bounds
    assert tokens == dense
    backends = [layer.self_attn.attn for layer in llm.engine.runner.model.model.layers]
    assert all(isinstance(b, QuestAttentionBackend) for b in backends)
    assert [b.layer_idx for b in backends] == [0, 1, 2, 3]
    assert {b.token_budget for b in backends} == {512}


def test_small_budget_runs_sparse_and_frees_everything(tiny):
    path, dense = tiny
    # 32 tokens = 8 blocks per decode in layers 2-3; the 70/120-token prompts exceed it
    _, tokens = _run(path, sparse_attention="quest", sparse_token_budget=32)
    assert [len(t) for t in tokens] == [24] * 4
    assert tokens[1] == dense[1], "a sequence within the budget is read whole"
    assert tokens != dense, "a budget far below the context was meant to change some output"


def test_all_layers_dense_equals_dense(tiny):
    path, dense = tiny
    _, tokens = _run(path, sparse_attention="quest", sparse_token_budget=8, quest_dense_layers=4)
    assert tokens == dense


@pytest.mark.parametrize("kwargs, match", [
    ({"sparse_attention": "streaming"}, "sparse_attention must be one of"),
    ({"sparse_attention": "quest", "sparse_token_budget": 0}, "sparse_token_budget"),
    ({"sparse_attention": "quest", "sparse_token_budget": 8}, "smaller than one block"),
    ({"sparse_attention": "quest", "quest_dense_layers": -1}, "quest_dense_layers"),
    ({"sparse_attention": "quest", "kv_cache_dtype": "fp8_e4m3"}, "cannot be combined"),
])
def test_config_rejects_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kwargs)


def test_config_selects_the_backend():
    assert EngineConfig(sparse_attention="quest").attention_backend == "quest"
    assert EngineConfig().attention_backend == "paged"


def test_cli_flags_reach_the_engine_config(tmp_path, capsys):
    from kvforge.cli import main
    from tests.helpers.cli import engine_config_from_flags
    config = engine_config_from_flags(["--sparse-attention", "quest", "--sparse-token-budget",
                                       "1024", "--quest-dense-layers", "3"])
    assert (config.attention_backend, config.sparse_token_budget,
            config.quest_dense_layers) == ("quest", 1024, 3)
    rc = main(["generate", "x", "--model", str(tmp_path / "m"), "--sparse-attention", "quest",
               "--sparse-token-budget", "0"])
    assert rc == 2 and "sparse_token_budget" in capsys.readouterr().err


@pytest.mark.slow
def test_speculative_verify_chunks_with_quest(tiny):
    # verification rows carry several tokens, so they run the dense prefill path; rejected
    # drafts are rewritten later and the bounds recomputed, so full budget still equals dense
    path, dense = tiny
    _, tokens = _run(path, sparse_attention="quest", sparse_token_budget=512,
                     speculative_method="ngram", num_speculative_tokens=3)
    assert tokens == dense
    _, tokens = _run(path, sparse_attention="quest", sparse_token_budget=32,
                     speculative_method="ngram", num_speculative_tokens=3)
    assert [len(t) for t in tokens] == [24] * 4


def test_memory_sized_pool_counts_the_bounds_rows_once_per_block(tiny):
    # a block holds B slots + 1 bounds row per KV head and plane: B + 1 rows, not 2 B
    path, _ = tiny
    memory = 1 << 20
    quest = LLM(path, block_size=16, kv_cache_memory=memory, sparse_attention="quest").engine
    paged = LLM(path, block_size=16, kv_cache_memory=memory).engine
    paged_per_token = paged.runner.model.kv_cache_bytes_per_token()
    per_block = quest.runner.model.kv_cache_bytes_per_block(16)
    assert per_block == paged_per_token * 17
    assert quest.runner.num_blocks == memory // per_block
    assert quest.runner.num_blocks > memory // (quest.runner.model.kv_cache_bytes_per_token() * 16)
