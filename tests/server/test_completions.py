"""POST /v1/completions through the official openai client and plain httpx."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from openai import AsyncOpenAI, OpenAI

from tokenspeed_aio.sampling_params import SamplingParams
from tokenspeed_aio.tokenization.tokenizer import Tokenizer

PROMPTS = ["The quick brown fox", "def main():", "Hello"]


@pytest.fixture
def oai(http_server) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"{http_server.base_url}/v1", api_key=http_server.api_key)


@pytest.fixture(scope="module")
def tokenizer(http_server) -> Tokenizer:
    return Tokenizer(http_server.checkpoint)


async def test_completion_usage_counts_tokens(oai, http_server, tokenizer):
    out = await oai.completions.create(
        model=http_server.model,
        prompt=PROMPTS[0],
        max_tokens=7,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert out.id.startswith("cmpl-") and out.object == "text_completion"
    assert out.model == http_server.model and out.created > 0
    [choice] = out.choices
    assert choice.finish_reason == "length"
    assert out.usage.prompt_tokens == len(tokenizer.encode(PROMPTS[0]))
    assert out.usage.completion_tokens == 7
    assert out.usage.total_tokens == out.usage.prompt_tokens + 7


async def test_greedy_outputs_equal_async_engine(oai, http_server, start_engine):
    engine = await start_engine()
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    expected = []
    for prompt in PROMPTS:
        outputs = [out async for out in engine.generate(prompt, params)]
        expected.append(outputs[-1])
    out = await oai.completions.create(
        model=http_server.model, prompt=PROMPTS, max_tokens=12, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert [c.text for c in out.choices] == [e.text for e in expected]
    async with httpx.AsyncClient(headers=http_server.headers) as client:
        res = await client.post(
            f"{http_server.base_url}/generate",
            json={"text": PROMPTS, "sampling_params": {"max_new_tokens": 12, "temperature": 0,
                                                        "ignore_eos": True}},
        )  # fmt: skip
    assert [r["output_ids"] for r in res.json()] == [e.token_ids for e in expected]


async def test_batch_prompts_times_n_choices(oai, http_server, tokenizer):
    out = await oai.completions.create(
        model=http_server.model, prompt=PROMPTS[:2], n=3, max_tokens=4, seed=7
    )
    assert [c.index for c in out.choices] == list(range(6))
    assert out.usage.prompt_tokens == sum(len(tokenizer.encode(p)) for p in PROMPTS[:2])
    assert out.usage.completion_tokens <= 6 * 4
    # a seeded request is reproducible, choice by choice
    again = await oai.completions.create(
        model=http_server.model, prompt=PROMPTS[:2], n=3, max_tokens=4, seed=7
    )
    assert [c.text for c in again.choices] == [c.text for c in out.choices]


async def test_token_id_prompts(oai, http_server, tokenizer):
    ids = [tokenizer.encode(p) for p in PROMPTS[:2]]
    single = await oai.completions.create(
        model=http_server.model, prompt=ids[0], max_tokens=5, temperature=0
    )
    batch = await oai.completions.create(
        model=http_server.model, prompt=ids, max_tokens=5, temperature=0
    )
    text = await oai.completions.create(
        model=http_server.model, prompt=PROMPTS[0], max_tokens=5, temperature=0
    )
    assert single.choices[0].text == batch.choices[0].text == text.choices[0].text
    assert batch.usage.prompt_tokens == len(ids[0]) + len(ids[1])


async def test_echo_with_logprobs(oai, http_server, tokenizer):
    prompt_ids = tokenizer.encode(PROMPTS[1])
    out = await oai.completions.create(
        model=http_server.model, prompt=PROMPTS[1], max_tokens=5, temperature=0, echo=True,
        logprobs=3, extra_body={"ignore_eos": True},
    )  # fmt: skip
    [choice] = out.choices
    assert choice.text.startswith(PROMPTS[1])
    lp = choice.logprobs
    assert len(lp.tokens) == len(prompt_ids) + 5 == len(lp.token_logprobs) == len(lp.text_offset)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing precedes it
    assert all(x <= 0 for x in lp.token_logprobs[1:])
    assert all(1 <= len(top) <= 3 for top in lp.top_logprobs[1:])
    assert lp.text_offset == sorted(lp.text_offset)
    assert lp.text_offset[len(prompt_ids)] == len(PROMPTS[1])


async def test_logprobs_match_between_stream_and_not(oai, http_server):
    kw = dict(model=http_server.model, prompt=PROMPTS[2], max_tokens=8, temperature=0, logprobs=2)
    full = await oai.completions.create(**kw, extra_body={"ignore_eos": True})
    stream = await oai.completions.create(
        **kw, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}
    )
    chunks = [chunk async for chunk in stream]
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens == 8
    text = "".join(c.choices[0].text for c in chunks[:-1])
    tokens = [t for c in chunks[:-1] if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert text == full.choices[0].text
    assert tokens == full.choices[0].logprobs.tokens
    assert chunks[-2].choices[0].finish_reason == "length"


async def test_stop_string_ends_with_stop(oai, http_server):
    kw = dict(model=http_server.model, prompt=PROMPTS[0], temperature=0)
    full = await oai.completions.create(**kw, max_tokens=16, extra_body={"ignore_eos": True})
    text = full.choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip(), f"need a visible stop string in {text!r}"
    out = await oai.completions.create(**kw, max_tokens=16, stop=[stop])
    [choice] = out.choices
    assert choice.finish_reason == "stop"
    assert choice.text == text[: text.index(stop)]
    assert choice.model_extra["stop_reason"] == stop


async def test_sync_openai_client_in_a_thread(http_server):
    def call() -> str:
        with OpenAI(base_url=f"{http_server.base_url}/v1", api_key=http_server.api_key) as c:
            out = c.completions.create(model=http_server.model, prompt="Hi", max_tokens=3)
            return out.choices[0].finish_reason

    assert await asyncio.to_thread(call) in ("stop", "length")


async def test_large_logprob_response_is_complete(oai, http_server):
    # 200 prompt tokens + 60 generated, 21 entries each: built off the event loop
    prompt = list(range(10, 210))
    out = await oai.completions.create(
        model=http_server.model, prompt=prompt, max_tokens=60, echo=True, logprobs=20,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 260
    assert all(1 <= len(top) <= 20 for top in lp.top_logprobs[1:])
