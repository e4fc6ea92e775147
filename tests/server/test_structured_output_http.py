"""Structured output over HTTP with the official openai client."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import openai
import pytest
from openai import AsyncOpenAI

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "temp": {"type": "integer", "minimum": -40, "maximum": 50},
        "sky": {"type": "string", "enum": ["clear", "cloudy", "rain"]},
    },
    "required": ["city", "temp", "sky"],
}


@pytest.fixture
def oai(http_server) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"{http_server.base_url}/v1", api_key=http_server.api_key)


async def test_schema_table_through_the_openai_client(oai, http_server):
    from grammar.test_structured_output import SCHEMAS

    async def one(schema):
        out = await oai.completions.create(
            model=http_server.model,
            prompt="JSON:",
            max_tokens=256,
            temperature=0,
            extra_body={"json_schema": schema},
        )
        return out.choices[0].text

    texts = await asyncio.gather(*(one(s) for s in SCHEMAS))
    for schema, text in zip(SCHEMAS, texts):
        jsonschema.validate(json.loads(text), schema)


async def test_chat_response_format_json_schema(oai, http_server):
    out = await oai.chat.completions.create(
        model=http_server.model,
        messages=[{"role": "user", "content": "Weather?"}],
        max_tokens=128,
        temperature=0.8,
        seed=7,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "weather", "schema": SCHEMA, "strict": True},
        },
    )
    choice = out.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)


async def test_completions_streaming_with_regex_extra_field(oai, http_server):
    stream = await oai.completions.create(
        model=http_server.model,
        prompt="id:",
        max_tokens=32,
        temperature=0,
        stream=True,
        extra_body={"regex": r"[A-Z]{2}\d{3}"},
    )
    text = "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])
    assert re.fullmatch(r"[A-Z]{2}\d{3}", text), text


async def test_schema_that_does_not_compile_is_a_400(oai, http_server):
    with pytest.raises(openai.BadRequestError, match="json_schema"):
        await oai.chat.completions.create(
            model=http_server.model,
            messages=[{"role": "user", "content": "x"}],
            max_tokens=8,
            extra_body={"json_schema": '{"type": "object", "properties": {'},
        )
