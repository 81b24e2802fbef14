"""TP=2 gives the tokens of TP=1 (greedy), on both executors; a dead worker fails requests
with an error instead of hanging; shutdown leaves no worker behind."""
from __future__ import annotations

import os
import signal
import time

import pytest

from kvforge import LLM, SamplingParams
from kvforge.distributed.executor import WorkerDiedError
from kvforge.quant.gguf import GGUFLinearMethod

PROMPTS = [[5, 6, 7, 100, 2000], list(range(10, 47)), [300 + 7 * i for i in range(19)]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
# a small budget splits the long prompts into chunks; n=2 forks share a partial block, which
# the scheduler copies on write (the workers must copy the same blocks)
ENGINE = dict(block_size=4, num_kv_blocks=96, max_num_batched_tokens=16, num_threads=1)


def _tokens(llm: LLM, params=GREEDY, prompts=PROMPTS) -> list[list[list[int]]]:
    outs = llm.generate(prompts, [params, SamplingParams(**{**_kw(params), "n": 2}), params],
                        use_tqdm=False)
    return [[c.token_ids for c in o.outputs] for o in outs]


def _kw(params: SamplingParams) -> dict:
    return dict(temperature=params.temperature, max_tokens=params.max_tokens,
                ignore_eos=params.ignore_eos)


def _check_tp_matches(path: str, backend: str = "mp", prompts=PROMPTS, **kw) -> LLM:
    reference = _tokens(LLM(path, **ENGINE, **kw), prompts=prompts)
    llm = LLM(path, **ENGINE, tensor_parallel_size=2, distributed_executor_backend=backend, **kw)
    try:
        assert _tokens(llm, prompts=prompts) == reference
        llm.engine.check_integrity()
        assert llm.engine.num_free_blocks == llm.engine.runner.num_blocks
    finally:
        llm.engine.shutdown()
    return llm


def _gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.slow
@pytest.mark.parametrize("kind, overrides", [
    # 3 KV heads on 2 ranks: uneven GQA groups (2 + 1), like SmolLM2
    ("llama", dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=3)),
    # one KV head: replicated on both ranks, its query heads split
    ("llama", dict(num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True)),
    # q/k/v biases (column-parallel, sliced with their rows)
    ("qwen2", dict()),
], ids=["llama-uneven-gqa", "llama-mqa-tied", "qwen2-bias"])
def test_tp2_greedy_equals_tp1(tiny_model_factory, kind, overrides):
    path, _ = tiny_model_factory(kind, **overrides)
    llm = _check_tp_matches(path)
    assert all(_gone(pid) for pid in llm.engine.runner.worker_pids), "a worker outlived shutdown"


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["shm", "gloo"])
def test_all_reduce_in_shared_memory_or_gloo_gives_tp1_tokens(tiny_model_factory, monkeypatch,
                                                               mode):
    """Local ranks sum through shared memory by default (``auto``), gloo when asked; the
    file is unlinked once every rank has mapped it."""
    monkeypatch.setenv("KVFORGE_TP_ALLREDUCE", mode)
    path, _ = tiny_model_factory("llama", hidden_size=96, num_attention_heads=6,
                                 num_key_value_heads=3)
    llm = _check_tp_matches(path)
    shm = llm.engine.runner.tp.comm.shm
    assert (shm is not None) == (mode == "shm")
    if shm is not None:
        assert shm.calls > 0 and not os.path.exists(shm.path)


def test_shared_memory_all_reduce_mode_is_checked(monkeypatch, tiny_model_factory):
    path, _ = tiny_model_factory("llama")
    monkeypatch.setenv("KVFORGE_TP_ALLREDUCE", "nvlink")
    with pytest.raises(ValueError, match="KVFORGE_TP_ALLREDUCE must be one of"):
        LLM(path, **ENGINE, tensor_parallel_size=2)


@pytest.mark.slow
@pytest.mark.parametrize("quantization", ["auto", "none"], ids=["gguf-blocks", "dequantized"])
def test_tp2_default_model_equals_tp1(default_model_path, quantization):
    """The default model's Q4_1 file, sliced in its own blocks ("auto") or in fp32."""
    prompt = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    kwargs = dict(quantization=quantization, kv_cache_memory="64MiB", max_model_len=512)
    reference = LLM(default_model_path, **kwargs).generate([prompt], params, use_tqdm=False)
    llm = LLM(default_model_path, **kwargs, tensor_parallel_size=2)
    try:
        down = llm.engine.runner.model.model.layers[0].mlp.down_proj
        assert isinstance(down.method, GGUFLinearMethod) == (quantization == "auto")
        ours = llm.generate([prompt], params, use_tqdm=False)
    finally:
        llm.engine.shutdown()
    assert ours[0].outputs[0].token_ids == reference[0].outputs[0].token_ids
    assert "Paris" in ours[0].outputs[0].text


