"""POST /v1/chat/completions through the official openai client."""

from __future__ import annotations

import asyncio

import pytest
from openai import AsyncOpenAI, OpenAI

from tokenspeed_aio.tokenization.tokenizer import Tokenizer

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a colour."},
]


@pytest.fixture
def oai(http_server) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"{http_server.base_url}/v1", api_key=http_server.api_key)


def chat_prompt_len(http_server, messages) -> int:
    tokenizer = Tokenizer(http_server.checkpoint)
    text = tokenizer.render_chat(messages, add_generation_prompt=True)
    return len(tokenizer.encode(text, add_special_tokens=False))


async def test_chat_completion_with_n_and_usage(oai, http_server):
    out = await oai.chat.completions.create(
        model=http_server.model, messages=MESSAGES, n=2, max_tokens=6, seed=3
    )
    assert out.id.startswith("chatcmpl-") and out.object == "chat.completion"
    assert [c.index for c in out.choices] == [0, 1]
    assert all(c.message.role == "assistant" for c in out.choices)
    assert all(c.finish_reason in ("stop", "length") for c in out.choices)
    assert out.usage.prompt_tokens == chat_prompt_len(http_server, MESSAGES)
    assert 2 <= out.usage.completion_tokens <= 12


async def test_max_completion_tokens_and_length(oai, http_server):
    out = await oai.chat.completions.create(
        model=http_server.model, messages=MESSAGES, max_completion_tokens=5, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 5


async def test_chat_logprobs_format(oai, http_server):
    out = await oai.chat.completions.create(
        model=http_server.model, messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True,
        top_logprobs=3, extra_body={"ignore_eos": True},
    )  # fmt: skip
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens == 6
    for entry in content:
        assert entry.logprob <= 0
        assert entry.bytes == list(entry.token.encode())
        assert 1 <= len(entry.top_logprobs) <= 3
        # greedy: the chosen token is the likeliest
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-5)


async def test_streaming_chat_equals_non_streaming(oai, http_server):
    kw = dict(model=http_server.model, messages=MESSAGES, max_tokens=10, temperature=0)
    full = await oai.chat.completions.create(**kw)
    stream = await oai.chat.completions.create(
        **kw, stream=True, stream_options={"include_usage": True}
    )
    chunks = [chunk async for chunk in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.id == chunks[0].id and c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finals[-1] == full.choices[0].finish_reason and not any(finals[:-1])
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


async def test_cached_prompt_tokens_are_reported(oai, http_server):
    # a long shared system prompt: the second request finds its full blocks cached
    messages = [{"role": "system", "content": "Be brief. " * 40}, MESSAGES[1]]
    kw = dict(model=http_server.model, messages=messages, max_tokens=2)
    await oai.chat.completions.create(**kw)
    again = await oai.chat.completions.create(**kw)
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached <= again.usage.prompt_tokens


async def test_sync_openai_chat_stream_in_a_thread(http_server):
    def call() -> str:
        with OpenAI(base_url=f"{http_server.base_url}/v1", api_key=http_server.api_key) as c:
            stream = c.chat.completions.create(
                model=http_server.model, messages=MESSAGES, max_tokens=4, stream=True
            )
            return "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)

    assert isinstance(await asyncio.to_thread(call), str)
