"""Two replicas behind the cache-aware router answer like one replica, keep shared-prefix
requests together (prefix hit rate no lower than one replica's), and expose every replica's
metrics under a replica label."""
from __future__ import annotations

import concurrent.futures
import random

import httpx
import openai
import pytest
import uvicorn

from kvforge.distributed.dp_server import REPLICA_HEADER, create_router_app
from kvforge.distributed.replicas import ProcessReplicas, RayReplicas
from kvforge.server.background import BackgroundServer, free_port, serve_in_thread

ENGINE = dict(block_size=4, num_kv_blocks=512, max_num_batched_tokens=64, max_num_seqs=16,
              num_threads=1)
OPTIONS = dict(api_key=None, served_model_name="tiny", max_waiting_requests=64, max_n=4,
               shutdown_timeout=5.0, log_level="warning")


class RouterThread:
    """The router app on a loopback port, served from a thread."""

    def __init__(self, urls: list[str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(create_router_app(urls), host="127.0.0.1",
                                                    port=self.port, log_level="warning"))
        self.thread = serve_in_thread(self.server)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module")
def tiny_path(tiny_model_factory) -> str:
    return tiny_model_factory("llama")[0]


@pytest.fixture(scope="module")
def single(tiny_path):
    server = BackgroundServer({"model": tiny_path, **ENGINE}, served_model_name="tiny")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def data_parallel(tiny_path):
    replicas = ProcessReplicas({"model": tiny_path, **ENGINE}, OPTIONS, 2)
    try:
        replicas.wait_ready()
        router = RouterThread(replicas.urls)
        yield router, replicas
        router.stop()
    finally:
        replicas.stop(timeout=10)


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _answer(url: str, prompt: str, stream: bool) -> str:
    client = _client(url)
    kwargs = dict(model="tiny", prompt=prompt, max_tokens=8, temperature=0.0)
    if not stream:
        return client.completions.create(**kwargs).choices[0].text
    return "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs))


def _prefix_counts(url: str) -> tuple[float, float]:
    """(prompt tokens queried, found) in the prefix cache, summed over replicas."""
    text = httpx.get(url + "/metrics", timeout=30).text
    total = {"queries": 0.0, "hits": 0.0}
    for line in text.splitlines():
        for kind in total:
            if line.startswith(f"kvforge:prefix_cache_{kind}_total"):
                total[kind] += float(line.rsplit(" ", 1)[1])
    return total["queries"], total["hits"]


@pytest.mark.slow
def test_concurrent_answers_equal_one_replica(data_parallel, single):
    router, _ = data_parallel
    rng = random.Random(1)
    words = "alpha beta gamma delta river stone cloud paper light music".split()
    prompts = [" ".join(rng.choice(words) for _ in range(rng.randrange(3, 30))) for _ in range(10)]
    jobs = [(p, i % 2 == 0) for i, p in enumerate(prompts)]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        ours = list(pool.map(lambda job: _answer(router.url, *job), jobs))
    expected = [_answer(single.url, p, False) for p in prompts]
    assert ours == expected
    assert all(ours)


@pytest.mark.slow
def test_shared_prefixes_stay_on_one_replica(data_parallel, single):
    router, _ = data_parallel
    rng = random.Random(2)
    vocab = "system policy answer briefly context document table figure section note".split()
    groups = [" ".join(rng.choice(vocab) for _ in range(60)) for _ in range(4)]
    requests = [(gi, f"{groups[gi]} question {i}?") for i in range(3) for gi in range(4)]

    def run(url: str) -> tuple[float, dict[int, set[str]]]:
        before = _prefix_counts(url)
        placed: dict[int, set[str]] = {}
        with httpx.Client(base_url=url, timeout=120) as http:
            for gi, prompt in requests:
                r = http.post("/v1/completions", json={"model": "tiny", "prompt": prompt,
                                                       "max_tokens": 2, "temperature": 0})
                assert r.status_code == 200, r.text
                placed.setdefault(gi, set()).add(r.headers.get(REPLICA_HEADER, "-"))
        after = _prefix_counts(url)
        return (after[1] - before[1]) / (after[0] - before[0]), placed

    dp_rate, placed = run(router.url)
    single_rate, _ = run(single.url)
    assert all(len(replicas) == 1 for replicas in placed.values()), placed
    assert {r for replicas in placed.values() for r in replicas} == {"0", "1"}   # both used
    assert single_rate > 0.5
    assert dp_rate >= single_rate - 1e-9, (dp_rate, single_rate)


@pytest.mark.slow
def test_metrics_are_labelled_by_replica_and_streams_pass_through(data_parallel):
    router, _ = data_parallel
    with httpx.Client(base_url=router.url, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json={
                "model": "tiny", "prompt": "count with me", "max_tokens": 6, "temperature": 0,
                "stream": True}) as r:
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and len(events) >= 3
        text = http.get("/metrics").text
        assert http.get("/health").json() == {"status": "ok", "replicas": 2}
        bad = http.post("/v1/completions", json={"model": "tiny", "prompt": "x",
                                                 "max_tokens": -1})
        assert bad.status_code == 400 and "max_tokens" in bad.text
    for replica in ("0", "1"):
        assert f'kvforge:prefix_cache_queries_total{{model_name="tiny",replica="{replica}"}}' in text
        assert f'kvforge:router_replica_load{{replica="{replica}"}} 0.0' in text
    assert 'kvforge:router_requests_total{reason="' in text


@pytest.mark.slow
def test_a_dead_replica_is_routed_around(data_parallel):
    router, replicas = data_parallel
    # last of the module's tests on this pair: it stops one replica for good
    prompt = {"model": "tiny", "prompt": "a prompt cached on one replica " * 4, "max_tokens": 2,
              "temperature": 0}
    with httpx.Client(base_url=router.url, timeout=30) as http:
        first = http.post("/v1/completions", json=prompt)
        holder = int(first.headers[REPLICA_HEADER])
        replicas.processes[holder].kill()
        replicas.processes[holder].join(10)
        # the cache points at the dead replica: the request goes to the other one instead
        again = http.post("/v1/completions", json=prompt)
        assert again.status_code == 200, again.text
        assert int(again.headers[REPLICA_HEADER]) == 1 - holder
        assert again.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
        health = http.get("/health")
        assert health.status_code == 503 and f"replica {holder}" in health.text


@pytest.mark.slow
def test_ray_replicas_answer_like_one_replica(ray_instance, tiny_path, single):
    replicas = RayReplicas({"model": tiny_path, **ENGINE}, OPTIONS, 2, cpus_per_replica=0.5)
    try:
        replicas.wait_ready()
        router = RouterThread(replicas.urls)
        try:
            prompts = ["ray one", "ray two two", "ray three three three"]
            ours = [_answer(router.url, p, stream=i == 1) for i, p in enumerate(prompts)]
        finally:
            router.stop()
    finally:
        replicas.stop()
    assert ours == [_answer(single.url, p, False) for p in prompts]
