"""How a model is cut into tensor-parallel slices, and the options refused with it."""
from __future__ import annotations

import pytest

from kvforge.config import EngineConfig
from kvforge.distributed.tp_plan import TensorParallelPlan, even_range
from kvforge.models.config import ModelConfig


def _config(heads: int, kv: int, arch: str = "LlamaForCausalLM", **kw) -> ModelConfig:
    return ModelConfig(architecture=arch, vocab_size=kw.pop("vocab", 49152), hidden_size=576,
                       num_hidden_layers=2, num_attention_heads=heads, num_key_value_heads=kv,
                       intermediate_size=kw.pop("intermediate", 1536), **kw)


def test_even_range_covers_everything_once():
    for n, parts in ((10, 3), (3, 2), (1536, 2), (7, 7)):
        ranges = [even_range(n, parts, i) for i in range(parts)]
        assert [i for r in ranges for i in r] == list(range(n))
        assert max(map(len, ranges)) - min(map(len, ranges)) <= 1


def test_smollm2_heads_split_as_whole_gqa_groups():
    # SmolLM2-135M: 9 query heads in 3 groups of 3 over 2 ranks -> 2 groups + 1 group
    config = _config(9, 3)
    r0, r1 = (TensorParallelPlan.for_rank(config, 2, r) for r in (0, 1))
    assert (r0.kv_heads, r0.q_heads) == (range(0, 2), range(0, 6))
    assert (r1.kv_heads, r1.q_heads) == (range(2, 3), range(6, 9))
    assert (r0.intermediate, r1.intermediate) == (range(0, 768), range(768, 1536))
    assert r0.vocab_shard == r1.vocab_shard == 24576 and r1.vocab_start == 24576
    local = r1.local_config(config)
    assert (local.num_attention_heads, local.num_key_value_heads, local.head_dim) == (3, 1, 64)


def test_fewer_kv_heads_than_ranks_are_replicated():
    config = _config(8, 2)
    plans = [TensorParallelPlan.for_rank(config, 4, r) for r in range(4)]
    assert [p.kv_heads for p in plans] == [range(0, 1), range(0, 1), range(1, 2), range(1, 2)]
    assert [p.q_heads for p in plans] == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]


def test_vocab_not_divisible_is_padded():
    config = _config(4, 2, vocab=1001)
    plans = [TensorParallelPlan.for_rank(config, 2, r) for r in (0, 1)]
    assert [p.vocab_shard for p in plans] == [501, 501]
    assert plans[1].vocab_start + plans[1].vocab_shard >= 1001


def test_mlp_cut_on_block_boundaries():
    """Qwen2.5-1.5B's 8960 intermediate rows are 35 Q4_K blocks of 256: 18 + 17 blocks, never
    a block split between ranks (float weights: 4480 each)."""
    config = _config(12, 2, intermediate=8960)
    blocks = [TensorParallelPlan.for_rank(config, 2, r, intermediate_unit=256).intermediate
              for r in (0, 1)]
    assert blocks == [range(0, 4608), range(4608, 8960)]
    assert [TensorParallelPlan.for_rank(config, 2, r).intermediate for r in (0, 1)] == \
        [range(0, 4480), range(4480, 8960)]
    # a short last unit still goes to a rank: 300 = 256 + 44
    short = [TensorParallelPlan.for_rank(_config(4, 2, intermediate=300), 2, r,
                                         intermediate_unit=256).intermediate for r in (0, 1)]
    assert short == [range(0, 256), range(256, 300)]
    with pytest.raises(ValueError, match="fewer than tensor_parallel_size 2 units of 256"):
        TensorParallelPlan.for_rank(_config(4, 2, intermediate=256), 2, 0, intermediate_unit=256)


@pytest.mark.parametrize("config, n, match", [
    (_config(4, 4, arch="GPT2LMHeadModel"), 2, "GPT2LMHeadModel"),
    (_config(6, 2), 3, "does not split the model's 2 KV heads"),
    (_config(4, 2, intermediate=1), 2, "intermediate_size 1"),
])
def test_unsupported_models_are_refused_by_name(config, n, match):
    with pytest.raises(ValueError, match=match):
        TensorParallelPlan.for_rank(config, n, 0)


@pytest.mark.parametrize("kwargs, match", [
    (dict(tensor_parallel_size=0), "tensor_parallel_size must be an integer >= 1, got 0"),
    (dict(distributed_executor_backend="mpi"), "'mpi'"),
    (dict(tensor_parallel_size=2, quantization="int8"), "'int8'"),
    (dict(tensor_parallel_size=2, speculative_method="ngram"), "speculative decoding"),
    (dict(tensor_parallel_size=2, preemption_mode="swap"), "'swap'"),
    (dict(tensor_parallel_size=2, kv_cache_dtype="fp8_e4m3"), "fp8"),
])
def test_engine_config_refuses_what_tensor_parallel_does_not_run(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kwargs)
