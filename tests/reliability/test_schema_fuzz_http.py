"""Fuzzing with schemathesis: every operation of the server's own OpenAPI document
(/openapi.json, whose request bodies are the msgspec Structs the routes decode) gets
bodies generated from its schema -- valid ones (positive mode) and ones that break it
(negative mode). No answer is a 5xx, every 4xx is an OpenAI error body, and afterwards
the server is healthy, idle, and answers a greedy probe as before."""

from __future__ import annotations

import time
from collections import Counter

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from reliability.harness import GREEDY, run_server

EXAMPLES = {GenerationMode.POSITIVE: 120, GenerationMode.NEGATIVE: 80}  # per operation
PROBE = {"prompt": "The for statement", "max_tokens": 8, **GREEDY}


@pytest.fixture(scope="module")
def server(reliability_checkpoint, tmp_path_factory):
    # A short context keeps generated requests quick; prompts up to 64 tokens.
    with run_server(
        reliability_checkpoint, tmp_path_factory.mktemp("logs"), max_model_len=64,
        grammar_compile_timeout_secs=5,
    ) as s:  # fmt: skip
        yield s


def operations(server):
    schema = schemathesis.openapi.from_url(
        server.base_url + "/openapi.json", headers=server.headers
    )
    return [result.ok() for result in schema.get_all_operations()]


def test_the_openapi_document_describes_every_request_body(server):
    ops = {(op.method.upper(), op.path): op for op in operations(server)}
    for path in ("/v1/completions", "/v1/chat/completions", "/generate", "/abort_request"):
        assert ops["POST", path].body, f"POST {path} has no request body schema"


def test_fuzzed_requests_never_get_a_5xx(server):
    import httpx

    probe = httpx.post(server.base_url + "/v1/completions", json=PROBE, headers=server.headers)
    statuses: Counter = Counter()
    slowest = 0.0
    for op in operations(server):
        for mode, examples in EXAMPLES.items():
            if mode is GenerationMode.NEGATIVE and not op.body:
                continue  # nothing to break in an operation without inputs

            @given(case=op.as_strategy(generation_mode=mode))
            @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
                      suppress_health_check=list(HealthCheck))  # fmt: skip
            def fuzz(case):
                nonlocal slowest
                start = time.monotonic()
                response = case.call(base_url=server.base_url, headers=server.headers, timeout=60)
                slowest = max(slowest, time.monotonic() - start)
                statuses[case.operation.label, response.status_code] += 1
                assert response.status_code < 500, (case.body, response.text[:500])
                if response.status_code >= 400:
                    error = response.json()["error"]
                    assert error["message"] and error["type"], response.text

            fuzz()
    sent = sum(statuses.values())
    by_status = Counter()
    for (_, status), n in statuses.items():
        by_status[status] += n
    print(f"reliability: schema-fuzz requests={sent} by_status={dict(by_status)} "
          f"slowest={slowest:.2f}s")  # fmt: skip
    after = httpx.post(server.base_url + "/v1/completions", json=PROBE, headers=server.headers)
    assert after.json()["choices"][0]["text"] == probe.json()["choices"][0]["text"]
    assert httpx.get(server.base_url + "/health").status_code == 200
    log = server.log()
    assert "Traceback" not in log, log[-3000:]
