"""SGLang's native routes: POST /generate and POST /abort_request."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from server.conftest import wait_idle

from tokenspeed_aio.tokenization.tokenizer import Tokenizer

GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture
async def http(http_server):
    async with httpx.AsyncClient(
        base_url=http_server.base_url, headers=http_server.headers, timeout=30
    ) as client:
        yield client


async def test_generate_text_returns_sglang_result(http, http_server):
    tokenizer = Tokenizer(http_server.checkpoint)
    body = {"text": "Hello there", "sampling_params": {"max_new_tokens": 6, **GREEDY}}
    res = (await http.post("/generate", json=body)).json()
    assert len(res["output_ids"]) == 6
    assert res["text"] == tokenizer.decode(res["output_ids"])
    meta = res["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    assert meta["prompt_tokens"] == len(tokenizer.encode("Hello there"))
    assert meta["completion_tokens"] == 6 and meta["e2e_latency"] > 0
    # the same prompt as input_ids gives the same tokens
    ids = tokenizer.encode("Hello there")
    again = (await http.post("/generate", json={**body, "text": None, "input_ids": ids})).json()
    assert again["output_ids"] == res["output_ids"]


async def test_generate_batch_with_per_prompt_params_and_logprobs(http):
    body = {
        "input_ids": [[10, 11, 12], [20, 21]],
        "sampling_params": [{"max_new_tokens": 3, **GREEDY}, {"max_new_tokens": 5, **GREEDY}],
        "rid": ["batch-a", "batch-b"],
        "return_logprob": True,
        "top_logprobs_num": 2,
    }
    results = (await http.post("/generate", json=body)).json()
    assert [r["index"] for r in results] == [0, 1]
    assert [r["meta_info"]["id"] for r in results] == ["batch-a", "batch-b"]
    assert [len(r["output_ids"]) for r in results] == [3, 5]
    for r in results:
        token_lps = r["meta_info"]["output_token_logprobs"]
        assert [t for _, t, _ in token_lps] == r["output_ids"]
        assert all(len(top) == 2 for top in r["meta_info"]["output_top_logprobs"])


async def test_generate_stream_is_cumulative(http):
    body = {"text": "Count:", "stream": True, "sampling_params": {"max_new_tokens": 5, **GREEDY}}
    response = await http.post("/generate", json=body)
    events = [e.removeprefix("data: ") for e in response.text.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    lengths = [len(c["output_ids"]) for c in chunks]
    assert lengths == sorted(lengths) and lengths[-1] == 5
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])


async def test_abort_request_ends_a_running_generate(http, http_server):
    params = {"max_new_tokens": 900, **GREEDY}
    body = {"text": "A long one", "rid": "to-abort", "sampling_params": params}
    running = asyncio.create_task(http.post("/generate", json=body))
    while not (await http.post("/abort_request", json={"rid": "to-abort"})).json()["aborted"]:
        await asyncio.sleep(0.01)  # not admitted yet
    res = (await running).json()
    assert res["meta_info"]["finish_reason"]["type"] == "abort"
    assert res["meta_info"]["completion_tokens"] == len(res["output_ids"]) < 900
    await wait_idle(http_server.base_url)


async def test_abort_request_by_openai_response_id(http, http_server):
    body = {"prompt": "Go on", "max_tokens": 900, "n": 2, "stream": True, "ignore_eos": True}
    reasons = {}
    async with http.stream("POST", "/v1/completions", json=body) as response:
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if not reasons:
                aborted = (await http.post("/abort_request", json={"rid": chunk["id"]})).json()
                assert sorted(aborted["aborted"]) == [f"{chunk['id']}-0", f"{chunk['id']}-1"]
            for choice in chunk["choices"]:
                reasons.setdefault(choice["index"], None)
                if choice["finish_reason"]:
                    reasons[choice["index"]] = choice["finish_reason"]
    assert reasons == {0: "abort", 1: "abort"}
    await wait_idle(http_server.base_url)


async def test_rid_already_running_is_a_409(http, http_server):
    body = {"text": "x", "rid": "dup", "sampling_params": {"max_new_tokens": 900, **GREEDY}}
    async with http.stream("POST", "/generate", json={**body, "stream": True}) as first:
        lines = first.aiter_lines()
        while not (await anext(lines)).startswith("data: {"):
            pass  # the first one runs once its first chunk arrives
        second = await http.post("/generate", json=body)
        assert second.status_code == 409
        assert "dup" in second.json()["error"]["message"]
        assert (await http.post("/abort_request", json={"rid": "dup"})).json()["aborted"] == ["dup"]
        events = [line async for line in lines if line.startswith("data: {")]
    assert json.loads(events[-1][6:])["meta_info"]["finish_reason"]["type"] == "abort"
    await wait_idle(http_server.base_url)


# -- the fields /generate takes --------------------------------------------------------
TEXT = {"text": "Hello there", "sampling_params": {"max_new_tokens": 2, **GREEDY}}
# (body fields over TEXT, the param the 400 names)
REFUSED = [
    ({"sampling_parms": {}}, "sampling_parms"),  # a misspelling, not silently defaults
    ({"max_new_tokens": 4}, "max_new_tokens"),  # a sampling param at the top level
    ({"sampling_params": {"max_tokens": 4}}, "sampling_params.max_tokens"),  # vLLM's name
    ({"input_ids": [[1, 2], [3]], "text": None,
      "sampling_params": [{"max_new_tokens": 2}, {"max_new_tokens": 2, "seed": 1}]},
     "sampling_params[1].seed"),
    # documented by SGLang, not implemented here: refused away from their defaults
    ({"lora_path": "adapters/a"}, "lora_path"),
    ({"return_hidden_states": True}, "return_hidden_states"),
    ({"logprob_start_len": 0, "return_logprob": True}, "logprob_start_len"),
    ({"image_data": "https://example.com/cat.png"}, "image_data"),
    ({"sampling_params": {"stop_regex": "a+"}}, "sampling_params.stop_regex"),
    ({"input_ids": [[1, 2], [3]], "text": None,
      "sampling_params": [{"max_new_tokens": 2}, {"custom_params": {"k": 1}}]},
     "sampling_params[1].custom_params"),
]  # fmt: skip


@pytest.mark.parametrize("extra, param", REFUSED, ids=[p for _, p in REFUSED])
async def test_generate_refuses_a_field_it_does_not_take_by_name(http, extra, param):
    response = await http.post("/generate", json={**TEXT, **extra})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"].startswith(f"{param}: ")
    assert (await http.post("/generate", json=TEXT)).status_code == 200  # still serving


async def test_generate_takes_the_documented_fields_at_their_defaults(http):
    """What SGLang clients and the gateway send with every request, at SGLang's defaults:
    answered as if left out."""
    plain = (await http.post("/generate", json=TEXT)).json()
    defaults = {
        "log_metrics": False, "logprob_start_len": -1, "return_text_in_logprobs": False,
        "return_hidden_states": False, "lora_path": None, "session_params": None,
        "custom_logit_processor": None, "data_parallel_rank": None, "image_data": None,
        "bootstrap_host": None, "bootstrap_port": None, "bootstrap_room": None,
        "sampling_params": {**TEXT["sampling_params"], "spaces_between_special_tokens": True,
                            "stop_regex": None, "custom_params": None},
    }  # fmt: skip
    response = await http.post("/generate", json={**TEXT, **defaults})
    assert response.status_code == 200, response.text
    assert response.json()["output_ids"] == plain["output_ids"]


async def test_generate_logit_bias_and_its_key_errors(http, http_server):
    the = Tokenizer(http_server.checkpoint).encode(" the")[-1]
    params = {**TEXT["sampling_params"], "max_new_tokens": 4, "logit_bias": {str(the): 100}}
    forced = (await http.post("/generate", json={**TEXT, "sampling_params": params})).json()
    assert forced["output_ids"] == [the] * 4
    bad = {**params, "logit_bias": {"the": 5}}
    response = await http.post("/generate", json={**TEXT, "sampling_params": bad})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "sampling_params.logit_bias"
