"""Tool-call and reasoning parsers on replies as models write them: whole and streamed in
every split (a delta boundary inside a marker must not leak the marker as content)."""

from __future__ import annotations

import json

import pytest

from tokenspeed_aio.tokenization.parsers import (
    REASONING_PARSERS,
    TOOL_PARSERS,
    JsonArrayParser,
    ToolCallStream,
)

CASES = {
    "hermes": (
        'Checking.<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n'
        '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>',
        "Checking.",
    ),
    "llama3_json": (
        '<|python_tag|>{"name": "f", "parameters": {"x": 1}}; {"name": "g", "parameters": {}}',
        None,
    ),
    "mistral": (
        'Sure [TOOL_CALLS][{"name": "f", "arguments": {"x": 1}}, {"name": "g", "arguments": {}}]',
        "Sure",
    ),
    "pythonic": ("[f(x=1), g()]", None),
}
CALLS = [("f", {"x": 1}), ("g", {})]


def calls_of(calls):
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("name", CASES)
def test_whole_replies(name):
    text, content = CASES[name]
    found = TOOL_PARSERS[name]().extract(text)
    assert calls_of(found.calls) == CALLS and found.content == content
    assert all(c.id for c in found.calls)


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
def test_streamed_replies_in_any_split(name, step):
    text, content = CASES[name]
    stream = ToolCallStream(TOOL_PARSERS[name]())
    sent, calls = "", []
    for i in range(0, len(text), step):
        piece, new = stream.feed(text[i : i + step])
        sent, calls = sent + piece, calls + new
    piece, new = stream.finish()
    sent, calls = sent + piece, calls + new
    assert calls_of(calls) == CALLS
    assert sent.strip() == (content or "")


@pytest.mark.parametrize("name", CASES)
def test_text_without_calls_is_content(name):
    for text in ("Just words.", "[not a call", '{"no": "name"}'):
        assert TOOL_PARSERS[name]().extract(text).calls == []
        stream = ToolCallStream(TOOL_PARSERS[name]())
        sent = "".join(stream.feed(c)[0] for c in text) + stream.finish()[0]
        assert sent == text


def test_a_hermes_call_cut_off_by_the_length_limit_is_dropped():
    text = CASES["hermes"][0][:-30]
    assert calls_of(TOOL_PARSERS["hermes"]().extract(text).calls) == CALLS[:1]


def test_mistral_ids_are_nine_characters_and_v11_calls_parse():
    found = TOOL_PARSERS["mistral"]().extract('[TOOL_CALLS]f[ARGS]{"x": 1}')
    assert calls_of(found.calls) == CALLS[:1] and len(found.calls[0].id) == 9


def test_json_array_for_servers_without_a_parser():
    found = JsonArrayParser().extract('[{"name": "f", "parameters": {"x": 1}}]')
    assert calls_of(found.calls) == CALLS[:1]


@pytest.mark.parametrize(
    "parser, prompt, text, expected",
    [
        ("qwen3", "", "<think>plan</think>\n\nanswer", ("plan", "answer")),
        ("qwen3", "", "plain answer", (None, "plain answer")),
        ("qwen3", "<think>\n", "plan</think>answer", ("plan", "answer")),  # template opened it
        ("qwen3", "<think>\n\n</think>\n\n", "answer", (None, "answer")),  # thinking off
        ("deepseek_r1", "", "plan</think>answer", ("plan", "answer")),
        ("deepseek_r1", "", "<think>plan</think>answer", ("plan", "answer")),
        ("deepseek_r1", "", "still thinking", ("still thinking", None)),
    ],
)
@pytest.mark.parametrize("step", [1, 4, 1000])
def test_reasoning_split_whole_and_streamed(parser, prompt, text, expected, step):
    p = REASONING_PARSERS[parser]()
    assert p.split(prompt, text) == expected
    stream, reasoning, content = p.stream(prompt), "", ""
    for i in range(0, len(text), step):
        r, c = stream.feed(text[i : i + step])
        reasoning, content = reasoning + r, content + c
    r, c = stream.finish()
    assert ((reasoning + r) or None, (content + c) or None) == expected


def test_a_constrained_reply_starts_outside_the_think_block():
    p = REASONING_PARSERS["deepseek_r1"]()
    assert p.split("", '{"a": 1}', constrained=True) == (None, '{"a": 1}')
