"""Disaggregated serving behind the real SGLang Model Gateway, unmodified: greedy outputs
through its Rust gateway (1P1D, 2P1D, 1P2D) and its mini-lb equal the aggregated
engine's through the same gateway (regular mode, cache-aware) and HF transformers';
completions, chat and streaming; the routes the gateway discovers workers by."""

from __future__ import annotations

import httpx
import pytest
from helpers.reference import hf_greedy

from pd.harness import MODEL, scrape, wait_clean
from pd.workload import CHATS, PROMPTS, chat, completion, stream_text

PD_GATEWAYS = ["1p1d", "mini-lb", "2p1d", "1p2d"]

# The deployment's engines start once, inside the first test's setup.
pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def aggregated(deployment):
    """The aggregated engine's answers through the gateway's regular mode."""
    url = deployment.gateways["regular"].url
    return {
        "completion": [completion(url, p).json()["choices"][0]["text"] for p in PROMPTS],
        "chat": [chat(url, m).json()["choices"][0]["message"]["content"] for m in CHATS],
    }


@pytest.mark.parametrize("gateway", PD_GATEWAYS)
def test_completions_and_chat_equal_the_aggregated_engine(deployment, aggregated, gateway):
    url = deployment.gateways[gateway].url
    for prompt, want in zip(PROMPTS, aggregated["completion"]):
        r = completion(url, prompt)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["choices"][0]["text"] == want, prompt
        assert body["usage"]["completion_tokens"] == 8
    for messages, want in zip(CHATS, aggregated["chat"]):
        r = chat(url, messages)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == want


@pytest.mark.parametrize("gateway", PD_GATEWAYS)
def test_streaming_equals_the_aggregated_engine(deployment, aggregated, gateway):
    url = deployment.gateways[gateway].url
    for prompt, want in zip(PROMPTS, aggregated["completion"]):
        body = {"prompt": prompt, "max_tokens": 8}
        assert stream_text(url, "/v1/completions", body) == want
    for messages, want in zip(CHATS, aggregated["chat"]):
        body = {"messages": messages, "max_tokens": 8}
        assert stream_text(url, "/v1/chat/completions", body) == want


@pytest.mark.parametrize("gateway", ["1p1d", "mini-lb"])
def test_batched_generate_equals_transformers(deployment, gateway):
    """SGLang's /generate with a batch of input_ids: one room per prompt."""
    url = deployment.gateways[gateway].url
    tokenizer_prompts = [[5, 17, 99], list(range(30, 60)), [7]]
    body = {
        "input_ids": tokenizer_prompts,
        "sampling_params": {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True},
    }
    r = httpx.post(f"{url}/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    results = r.json()
    assert len(results) == 3
    for ids, result in zip(tokenizer_prompts, results):
        assert result["output_ids"] == hf_greedy(str(deployment.checkpoint), tuple(ids), 6)[0]


def test_chat_with_several_choices_gets_one_room_per_choice(deployment, aggregated):
    """The gateway sends a list of rooms for a chat with n > 1 (one per choice)."""
    r = chat(deployment.gateways["1p1d"].url, CHATS[0], n=2)
    assert r.status_code == 200, r.text
    texts = [c["message"]["content"] for c in r.json()["choices"]]
    assert texts == [aggregated["chat"][0]] * 2


def test_logprobs_cross_with_the_bootstrap_token(deployment):
    """The first token's logprobs come from the prefill engine, the rest from decode."""
    pd = completion(deployment.gateways["1p1d"].url, PROMPTS[1], logprobs=2).json()
    plain = completion(deployment.gateways["regular"].url, PROMPTS[1], logprobs=2).json()
    got, want = pd["choices"][0]["logprobs"], plain["choices"][0]["logprobs"]
    assert got["tokens"] == want["tokens"]
    assert got["token_logprobs"] == pytest.approx(want["token_logprobs"], abs=1e-4)
    assert [sorted(t) for t in got["top_logprobs"]] == [sorted(t) for t in want["top_logprobs"]]


def test_regular_mode_discovers_the_model_id(deployment):
    gateway = deployment.gateways["regular"].url
    workers = httpx.get(f"{gateway}/workers", timeout=10).json()["workers"]
    assert [w["model_id"] for w in workers] == [MODEL]
    assert workers[0]["metadata"]["disaggregation_mode"] == "null"
    pd_workers = httpx.get(f"{deployment.gateways['1p1d'].url}/workers", timeout=10).json()
    assert sorted(w["worker_type"] for w in pd_workers["workers"]) == ["decode", "prefill"]
    assert {w["model_id"] for w in pd_workers["workers"]} == {MODEL}


def test_engines_answer_the_gateway_routes(deployment):
    prefill, decode = deployment.engines["P1"], deployment.engines["D1"]
    for path in ("/server_info", "/get_server_info"):
        info = httpx.get(f"{prefill.url}{path}", timeout=10).json()
        assert info["disaggregation_mode"] == "prefill"
        assert info["disaggregation_bootstrap_port"] == prefill.bootstrap_port
        assert info["served_model_name"] == MODEL and info["tp_size"] == 1
    assert httpx.get(f"{decode.url}/server_info").json()["disaggregation_mode"] == "decode"
    for path in ("/model_info", "/get_model_info"):
        info = httpx.get(f"{decode.url}{path}", timeout=10).json()
        assert info["architectures"] == ["LlamaForCausalLM"] and info["is_generation"]
    for engine in (prefill, decode):
        assert httpx.get(f"{engine.url}/health_generate", timeout=30).status_code == 200
        (load,) = httpx.get(f"{engine.url}/get_load", timeout=10).json()
        assert set(load) >= {"dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens"}
    wait_clean([prefill, decode])
    assert httpx.post(f"{decode.url}/flush_cache", timeout=10).status_code == 200


def test_a_plain_engine_refuses_bootstrap_fields(deployment):
    body = {"bootstrap_host": "127.0.0.1", "bootstrap_port": 1, "bootstrap_room": 3}
    r = completion(deployment.engines["A"].url, "hi", **body)
    assert r.status_code == 400
    assert "disaggregation-mode plain" in r.json()["error"]["message"]


def test_transfers_show_in_both_engines_metrics(deployment):
    completion(deployment.gateways["1p1d"].url, PROMPTS[0])
    prefill, decode = scrape(deployment.engines["P1"].url), scrape(deployment.engines["D1"].url)
    assert prefill['tokenspeed:pd_transfers_total{outcome="ok",role="prefill"}'] > 0
    assert decode['tokenspeed:pd_transfers_total{outcome="ok",role="decode"}'] > 0
    assert prefill['tokenspeed:pd_transfer_bytes_total{role="prefill"}'] > 0
    assert decode['tokenspeed:pd_transfer_throughput_gbps{role="decode"}'] > 0
    # the decode engine's TTFT is the bootstrap token's arrival: it is recorded there
    assert decode["tokenspeed:time_to_first_token_seconds_count"] > 0
    wait_clean([deployment.engines[n] for n in ("P1", "P2", "D1", "D2")])
