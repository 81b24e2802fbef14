"""The OpenAI server on an offloaded model: concurrent requests through the official client
(continuous batching over streamed layers, KV on disk) give the offline in-memory greedy text."""
import concurrent.futures

import pytest

from kvforge import LLM, SamplingParams
from kvforge.server.background import BackgroundServer

PROMPTS = ["Once upon a time", "The capital of France is", "1 2 3 4", "Hello, my name is"]


@pytest.fixture(scope="module")
def tiny_dir(tiny_model_factory):
    d, _ = tiny_model_factory("llama", num_hidden_layers=4)
    return d


def test_server_on_an_offloaded_model_matches_offline_greedy(tiny_dir, tmp_path):
    offline = LLM(tiny_dir, quantization="none", max_model_len=128, kv_cache_memory="16MiB")
    expect = [o.outputs[0].text for o in offline.generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)]
    server = BackgroundServer(dict(model=tiny_dir, max_model_len=128, num_threads=1,
                                   offload_memory_budget="64MiB", offload_dir=str(tmp_path),
                                   offload_policy="w=0,kv=0", offload_batch_size=2,
                                   offload_block_batches=2), served_model_name="tiny")
    try:
        import openai
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                               timeout=120)

        def complete(prompt):
            r = client.completions.create(model="tiny", prompt=prompt, max_tokens=8,
                                          temperature=0, extra_body={"ignore_eos": True})
            return r.choices[0].text

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            got = list(pool.map(complete, PROMPTS))
        assert got == expect
        runner = server.in_engine(lambda e: e.runner)
        assert runner.model.kv_disk and runner.model.bytes_written > 0
    finally:
        server.stop()
