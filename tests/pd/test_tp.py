"""Tensor parallelism on both sides of a disaggregated pair (rank r of the decode engine
receives from rank r of the prefill engine), and unequal TP refused with a clear error."""

from __future__ import annotations

import httpx
import pytest
from helpers.reference import hf_greedy

from pd.harness import start_engine, start_gateway, wait_clean, wait_engine
from pd.workload import PROMPTS, completion

# The deployment's engines start once, inside the first test's setup.
pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def tp2(deployment):
    names = {"P-tp2": "prefill", "D-tp2": "decode"}
    engines = {
        n: start_engine(deployment.checkpoint, deployment.logs, n, role=r, tp=2)
        for n, r in names.items()
    }
    gateways = []
    try:
        for engine in engines.values():
            wait_engine(engine)
        p, d = engines["P-tp2"], engines["D-tp2"]
        gateways.append(start_gateway(deployment.logs, "gw-tp2", prefill=[p], decode=[d]))
        gateways.append(
            start_gateway(
                deployment.logs, "gw-unequal", prefill=[deployment.engines["P1"]], decode=[d]
            )
        )
        yield engines, gateways
    finally:
        for proc in (*gateways, *engines.values()):
            proc.stop()


def test_tp2_on_both_sides_equals_transformers_and_the_aggregated_engine(deployment, tp2):
    engines, (gateway, _) = tp2
    ids = [[5, 17, 99, 3], list(range(40, 75))]
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True},
    }
    r = httpx.post(f"{gateway.url}/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    for prompt, result in zip(ids, r.json()):
        assert result["output_ids"] == hf_greedy(str(deployment.checkpoint), tuple(prompt), 6)[0]
    regular = deployment.gateways["regular"].url
    for prompt in PROMPTS:
        got = completion(gateway.url, prompt).json()["choices"][0]["text"]
        assert got == completion(regular, prompt).json()["choices"][0]["text"]
    wait_clean(list(engines.values()))


def test_unequal_tp_is_refused_with_a_clear_error(deployment, tp2):
    engines, (_, unequal) = tp2
    r = completion(unequal.url, PROMPTS[0])
    assert r.status_code == 400, r.text
    assert "tensor parallelism" in r.text and "tp=1" in r.text and "tp=2" in r.text
    wait_clean([deployment.engines["P1"], engines["D-tp2"]])
