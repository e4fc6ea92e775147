"""Tool calling through the official ``openai`` client: tools rendered by the chat
template, tool_choice auto / none / required / named, streamed and not, one server per
tool-call parser (hermes, llama3_json, mistral, pythonic) and one with none.

A tiny random model cannot write a tool call by itself, so the replies that must be calls
are constrained: ``required`` and named choices by the server's own xgrammar constraint
(the feature under test), ``auto`` by a guided_regex spelling a call in the parser's
format (the parser must find it in otherwise free text). The tool's parameters are
enums, so a constrained reply always ends well within max_tokens.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from helpers.apps import serve_apps
from helpers.instruct import make_instruct_checkpoint

from tokenspeed_aio.server.options import ServerOptions

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Tokyo"]},
        "unit": {"type": "string", "enum": ["C", "F"]},
    },
    "required": ["city", "unit"],
}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
PARSERS = ("hermes", "llama3_json", "mistral", "pythonic")
# A call each parser must find in free text (tool_choice auto), as a regex the model is held
# to, and the arguments it spells.
AUTO_CALLS = {
    "hermes": r'Let me check\.<tool_call>\n\{"name": "get_time", "arguments": \{"zone": "UTC"\}\}\n</tool_call>',
    "llama3_json": r'\{"name": "get_time", "parameters": \{"zone": "UTC"\}\}',
    "mistral": r'\[TOOL_CALLS\]\[\{"name": "get_time", "arguments": \{"zone": "UTC"\}\}\]',
    "pythonic": r'\[get_time\(zone="UTC"\)\]',
}


@pytest.fixture(scope="module")
def apps(tmp_path_factory):
    model = make_instruct_checkpoint(tmp_path_factory.mktemp("tools") / "instruct")
    options = {name: ServerOptions(tool_call_parser=name, enable_auto_tool_choice=True,
                                   access_log=False) for name in PARSERS}  # fmt: skip
    options["none"] = ServerOptions(access_log=False)
    with serve_apps(model, options) as urls:
        yield urls


def client(apps, name: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=apps[name] + "/v1", api_key="none", max_retries=0)


def check_calls(calls, names=("get_weather", "get_time")) -> None:
    assert calls, "no tool calls"
    for call in calls:
        assert call.type == "function" and call.id
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


async def streamed(stream) -> tuple[str, list, str]:
    """(content, calls, finish_reason) of a streamed chat reply, assembled as clients do."""
    content, calls, reason = "", {}, None
    async for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = delta.id or call["id"]
                call["name"] += delta.function.name or ""
                call["arguments"] += delta.function.arguments or ""
            reason = choice.finish_reason or reason
    calls_list = [
        openai.types.chat.ChatCompletionMessageToolCall(
            id=c["id"], type="function", function={"name": c["name"], "arguments": c["arguments"]}
        )
        for _, c in sorted(calls.items())
    ]
    return content, calls_list, reason


# Every parser streamed and not, for one choice each (required: non-streamed and streamed
# alternate across the parsers; named: the other way), to keep the run short.
REQUIRED = [("hermes", False), ("hermes", True), ("llama3_json", True), ("mistral", False),
            ("pythonic", True), ("none", False), ("none", True)]  # fmt: skip
NAMED = [("hermes", True), ("llama3_json", False), ("mistral", True), ("pythonic", False),
         ("none", False), ("none", True)]  # fmt: skip


@pytest.mark.parametrize("parser, stream", REQUIRED)
async def test_required_choice_returns_calls_that_parse_against_their_schema(apps, parser, stream):
    async with client(apps, parser) as oai:
        kw = dict(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                  max_tokens=120, temperature=0, parallel_tool_calls=False)  # fmt: skip
        if stream:
            _, calls, reason = await streamed(await oai.chat.completions.create(**kw, stream=True))
        else:
            out = await oai.chat.completions.create(**kw)
            calls, reason = out.choices[0].message.tool_calls, out.choices[0].finish_reason
    check_calls(calls)
    assert reason == "tool_calls"


@pytest.mark.parametrize("parser", ["hermes"])  # tolerant of a call cut off by max_tokens
async def test_parallel_calls_are_each_well_formed(apps, parser):
    """With parallel calls the model may write several (a weak model writes until
    max_tokens): every complete one is returned, a call cut off by the limit is not."""
    async with client(apps, parser) as oai:
        out = await oai.chat.completions.create(
            model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=100,
            temperature=0.8, seed=1,
        )  # fmt: skip
    check_calls(out.choices[0].message.tool_calls)


@pytest.mark.parametrize("parser, stream", NAMED)
async def test_a_named_choice_calls_exactly_that_function(apps, parser, stream):
    async with client(apps, parser) as oai:
        kw = dict(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=120, temperature=0.9,
                  seed=5, tool_choice={"type": "function", "function": {"name": "get_weather"}})  # fmt: skip
        if stream:
            _, calls, _ = await streamed(await oai.chat.completions.create(**kw, stream=True))
        else:
            calls = (await oai.chat.completions.create(**kw)).choices[0].message.tool_calls
    check_calls(calls, names=("get_weather",))
    assert len(calls) == 1


@pytest.mark.parametrize(
    "parser, stream",
    [("hermes", False), ("hermes", True), ("llama3_json", False), ("mistral", True),
     ("pythonic", False), ("pythonic", True)],
)  # fmt: skip
async def test_auto_choice_finds_the_call_the_model_wrote(apps, parser, stream):
    async with client(apps, parser) as oai:
        kw = dict(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="auto",
                  max_tokens=80, extra_body={"guided_regex": AUTO_CALLS[parser]})  # fmt: skip
        if stream:
            content, calls, reason = await streamed(
                await oai.chat.completions.create(**kw, stream=True)
            )
        else:
            out = await oai.chat.completions.create(**kw)
            message, reason = out.choices[0].message, out.choices[0].finish_reason
            content, calls = message.content or "", message.tool_calls
    check_calls(calls, names=("get_time",))
    assert [json.loads(c.function.arguments) for c in calls] == [{"zone": "UTC"}]
    assert content == ("Let me check." if parser == "hermes" else "")
    assert reason == "tool_calls"


async def test_auto_choice_with_plain_text_is_content(apps):
    async with client(apps, "hermes") as oai:
        kw = dict(model="tiny", messages=MESSAGES, max_tokens=12, temperature=0)
        plain = await oai.chat.completions.create(**kw)
        auto = await oai.chat.completions.create(**kw, tools=TOOLS)  # auto is the default
        none = await oai.chat.completions.create(**kw, tools=TOOLS, tool_choice="none")
    assert auto.choices[0].message.tool_calls in (None, [])
    assert auto.choices[0].message.content == none.choices[0].message.content
    assert plain.choices[0].message.content  # without tools the prompt differs; text flows


async def test_auto_choice_needs_the_server_flags(apps):
    async with client(apps, "none") as oai:
        with pytest.raises(openai.BadRequestError, match="enable-auto-tool-choice"):
            await oai.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS)


@pytest.mark.parametrize(
    "tool_choice, match",
    [({"type": "function", "function": {"name": "nope"}}, "not in tools"), ("required", None)],
)
async def test_bad_tool_choices_are_400(apps, tool_choice, match):
    async with client(apps, "hermes") as oai:
        if match is None:  # required without tools
            with pytest.raises(openai.BadRequestError, match="needs tools"):
                await oai.chat.completions.create(
                    model="tiny", messages=MESSAGES, tool_choice="required"
                )
            return
        with pytest.raises(openai.BadRequestError, match=match):
            await oai.chat.completions.create(
                model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice
            )


async def test_tool_messages_and_calls_render_through_the_chat_template(apps):
    """An assistant turn's tool_calls (arguments sent as JSON text) and the tool's result
    render as the template writes them, arguments as an object."""
    messages = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"},
    ]  # fmt: skip
    async with httpx.AsyncClient(base_url=apps["hermes"]) as http:
        ids = (await http.post("/tokenize", json={"messages": messages, "tools": TOOLS})).json()
        text = (await http.post("/detokenize", json={"tokens": ids["tokens"]})).json()["prompt"]
    assert '"name": "get_weather"' in text and '{"type": "function", "function"' in text
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}'
    assert call in text
    assert "<tool_response>\n18 degrees\n</tool_response>" in text
    async with client(apps, "hermes") as oai:  # the same conversation generates
        out = await oai.chat.completions.create(
            model="tiny", messages=messages, tools=TOOLS, tool_choice="none", max_tokens=4
        )
    assert out.usage.prompt_tokens == ids["count"]
