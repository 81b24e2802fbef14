"""Attention windows on an offloaded model: StreamingLLM past the model's context and a model's
own sliding window, with the KV on disk (freed entries neither staged nor read) or in RAM;
greedy tokens identical to the same engine in memory."""
import pytest

from kvforge import LLM, SamplingParams
from tests.helpers.engine_watch import run_and_watch

PARAMS = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
PROMPTS = [[5, 9, 13, 2, 7, 11, 3, 17, 19, 23, 29, 31, 4, 6] * 3, [40, 41, 42],
           list(range(60, 90))]
COMMON = dict(quantization="none", block_size=4, max_num_batched_tokens=24,
              enable_prefix_caching=False)


@pytest.fixture(scope="module")
def short_context(tiny_model_factory):
    path, _ = tiny_model_factory("llama", max_position_embeddings=64, initializer_range=0.1)
    return path


@pytest.fixture(scope="module")
def mistral_window(tiny_model_factory):
    path, _ = tiny_model_factory("mistral", sliding_window=8, initializer_range=0.1)
    return path


@pytest.mark.parametrize("policy", ["w=0,kv=0", "w=50,kv=50"])
def test_streaming_llm_offloaded_matches_in_memory(short_context, tmp_path, policy):
    window = dict(attention_sinks=4, sliding_window=16)
    expected, _, _ = run_and_watch(LLM(short_context, num_kv_blocks=64, **window, **COMMON),
                                   PROMPTS, PARAMS)
    llm = LLM(short_context, offload_memory_budget="64MiB", offload_dir=str(tmp_path),
              offload_policy=policy, offload_batch_size=2, offload_block_batches=2,
              **window, **COMMON)
    got, most_held, _ = run_and_watch(llm, PROMPTS, PARAMS, decoding_only=True)
    assert got == expected                      # 42 + 120 positions past a 64-token context
    assert most_held <= 7                       # sinks + window: older blocks were freed
    assert llm.engine.runner.model.kv_disk      # some layers' KV on disk
    llm.engine.check_integrity()
    llm.engine.shutdown()


def test_a_models_own_window_offloaded_matches_in_memory(mistral_window, tmp_path):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    expected, _, _ = run_and_watch(LLM(mistral_window, num_kv_blocks=64, max_model_len=128,
                                       **COMMON), PROMPTS, params)
    llm = LLM(mistral_window, max_model_len=128, offload_memory_budget="64MiB",
              offload_dir=str(tmp_path), offload_policy="w=0,kv=0", offload_batch_size=2,
              offload_block_batches=2, **COMMON)
    got, _, _ = run_and_watch(llm, PROMPTS, params)
    assert got == expected
    llm.engine.check_integrity()
    llm.engine.shutdown()
