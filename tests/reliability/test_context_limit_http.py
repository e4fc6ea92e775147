"""Prompts at the context limit: prompt + max_tokens == limit is served (the last
token lands exactly at the limit, through chunked prefill), one more is a 400 naming
both numbers, on every route, streamed or not; with no max_tokens a request
generates exactly up to the limit."""

from __future__ import annotations

import json

import pytest

from reliability.harness import GREEDY, run_server

LIMIT = 64


@pytest.fixture(scope="module")
def server(reliability_checkpoint, tmp_path_factory):
    with run_server(
        reliability_checkpoint,
        tmp_path_factory.mktemp("logs"),
        max_model_len=LIMIT,
        chunked_prefill_size=16,  # a prompt at the limit is prefilled in 4 chunks
    ) as s:
        yield s


def ids(n: int) -> list[int]:
    return [5 + (i * 37) % 500 for i in range(n)]


async def completion(c, prompt_len: int, max_tokens: int | None, stream: bool = False):
    body = {"prompt": ids(prompt_len), "max_tokens": max_tokens, "stream": stream, **GREEDY}
    return await c.post("/v1/completions", json=body)


@pytest.mark.parametrize("prompt_len", [1, LIMIT // 2, LIMIT - 1])
async def test_prompt_plus_max_tokens_equal_to_the_limit_is_served(server, prompt_len):
    async with server.client() as c:
        r = await completion(c, prompt_len, LIMIT - prompt_len)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["usage"]["completion_tokens"] == LIMIT - prompt_len
    assert out["usage"]["total_tokens"] == LIMIT
    assert out["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("prompt_len, max_tokens", [(LIMIT - 10, 11), (LIMIT - 1, 2), (LIMIT, 1),
                                                    (LIMIT + 1, 1), (1, LIMIT)])  # fmt: skip
async def test_one_token_over_the_limit_is_a_400_naming_both_numbers(
    server, prompt_len, max_tokens, stream
):
    async with server.client() as c:
        r = await completion(c, prompt_len, max_tokens, stream)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert f"maximum context length is {LIMIT}" in message, message
    assert f"{prompt_len + max_tokens} were requested" in message, message
    assert f"{prompt_len} in the prompt, {max_tokens} to generate" in message, message


async def test_generate_and_chat_over_the_limit_are_400s(server):
    async with server.client() as c:
        gen = await c.post("/generate", json={
            "input_ids": ids(LIMIT - 3), "sampling_params": {"max_new_tokens": 4}})  # fmt: skip
        chat = await c.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "x " * 200}], "max_tokens": 1})  # fmt: skip
    assert gen.status_code == 400 and f"{LIMIT + 1} were requested" in gen.text, gen.text
    assert chat.status_code == 400 and f"maximum context length is {LIMIT}" in chat.text


async def test_without_max_tokens_generation_stops_exactly_at_the_limit(server):
    async with server.client() as c:
        gen = await c.post("/generate", json={
            "input_ids": ids(LIMIT - 5), "sampling_params": {"max_new_tokens": None, **GREEDY}})  # fmt: skip
        prompt = [{"role": "user", "content": "Count to ten"}]
        chat = await c.post("/v1/chat/completions", json={"messages": prompt, **GREEDY})
        streamed = []
        async with c.stream("POST", "/v1/chat/completions",
                            json={"messages": prompt, "stream": True, **GREEDY,
                                  "stream_options": {"include_usage": True}}) as r:  # fmt: skip
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    streamed.append(json.loads(line[6:]))
    assert gen.status_code == 200, gen.text
    meta = gen.json()["meta_info"]
    assert meta["completion_tokens"] == 5 and meta["finish_reason"]["type"] == "length"
    usage = chat.json()["usage"]
    assert usage["total_tokens"] == LIMIT, usage
    assert chat.json()["choices"][0]["finish_reason"] == "length"
    assert streamed[-1]["usage"]["total_tokens"] == LIMIT


def finished_total(metrics: dict[str, float]) -> float:
    return sum(v for k, v in metrics.items() if k.startswith("tokenspeed:request_success_total"))


async def test_a_batch_with_one_prompt_over_the_limit_runs_nothing(server):
    before = finished_total(await server.wait_idle())
    async with server.client() as c:
        r = await c.post("/v1/completions", json={
            "prompt": [ids(4), ids(LIMIT)], "max_tokens": 1, **GREEDY})  # fmt: skip
    assert r.status_code == 400 and f"{LIMIT + 1} were requested" in r.text
    assert finished_total(await server.wait_idle()) == before  # not even the short prompt ran
