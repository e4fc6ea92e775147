"""AsyncClient against a real server: typed results, streams, errors, abort."""

from __future__ import annotations

import asyncio

import pytest

from tokenspeed_aio.client import (
    APIStatusError,
    AsyncClient,
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    GenerateResult,
)

MESSAGES = [{"role": "user", "content": "Say something."}]


@pytest.fixture
async def client(http_server):
    async with AsyncClient(http_server.base_url, api_key=http_server.api_key) as c:
        yield c


async def test_completions_and_chat_are_typed(client, http_server):
    out = await client.completions("Hello", max_tokens=4, temperature=0, ignore_eos=True)
    assert isinstance(out, Completion)
    assert out.model == http_server.model and out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 4
    chat = await client.chat(MESSAGES, max_tokens=3, n=2, model=http_server.model)
    assert isinstance(chat, ChatCompletion) and len(chat.choices) == 2
    assert chat.choices[0].message.role == "assistant"


async def test_streams_are_typed_and_equal_the_full_answer(client):
    full = await client.chat(MESSAGES, max_tokens=8, temperature=0)
    stream = await client.chat(
        MESSAGES, max_tokens=8, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    chunks = [chunk async for chunk in stream]
    assert all(isinstance(c, ChatCompletionChunk) for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


async def test_generate_single_batch_and_stream(client):
    one = await client.generate("Hi", sampling_params={"max_new_tokens": 3, "ignore_eos": True})
    assert isinstance(one, GenerateResult) and len(one.output_ids) == 3
    assert one.meta_info.finish_reason.type == "length"
    batch = await client.generate(
        input_ids=[[5, 6], [7, 8, 9]], sampling_params={"max_new_tokens": 2}
    )
    assert isinstance(batch, list) and [r.index for r in batch] == [0, 1]
    stream = await client.generate("Hi", sampling_params={"max_new_tokens": 3}, stream=True)
    results = [r async for r in stream]
    assert results[-1].meta_info.finish_reason is not None


async def test_models_and_health(client, http_server):
    models = await client.models()
    assert [m.id for m in models.data] == [http_server.model]
    health = await client.health()
    assert health.ok and health.status == 200


async def test_http_errors_carry_status_and_message(client):
    with pytest.raises(APIStatusError) as err:
        await client.completions("x", max_tokens=-3)
    assert err.value.status == 400 and err.value.param == "max_tokens"
    assert "max_tokens" in err.value.message
    with pytest.raises(APIStatusError) as err:
        await client.chat(MESSAGES, model="other-model")
    assert err.value.status == 404 and err.value.code == "model_not_found"
    with pytest.raises(APIStatusError) as err:  # a streamed request fails before its stream
        await client.completions("x", temperature=-1, stream=True)
    assert err.value.status == 400
    with pytest.raises(TypeError):
        await client.completions("x", max_tokns=3)  # a misspelt field never leaves


async def test_wrong_api_key_is_401(http_server):
    async with AsyncClient(http_server.base_url, api_key="wrong") as c:
        with pytest.raises(APIStatusError) as err:
            await c.models()
    assert err.value.status == 401


async def test_closing_a_stream_early_and_abort(client, http_server):
    from server.conftest import wait_idle

    async with await client.completions(
        "Tell", max_tokens=900, ignore_eos=True, stream=True
    ) as stream:
        async for _chunk in stream:
            break
    await wait_idle(http_server.base_url)
    # abort() ends a running request with finish_reason abort
    running = asyncio.create_task(
        client.generate(
            "Go", rid="client-abort", sampling_params={"max_new_tokens": 900, "ignore_eos": True}
        )
    )
    while not await client.abort("client-abort"):
        await asyncio.sleep(0.01)
    result = await running
    assert result.meta_info.finish_reason.type == "abort"
