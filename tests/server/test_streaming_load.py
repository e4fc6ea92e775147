"""Many concurrent streams, and clients that leave: a disconnect must abort the engine
request and free its KV blocks (read back from /metrics)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from openai import AsyncOpenAI
from server.conftest import scrape, wait_idle


async def test_64_concurrent_streams_complete(http_server):
    oai = AsyncOpenAI(
        base_url=f"{http_server.base_url}/v1", api_key=http_server.api_key, max_retries=0
    )

    async def one(i: int):
        max_tokens = 8 + i % 17
        stream = await oai.completions.create(
            model=http_server.model, prompt=f"Request number {i}:", max_tokens=max_tokens,
            logprobs=0, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": i % 2 == 0},
        )  # fmt: skip
        tokens, reason, usage = 0, None, None
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                tokens += len(choice.logprobs.tokens) if choice.logprobs else 0
                reason = choice.finish_reason or reason
        return i, max_tokens, tokens, reason, usage

    results = await asyncio.gather(*(one(i) for i in range(64)))
    for i, max_tokens, tokens, reason, usage in results:
        assert usage.completion_tokens == tokens, i
        if i % 2 == 0:  # ignore_eos: always runs to the limit
            assert (reason, tokens) == ("length", max_tokens), i
        else:
            # EOS ends with "stop", also when it is the last token max_tokens allowed.
            assert reason == "stop" or (reason, tokens) == ("length", max_tokens), i
            assert tokens <= max_tokens, i
    await wait_idle(http_server.base_url)


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions", "/generate"])
async def test_stream_disconnect_after_3_chunks_frees_the_engine(http_server, route):
    body = {
        "/v1/completions": {"prompt": "Once upon a time", "max_tokens": 900},
        "/v1/chat/completions": {
            "messages": [{"role": "user", "content": "Tell me a story"}],
            "max_tokens": 900,
        },
        "/generate": {"text": "Once upon a time", "sampling_params": {"max_new_tokens": 900}},
    }[route]
    body["stream"] = True
    # /generate takes ignore_eos in its sampling_params (a top-level one is refused)
    (body["sampling_params"] if route == "/generate" else body)["ignore_eos"] = True
    before = await scrape(http_server.base_url)
    async with (
        httpx.AsyncClient(headers=http_server.headers, timeout=30) as client,
        client.stream("POST", http_server.base_url + route, json=body) as response,
    ):
        assert response.status_code == 200
        chunks = 0
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                chunks += 1
                if chunks == 3:
                    break
    # the connection is closed here: the client went away mid-stream
    after = await wait_idle(http_server.base_url)
    aborted = 'tokenspeed:request_success_total{finished_reason="abort"}'
    assert after.get(aborted, 0) == before.get(aborted, 0) + 1
    generated = "tokenspeed:generation_tokens_total"
    assert after[generated] - before[generated] < 900  # it did not run to the end


async def test_non_streaming_client_timeout_aborts_the_request(http_server):
    body = {"prompt": "Long story:", "max_tokens": 900, "ignore_eos": True}
    before = await scrape(http_server.base_url)
    async with httpx.AsyncClient(headers=http_server.headers, timeout=0.3) as client:
        with pytest.raises(httpx.ReadTimeout):
            await client.post(f"{http_server.base_url}/v1/completions", json=body)
    after = await wait_idle(http_server.base_url)
    generated = "tokenspeed:generation_tokens_total"
    assert after[generated] - before[generated] < 900


async def test_mid_stream_json_is_valid_sse(http_server):
    body = {"prompt": "x", "max_tokens": 3, "n": 2, "stream": True}
    async with httpx.AsyncClient(headers=http_server.headers) as client:
        response = await client.post(f"{http_server.base_url}/v1/completions", json=body)
    assert response.headers["content-type"].startswith("text/event-stream")
    events = [e for e in response.text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert {p["choices"][0]["index"] for p in payloads} == {0, 1}
    assert sum(p["choices"][0]["finish_reason"] is not None for p in payloads) == 2
