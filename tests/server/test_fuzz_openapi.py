"""Fuzz every endpoint of the server's own OpenAPI schema with schemathesis: valid and invalid
requests alike never get a 5xx, every 4xx carries the OpenAI error body, and the engine is left
clean (no request, no KV block held) afterwards."""
from __future__ import annotations

from collections import Counter

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from tests.server.conftest import TINY_ENGINE, ServerThread

# examples per (operation, mode); GETs without parameters have one distinct case at most
EXAMPLES = {"POST /v1/completions": 50, "POST /v1/chat/completions": 50, "POST /tokenize": 25,
            "POST /detokenize": 25}
MIN_REQUESTS = 200


@pytest.fixture(scope="module")
def fuzz_server(tiny_path):
    # a short context keeps each generated request cheap: every max_tokens that fits is small
    s = ServerThread(tiny_path, engine_kwargs={**TINY_ENGINE, "max_model_len": 48})
    yield s
    s.stop()


def check_response(resp: requests.Response, label: str) -> None:
    assert resp.status_code < 500, f"{label}: {resp.status_code} {resp.text[:300]}"
    if resp.status_code >= 400:
        err = resp.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}, f"{label}: {resp.text[:300]}"
        assert isinstance(err["message"], str) and err["message"], label
        assert isinstance(err["type"], str) and err["type"], label


@pytest.mark.slow
def test_fuzz_every_endpoint_no_5xx_and_openai_errors(fuzz_server):
    schema = schemathesis.openapi.from_url(fuzz_server.url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    labels = {op.label for op in operations}
    assert set(EXAMPLES) <= labels and "GET /v1/models" in labels     # the schema is complete
    sent: Counter = Counter()
    statuses: Counter = Counter()
    session = requests.Session()

    def fuzz(op, mode: GenerationMode, n: int) -> None:
        @settings(max_examples=n, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(case=op.as_strategy(generation_mode=mode))
        def run(case):
            resp = case.call(base_url=fuzz_server.url, session=session, timeout=60)
            check_response(resp, f"{op.label} ({mode.value}): {case.body!r:.300}")
            sent[op.label] += 1
            statuses[resp.status_code // 100 * 100] += 1
        run()

    for op in operations:
        n = EXAMPLES.get(op.label, 5)
        fuzz(op, GenerationMode.POSITIVE, n)
        if op.label in EXAMPLES:            # the others take no input to get wrong
            fuzz(op, GenerationMode.NEGATIVE, n // 2)
    total = sum(sent.values())
    print(f"fuzz: {total} requests, by operation {dict(sent)}, by status {dict(statuses)}")
    assert total >= MIN_REQUESTS, sent
    assert statuses[200] > 20 and statuses[400] > 20, statuses    # both kinds really exercised
    fuzz_server.assert_clean()
