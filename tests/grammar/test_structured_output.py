"""Structured output with xgrammar on random-weight models (garbage without the mask):
every response validates; unconstrained neighbours are unaffected; compile errors and
slow compiles stay the constrained request's own business."""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import time

import jsonschema
import pytest
from helpers.prompts import parity_prompts
from helpers.schemas import SCHEMAS

from tokenspeed_aio.errors import InvalidRequestError
from tokenspeed_aio.sampling_params import SamplingParams


async def final(engine, params, ids=None, prompt="Reply:"):
    last = None
    kw = {"prompt_token_ids": ids} if ids is not None else {"prompt": prompt}
    async for out in engine.generate(sampling_params=params, **kw):
        last = out
    return last


@pytest.fixture
async def engine(ckpt, start_engine):
    return await start_engine(ckpt("llama"), max_model_len=1024)


async def test_json_schemas_validate(engine):
    outs = await asyncio.gather(
        *(
            final(
                engine, SamplingParams(max_tokens=256, temperature=0.0, json_schema=json.dumps(s))
            )
            for s in SCHEMAS
        )
    )
    for schema, out in zip(SCHEMAS, outs):
        assert out.finish_reason == "stop", (schema, out.text)
        jsonschema.validate(json.loads(out.text), schema)


async def test_sampled_json_schemas_validate(engine):
    schema = SCHEMAS[1]
    for seed in range(4):
        params = SamplingParams(
            max_tokens=256, temperature=1.0, seed=seed, json_schema=json.dumps(schema)
        )
        out = await final(engine, params)
        jsonschema.validate(json.loads(out.text), schema)


async def test_regex_and_ebnf(engine):
    pattern = r"[a-z]{3}-\d{2,4}"
    out = await final(engine, SamplingParams(max_tokens=64, temperature=0.0, regex=pattern))
    assert re.fullmatch(pattern, out.text), out.text
    grammar = 'root ::= "yes" | "no" | ("maybe " [0-9] [0-9]?)'
    out = await final(engine, SamplingParams(max_tokens=64, temperature=0.0, ebnf=grammar))
    assert re.fullmatch(r"yes|no|maybe \d\d?", out.text), out.text
    assert out.finish_reason == "stop"


async def test_json_object_is_an_object_or_ends_by_length(engine):
    out = await final(engine, SamplingParams(max_tokens=64, temperature=0.0, json_object=True))
    assert out.text.startswith("{")
    if out.finish_reason == "stop":
        assert isinstance(json.loads(out.text), dict)
    else:
        assert out.finish_reason == "length" and len(out.token_ids) == 64


@pytest.mark.parametrize("depth", [0, 1])
async def test_unconstrained_neighbours_are_unaffected(ckpt, start_engine, depth):
    engine = await start_engine(ckpt("llama"), in_flight_depth=depth)
    plain = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = parity_prompts(seed=8)[:4]
    alone = await asyncio.gather(*(final(engine, plain, ids) for ids in prompts))
    constrained = [
        final(engine, SamplingParams(max_tokens=64, temperature=0.0, json_schema=json.dumps(s)))
        for s in SCHEMAS[:4]
    ]
    mixed = await asyncio.gather(*(final(engine, plain, ids) for ids in prompts), *constrained)
    assert [o.token_ids for o in mixed[:4]] == [o.token_ids for o in alone]
    for schema, out in zip(SCHEMAS[:4], mixed[4:]):
        jsonschema.validate(json.loads(out.text), schema)


async def test_schema_that_does_not_compile_fails_that_request_only(engine):
    other = asyncio.create_task(
        final(engine, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    )
    with pytest.raises(InvalidRequestError, match=r"json_schema: .*JSON"):
        await final(engine, SamplingParams(max_tokens=8, json_schema="{not json"))
    with pytest.raises(InvalidRequestError, match='Rule "undefined_rule" is not defined'):
        await final(engine, SamplingParams(max_tokens=8, ebnf="root ::= undefined_rule"))
    assert len((await other).token_ids) == 20


async def test_slow_compile_does_not_stall_other_requests(engine):
    big = {
        "type": "object",
        "properties": {
            f"field_{i}": {"type": "string", "pattern": f"[a-z]{{{i % 5 + 1},{i % 5 + 8}}}"}
            for i in range(1000)
        },
    }
    # Warm the compiler (tokenizer load) so only the big schema's compile is measured.
    await final(engine, SamplingParams(max_tokens=4, temperature=0.0, regex="[a-z]+"))
    stamps: list[float] = []

    async def decode():
        params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
        async for _ in engine.generate(prompt_token_ids=[5, 6, 7], sampling_params=params):
            stamps.append(time.perf_counter())

    decoding = asyncio.create_task(decode())
    while len(stamps) < 5:
        await asyncio.sleep(0.01)
    start = time.perf_counter()
    compiled = await final(
        engine, SamplingParams(max_tokens=16, temperature=0.0, json_schema=json.dumps(big))
    )
    compile_wall = time.perf_counter() - start
    await decoding
    during = [b - a for a, b in itertools.pairwise(stamps) if start <= a <= start + compile_wall]
    assert compile_wall > 0.5, "the schema was meant to take a while to compile"
    assert during, "the decode was meant to run while the schema compiled"
    assert max(during) < 0.25, f"a round stalled for {max(during):.3f} s during the compile"
    assert compiled.text.startswith("{")


async def test_idle_engine_admits_a_compiled_grammar_promptly(engine):
    """An otherwise idle engine polls its compiling grammars, not only the heartbeat."""
    await final(engine, SamplingParams(max_tokens=2, temperature=0.0, regex="[a-z]+"))  # warm
    await asyncio.sleep(1.2)  # the engine is idle: its rounds wait for messages
    start = time.perf_counter()
    params = SamplingParams(max_tokens=2, temperature=0.0, regex="[0-9]{2}")  # a new grammar
    async for _ in engine.generate(prompt="n:", sampling_params=params):
        break
    assert time.perf_counter() - start < 0.5


async def test_grammar_compile_timeout_fails_the_request(ckpt, start_engine):
    engine = await start_engine(ckpt("llama"), grammar_compile_timeout_secs=0.05)
    big = {
        "type": "object",
        "properties": {f"f{i}": {"type": "string", "pattern": "[a-z]{1,9}"} for i in range(1500)},
    }
    with pytest.raises(InvalidRequestError, match=r"did not compile within 0\.05 s"):
        await final(engine, SamplingParams(max_tokens=8, json_schema=json.dumps(big)))
    out = await final(engine, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert len(out.token_ids) == 4
