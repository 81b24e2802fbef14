"""Gemma 3 offloaded: scaled embedding rows, local / global RoPE by layer, the sliding layers'
windows inside the per-batch attention on staged KV, four norms a layer, a softcapped head;
greedy tokens identical to the same model in memory (which tests/models/test_gemma3.py holds
to HF transformers), fp32 rows and the GGUF file's own blocks."""
import pytest

from kvforge import LLM, SamplingParams
from tests.models.test_gemma3 import gemma_files_in, gguf_shaped_hf

# longer than the sliding layers' window of 8: the windows decide what these prompts see
PROMPTS = [[5, 9, 13, 2, 7, 11, 3, 17, 19, 23, 29, 31, 4, 6], [40, 41, 42], list(range(60, 90)),
           [8, 8, 9, 9, 10, 10, 11]]
PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """(GGUF path, HF directory) of a tiny Gemma 3 with a softcapped head."""
    return gemma_files_in(tmp_path_factory.mktemp("gemma3"),
                          gguf_shaped_hf(final_logit_softcapping=5.0))


def greedy(llm) -> tuple[list[list[int]], list[float]]:
    """(tokens, each chosen token's logprob: the softcap shows there, not in the argmax)."""
    outs = [o.outputs[0] for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
    return ([o.token_ids for o in outs],
            [lp[t] for o in outs for lp, t in zip(o.logprobs, o.token_ids)])


@pytest.mark.parametrize("fmt", ["hf", "gguf"])
@pytest.mark.parametrize("policy, block_batches", [("w=0,kv=0", 2), ("w=50,kv=50", 2),
                                                   ("lp", None)])
def test_offloaded_gemma3_greedy_identical_to_in_memory(files, tmp_path, fmt, policy,
                                                        block_batches):
    path, hf_dir = files
    model = path if fmt == "gguf" else hf_dir
    quantization = "auto" if fmt == "gguf" else "none"
    common = dict(quantization=quantization, max_model_len=128, max_num_batched_tokens=24,
                  enable_prefix_caching=False)
    expected, expected_lp = greedy(LLM(model, kv_cache_memory="16MiB", **common))
    llm = LLM(model, offload_memory_budget="64MiB", offload_dir=str(tmp_path),
              offload_policy=policy, offload_batch_size=2, offload_block_batches=block_batches,
              **common)
    streamed = llm.engine.runner.model
    assert streamed.family.name == "Gemma 3"
    tokens, logprobs = greedy(llm)
    assert tokens == expected
    assert max(abs(a - b) for a, b in zip(logprobs, expected_lp)) < 1e-3
    if policy == "w=0,kv=0":
        assert len(streamed.kv_disk) == streamed.num_layers and not streamed.resident_layers
        assert streamed.bytes_written > 0
    assert streamed.store.bytes_read > 0
    llm.engine.check_integrity()
    llm.engine.shutdown()
