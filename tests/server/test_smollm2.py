"""Real text on a real instruct checkpoint: SmolLM2-135M-Instruct (tokenspeed_aio.bench.smollm2,
converted once per test run) served in fp32, against transformers in fp32 on the same
checkpoint -- its chat template, greedy chat through the official ``openai`` client, a
constrained tool call and its round trip, and the qwen3 reasoning split."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest
from helpers.apps import serve_apps
from helpers.reference import hf_greedy

from tokenspeed_aio.bench import smollm2
from tokenspeed_aio.server.options import ServerOptions

pytestmark = pytest.mark.skipif(smollm2.missing() is not None, reason=str(smollm2.missing()))

MODEL = "smollm2"
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You answer in one short sentence."},
        {"role": "user", "content": "Name a primary color."},
        {"role": "assistant", "content": "Red is a primary color."},
        {"role": "user", "content": "Name another one."},
    ],
]
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather.",
            "parameters": WEATHER,
        },
    }
]
# A reply forced into a think block, then an answer (greedy text inside both).
THINK = r"<think>\n[a-z ]{4,40}\n</think>\n\n[A-Z][a-z ]{4,40}\."


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    return smollm2.checkpoint(tmp_path_factory.mktemp("smollm2"))


@pytest.fixture(scope="module")
def apps(checkpoint):
    quiet = dict(access_log=False)
    options = {
        "plain": (ServerOptions(**quiet), [MODEL]),
        "qwen3": (ServerOptions(reasoning_parser="qwen3", **quiet), [MODEL]),
    }
    with serve_apps(checkpoint, options, dtype="float32") as urls:
        yield urls


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(checkpoint)


def oai(apps, name="plain") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=apps[name] + "/v1", api_key="none", max_retries=0)


async def rendered(apps, messages: list[dict], **kw) -> list[int]:
    """The server's prompt token ids for a chat (POST /tokenize with messages)."""
    async with httpx.AsyncClient(base_url=apps["plain"], timeout=30) as http:
        body = {"model": MODEL, "messages": messages, "add_generation_prompt": True, **kw}
        response = await http.post("/tokenize", json=body)
    assert response.status_code == 200, response.text
    return response.json()["tokens"]


def hf_rendered(tokenizer, messages: list[dict]) -> list[int]:
    return tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )


@pytest.mark.parametrize("messages", CONVERSATIONS, ids=["one-turn", "multi-turn"])
async def test_the_chat_prompt_is_the_checkpoints_template(apps, tokenizer, messages):
    want = hf_rendered(tokenizer, messages)
    assert await rendered(apps, messages) == want
    async with oai(apps) as client:
        out = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    assert out.usage.prompt_tokens == len(want)


@pytest.mark.parametrize("messages", CONVERSATIONS, ids=["one-turn", "multi-turn"])
async def test_greedy_chat_equals_transformers(apps, checkpoint, tokenizer, messages):
    """Token for token, up to and including the end of the turn, and the logprobs."""
    max_tokens = 40
    async with oai(apps) as client:
        out = await client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0, logprobs=True
        )
    hf_tokens, hf_logprobs = hf_greedy(
        str(checkpoint), tuple(hf_rendered(tokenizer, messages)), max_tokens
    )
    eos = tokenizer.eos_token_id
    end = hf_tokens.index(eos) + 1 if eos in hf_tokens else max_tokens
    want = hf_tokens[:end]
    choice = out.choices[0]
    assert choice.finish_reason == ("stop" if eos in want else "length")
    assert out.usage.completion_tokens == len(want)
    assert choice.message.content == tokenizer.decode(want, skip_special_tokens=True)
    got = choice.logprobs.content
    text_tokens = [t for t in want if t != eos]
    assert len(got) in (len(text_tokens), len(want))  # the end-of-turn token's, or not
    assert [lp.token for lp in got][: len(text_tokens)] == [
        tokenizer.decode([t]) for t in text_tokens
    ]
    assert [lp.logprob for lp in got] == pytest.approx(hf_logprobs[: len(got)], abs=1e-3)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
    ids=["required", "named"],
)  # fmt: skip
async def test_a_constrained_tool_call_validates_and_its_result_renders(
    apps, tokenizer, choice, stream
):
    """One call (parallel_tool_calls false: the grammar closes the list after it), greedy."""
    messages = [{"role": "user", "content": "What is the weather like in Paris right now?"}]
    kw = dict(
        model=MODEL, messages=messages, tools=TOOLS, tool_choice=choice, max_tokens=64,
        temperature=0, parallel_tool_calls=False,
    )  # fmt: skip
    async with oai(apps) as client:
        if stream:
            calls: dict[int, dict] = {}
            async for chunk in await client.chat.completions.create(**kw, stream=True):
                for call in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
                    entry = calls.setdefault(call.index, {"id": "", "name": "", "arguments": ""})
                    entry["id"] += call.id or ""
                    entry["name"] += call.function.name or ""
                    entry["arguments"] += call.function.arguments or ""
            got = [calls[i] for i in sorted(calls)]
        else:
            message = (await client.chat.completions.create(**kw)).choices[0].message
            got = [
                {"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                for c in message.tool_calls
            ]
    assert len(got) == 1 and got[0]["name"] == "get_weather" and got[0]["id"]
    call = got[0]
    jsonschema.validate(json.loads(call["arguments"]), WEATHER)
    # The round trip: the call, then its result as a tool message, through the template.
    history = messages + [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": call["id"],
                    "type": "function",
                    "function": {"name": call["name"], "arguments": call["arguments"]},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call["id"], "content": '{"temperature": 21}'},
    ]
    server = await rendered(apps, history, tools=TOOLS)
    # The server hands the template the arguments as an object, as templates expect.
    hf_history = json.loads(json.dumps(history))
    hf_history[1]["tool_calls"][0]["function"]["arguments"] = json.loads(call["arguments"])
    assert server == tokenizer.apply_chat_template(
        hf_history, tools=TOOLS, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert '<|im_start|>tool\n{"temperature": 21}<|im_end|>' in tokenizer.decode(server)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_qwen3_reasoning_splits_a_real_think_block(apps, stream):
    kw = dict(
        model=MODEL, messages=CONVERSATIONS[0], max_tokens=80, temperature=0,
        extra_body={"guided_regex": THINK},
    )  # fmt: skip
    async with oai(apps, "plain") as client:
        raw = (await client.chat.completions.create(**kw)).choices[0].message.content
    match = re.fullmatch(r"<think>(.*)</think>\n\n(.*)", raw, re.DOTALL)
    assert match is not None, raw
    async with oai(apps, "qwen3") as client:
        if stream:
            reasoning = content = ""
            async for chunk in await client.chat.completions.create(**kw, stream=True):
                for choice in chunk.choices:
                    reasoning += getattr(choice.delta, "reasoning_content", None) or ""
                    content += choice.delta.content or ""
        else:
            message = (await client.chat.completions.create(**kw)).choices[0].message
            reasoning, content = message.reasoning_content, message.content
    assert (reasoning, content) == (match[1], match[2])