@pytest.mark.slow
def test_tp2_ray_greedy_equals_tp1(ray_instance, tiny_model_factory):
    path, _ = tiny_model_factory("llama", hidden_size=96, num_attention_heads=6,
                                 num_key_value_heads=3)
    _check_tp_matches(path, backend="ray")


def _kill_worker_mid_request(llm: LLM) -> None:
    """A request half done (prefilled, one token out), then its worker killed: the next step
    raises WorkerDiedError naming the worker, and so does every later request."""
    engine = llm.engine
    engine.add_request("r", PROMPTS[1], GREEDY)
    engine.step()
    pid = engine.runner.worker_pids[0]
    os.kill(pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(WorkerDiedError, match=rf"rank 1 .*pid {pid}"):
        while engine.has_unfinished_requests():
            engine.step()
    assert time.monotonic() - start < 5.0
    with pytest.raises(WorkerDiedError):
        llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False)
    engine.shutdown()


@pytest.mark.slow
def test_killed_mp_worker_fails_requests(tiny_model_factory):
    path, _ = tiny_model_factory("llama")
    _kill_worker_mid_request(LLM(path, **ENGINE, tensor_parallel_size=2))


@pytest.mark.slow
def test_killed_ray_worker_fails_requests(ray_instance, tiny_model_factory):
    path, _ = tiny_model_factory("llama")
    _kill_worker_mid_request(LLM(path, **ENGINE, tensor_parallel_size=2,
                                 distributed_executor_backend="ray"))


@pytest.mark.slow
def test_killed_worker_fails_the_servers_request_in_flight(tiny_model_factory):
    import concurrent.futures

    import httpx

    from kvforge.server.background import BackgroundServer
    path, _ = tiny_model_factory("llama")
    server = BackgroundServer({"model": path, **ENGINE, "tensor_parallel_size": 2},
                              served_model_name="tiny")
    try:
        with httpx.Client(base_url=server.url, timeout=60) as http, \
                concurrent.futures.ThreadPoolExecutor(1) as pool:
            long = pool.submit(http.post, "/v1/completions", json={
                "model": "tiny", "prompt": "a long story", "max_tokens": 300,
                "ignore_eos": True})
            while not server.in_engine(lambda e: e.scheduler.num_running):
                time.sleep(0.01)
            pid = server.in_engine(lambda e: e.runner.worker_pids[0])
            os.kill(pid, signal.SIGKILL)
            answer = long.result(timeout=30)
            assert answer.status_code == 503
            assert f"pid {pid}" in answer.json()["error"]["message"]
            assert http.get("/health").status_code == 503
    finally:
        server.stop()


def test_a_failed_start_leaves_no_shared_memory_file(tiny_model_factory, monkeypatch):
    """No executor (e.g. Ray missing), or workers that cannot start: the error reaches the
    caller and no shared-memory file for the all-reduce is left behind."""
    import glob

    from kvforge.distributed import executor, tp_runner
    path, _ = tiny_model_factory("llama")
    monkeypatch.setenv("KVFORGE_TP_ALLREDUCE", "shm")
    before = set(glob.glob("/dev/shm/kvforge-tp-*"))

    def no_executor(backend, n):
        raise RuntimeError("no executor today")

    with monkeypatch.context() as m:
        m.setattr(tp_runner, "create_executor", no_executor)
        with pytest.raises(RuntimeError, match="no executor today"):
            LLM(path, **ENGINE, tensor_parallel_size=2)
    assert set(glob.glob("/dev/shm/kvforge-tp-*")) == before

    def refuse(self, specs):
        raise RuntimeError("no workers today")

    monkeypatch.setattr(executor.MultiprocessingExecutor, "start", refuse)
    with pytest.raises(RuntimeError, match="no workers today"):
        LLM(path, **ENGINE, tensor_parallel_size=2)
    assert set(glob.glob("/dev/shm/kvforge-tp-*")) == before


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["gguf", "hf"])
def test_tp2_gemma3_equals_tp1(tmp_path_factory, fmt):
    """Gemma 3 (tiny, random, a GGUF in its own blocks and an HF directory): its one KV head is
    replicated on both ranks, its per-head q/k norms run on each rank's heads, its
    post-attention / post-FFN norms, embedding scale and sliding-window layers on every rank;
    TP=2 gives TP=1's tokens, the prompts running past the window of 8."""
    from tests.models.test_gemma3 import gemma_files_in, gguf_shaped_hf
    hf = gguf_shaped_hf(num_attention_heads=4, num_key_value_heads=1, sliding_window=8)
    path, hf_dir = gemma_files_in(tmp_path_factory.mktemp("gemma3_tp"), hf)
    vocab = hf.config.vocab_size
    _check_tp_matches(path if fmt == "gguf" else hf_dir,
                      prompts=[[t % vocab for t in p] for p in PROMPTS])
