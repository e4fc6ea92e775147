"""Every request parameter's edge values and malformed bodies, through HTTP, on all four
request routes: each is answered 4xx with an OpenAI error body whose message names
the problem, no traceback reaches the client or the server log, and the server keeps
serving (a good request after each case, and /health plus a greedy request at the end
that equals the one made before any bad input)."""

from __future__ import annotations

import json

import httpx
import pytest

from reliability.harness import GREEDY, run_server

COMP, CHAT, GEN, ABORT = "/v1/completions", "/v1/chat/completions", "/generate", "/abort_request"
USER = [{"role": "user", "content": "hi"}]
MAX_MODEL_LEN = 256
FORM = "application/x-www-form-urlencoded"


def nested(depth: int) -> bytes:
    """Garbage nested ``depth`` deep in a field that takes any JSON (response_format)."""
    return b'{"prompt": "a", "response_format": {"x": ' + b"[" * depth + b"]" * depth + b"}}"


def deep_schema_body(levels: int) -> bytes:
    """A completions body whose json_schema nests ``levels`` objects (built as text: no
    recursion on this side)."""
    schema = '{"type": "object", "properties": {"a": ' * levels + '{"type": "string"}'
    schema += '}, "required": ["a"]}' * levels
    return ('{"prompt": "a", "response_format": {"type": "json_schema", "json_schema": '
            '{"schema": ' + schema + "}}}").encode()  # fmt: skip


def c(**fields) -> dict:  # a completions body
    return {"prompt": "a", **fields}


def ch(**fields) -> dict:  # a chat body
    return {"messages": USER, **fields}


def tool_turn(call: dict) -> dict:  # a chat body whose tool message carries ``call``
    return {"messages": [*USER, {"role": "tool", "content": None, "tool_calls": [call]}]}


def g(**sp) -> dict:  # a /generate body with these sampling params
    return {"text": "a", "sampling_params": sp}


# (id, route, body: dict -> JSON, bytes -> raw, (bytes, content type); status; words the
# error message must contain)
CASES = [
    # -- malformed bodies ---------------------------------------------------------
    ("truncated-json", COMP, b'{"prompt": "a", "max_tokens": ', 400, ["malformed JSON"]),
    ("nan-literal", COMP, b'{"prompt": "a", "temperature": NaN}', 400, ["malformed JSON"]),
    ("infinity-literal", COMP, b'{"prompt": "a", "top_p": Infinity}', 400, ["malformed JSON"]),
    ("float-overflows-to-inf", COMP, b'{"prompt": "a", "temperature": 1e999}', 400,
     ["temperature", "out of range"]),
    ("bad-utf8", COMP, b'{"prompt": "\xff\xfe"}', 400, ["UTF-8"]),
    ("lone-surrogate-escape", COMP, b'{"prompt": "\\ud800"}', 400, ["JSON"]),
    ("empty-body", COMP, b"", 400, ["empty"]),
    ("whitespace-body", CHAT, b" \n\t ", 400, ["empty"]),
    ("json-null-body", GEN, b"null", 400, ["expected object"]),
    ("json-string-body", ABORT, b'"abc"', 400, ["expected object"]),
    ("json-array-body", COMP, b"[1, 2]", 400, ["expected object"]),
    ("nested-garbage-100k-deep", COMP, nested(100_000), 400, ["nested too deeply"]),
    ("nested-garbage-in-chat", CHAT, b'{"messages": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",
     400, ["messages[0]", "expected object"]),
    ("form-encoded-body", COMP, (b"prompt=a&max_tokens=3", FORM), 415, ["application/json"]),
    ("text-plain-body", GEN, (b"text=a", "text/plain"), 415, ["Content-Type", "text/plain"]),
    # -- completions: prompt -------------------------------------------------------
    ("missing-prompt", COMP, {"max_tokens": 3}, 400, ["prompt", "required"]),
    ("prompt-object", COMP, {"prompt": {"a": 1}}, 400, ["prompt", "expected"]),
    ("prompt-too-nested", COMP, {"prompt": [[[1]]]}, 400, ["prompt[0][0]", "expected int"]),
    ("prompt-mixed-list", COMP, {"prompt": ["a", 1]}, 400, ["prompt", "mix"]),
    ("prompt-empty-string", COMP, {"prompt": ""}, 400, ["prompt", "empty"]),
    ("prompt-empty-list", COMP, {"prompt": []}, 400, ["prompt", "empty"]),
    ("prompt-empty-in-batch", COMP, {"prompt": [[1, 2], []]}, 400, ["prompt", "empty"]),
    ("prompt-negative-token", COMP, {"prompt": [-5]}, 400, ["prompt", "-5"]),
    ("prompt-token-out-of-vocab", COMP, {"prompt": [1, 99999]}, 400, ["99999", "vocabulary"]),
    ("prompt-token-beyond-int64", COMP, {"prompt": [10**23]}, 400, [str(10**23)]),
    ("prompt-oversized-text", COMP, {"prompt": "hello " * 100_000}, 400,
     ["maximum context length is 256", "400000 in the prompt"]),
    # -- completions: numbers ------------------------------------------------------
    ("max-tokens-zero", COMP, c(max_tokens=0), 400, ["max_tokens", "at least 1"]),
    ("max-tokens-negative", COMP, c(max_tokens=-1), 400, ["max_tokens", "at least 1"]),
    ("max-tokens-float", COMP, c(max_tokens=1.5), 400, ["max_tokens", "expected int"]),
    ("max-tokens-string", COMP, c(max_tokens="ten"), 400, ["max_tokens", "expected int"]),
    ("max-tokens-huge", COMP, c(max_tokens=10**30), 400, ["max_tokens", str(10**30)]),
    ("max-tokens-over-context", COMP, c(max_tokens=10**6), 400, ["256", "1000001"]),
    ("temperature-negative", COMP, c(temperature=-0.5), 400, ["temperature", "0 and 100"]),
    ("temperature-huge", COMP, c(temperature=1e300), 400, ["temperature", "0 and 100"]),
    ("top-p-zero", COMP, c(top_p=0), 400, ["top_p", "(0, 1]"]),
    ("top-p-above-1", COMP, c(top_p=1.0000001), 400, ["top_p", "(0, 1]"]),
    ("top-k-below-minus-1", COMP, c(top_k=-2), 400, ["top_k"]),
    ("top-k-beyond-int64", COMP, c(top_k=2**70), 400, ["top_k", "2**63"]),
    ("min-p-above-1", COMP, c(min_p=2), 400, ["min_p", "[0, 1]"]),
    ("repetition-penalty-zero", COMP, c(repetition_penalty=0), 400, ["repetition_penalty"]),
    ("presence-penalty-5", COMP, c(presence_penalty=5), 400, ["presence_penalty", "-2 and 2"]),
    ("frequency-penalty-minus-3", COMP, c(frequency_penalty=-3), 400, ["frequency_penalty"]),
    ("n-zero", COMP, c(n=0), 400, ["n:", "between 1 and 16"]),
    ("n-huge", COMP, c(n=10**6), 400, ["n:", "between 1 and 16"]),
    ("n-beyond-int64", COMP, c(n=10**30), 400, ["n:", "between 1 and 16"]),
    ("best-of-not-n", COMP, c(best_of=3), 400, ["best_of"]),
    ("suffix", COMP, c(suffix="x"), 400, ["suffix", "not supported"]),
    ("seed-beyond-64-bits", COMP, c(seed=2**64), 400, ["seed", "64 bits"]),
    ("seed-string", COMP, c(seed="42"), 400, ["seed", "expected int"]),
    ("seed-plus-choice-overflows", COMP, c(seed=2**64 - 1, n=2, temperature=1), 400,
     ["seed", "64 bits"]),
    ("min-tokens-over-max-tokens", COMP, c(min_tokens=100, max_tokens=5), 400,
     ["min_tokens", "max_tokens (5)"]),
    ("min-tokens-beyond-int64", COMP, c(min_tokens=2**64 - 1, max_tokens=None), 400,
     ["min_tokens", "2**63"]),
    ("min-tokens-with-35-stop-ids", COMP, c(min_tokens=1, stop_token_ids=list(range(5, 40))),
     400, ["stop_token_ids", "min_tokens", "16"]),
    # -- completions: stop, logprobs, flags, structured output ------------------
    ("stop-int", COMP, c(stop=3), 400, ["stop", "expected"]),
    ("stop-list-with-null", COMP, c(stop=["a", None]), 400, ["stop[1]", "expected str"]),
    ("stop-empty-string", COMP, c(stop=[""]), 400, ["stop", "non-empty"]),
    ("stop-17-strings", COMP, c(stop=["x"] * 17), 400, ["stop", "at most 16"]),
    ("stop-token-ids-negative", COMP, c(stop_token_ids=[-1]), 400, ["stop_token_ids"]),
    ("stop-token-ids-out-of-vocab", COMP, c(stop_token_ids=[99999]), 400,
     ["stop_token_ids", "99999"]),
    ("logprobs-21", COMP, c(logprobs=21), 400, ["logprobs", "between 0 and 20"]),
    ("logprobs-negative", COMP, c(logprobs=-1), 400, ["logprobs", "between 0 and 20"]),
    ("logprobs-bool", COMP, c(logprobs=True), 400, ["logprobs", "expected int"]),
    ("echo-string", COMP, c(echo="x"), 400, ["echo", "expected bool"]),
    ("stream-string", COMP, c(stream="yes"), 400, ["stream", "expected bool"]),
    ("stream-options-wrong-type", COMP, c(stream_options={"include_usage": 3}), 400,
     ["stream_options.include_usage"]),
    ("response-format-xml", COMP, c(response_format={"type": "xml"}), 400,
     ["response_format", "xml"]),
    ("response-format-string", COMP, c(response_format="json"), 400,
     ["response_format", "expected object"]),
    ("json-schema-missing", COMP, c(response_format={"type": "json_schema"}), 400,
     ["response_format", "schema"]),
    ("json-schema-not-an-object", COMP,
     c(response_format={"type": "json_schema", "json_schema": {"schema": 5}}), 400,
     ["response_format", "schema"]),
    ("json-schema-unknown-type", COMP,
     c(response_format={"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}),
     400, ["json_schema", "nonsense"]),
    ("json-schema-text-not-json", COMP, c(json_schema="{not json"), 400, ["json_schema", "JSON"]),
    ("json-schema-nested-2000-deep", COMP, deep_schema_body(2000), 400, ["nested too deeply"]),
    ("regex-unclosed", COMP, c(regex="(unclosed"), 400, ["regex"]),
    ("prompt-token-id-2^64", COMP, c(prompt=[2**64]), 400,
     ["prompt", "18446744073709551616", "vocabulary"]),
    ("ebnf-broken", COMP, c(ebnf="root ::= "), 400, ["ebnf"]),
    ("two-grammars", COMP, c(regex="a+", ebnf='root ::= "a"'), 400,
     ["one structured-output field"]),
    ("logit-bias-key", COMP, c(logit_bias={"one": 2}), 400, ["logit_bias", "token ids"]),
    ("logit-bias-range", COMP, c(logit_bias={"1": 200}), 400, ["logit_bias", "-100 and 100"]),
    ("known-field-wrong-type", COMP, c(user=5), 400, ["user", "expected str"]),
    ("model-wrong-type", COMP, c(model=5), 400, ["model", "expected str"]),
    ("unknown-model", COMP, c(model="gpt-9"), 404, ["gpt-9", "does not exist"]),
    ("streamed-bad-param", COMP, c(stream=True, top_p=7), 400, ["top_p"]),
    # -- chat ----------------------------------------------------------------------
    ("chat-missing-messages", CHAT, {"max_tokens": 3}, 400, ["messages", "required"]),
    ("chat-messages-string", CHAT, {"messages": "hi"}, 400, ["messages", "expected array"]),
    ("chat-empty-messages", CHAT, {"messages": []}, 400, ["messages", "empty"]),
    ("chat-bad-role", CHAT, {"messages": [{"role": "robot", "content": "x"}]}, 400,
     ["messages[0].role"]),
    ("chat-content-number", CHAT, {"messages": [{"role": "user", "content": 5}]}, 400,
     ["messages[0].content"]),
    ("chat-image-part", CHAT,
     {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     ["messages[0].content[0]", "image_url"]),
    ("chat-text-part-without-text", CHAT,
     {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, 400,
     ["messages[0].content[0]", "'text'"]),
    ("chat-template-kwargs-messages", CHAT, ch(chat_template_kwargs={"messages": 5}), 400,
     ["chat_template_kwargs", "messages"]),
    ("chat-template-kwargs-eos-token", CHAT, ch(chat_template_kwargs={"eos_token": "x"}), 400,
     ["chat_template_kwargs", "eos_token"]),
    ("chat-template-kwargs-string", CHAT, ch(chat_template_kwargs="x"), 400,
     ["chat_template_kwargs", "expected object"]),
    ("chat-tools", CHAT, ch(tools=[{"type": "function"}]), 400, ["tools", "required"]),
    # a tool message's call of the wrong shape (the schema fuzzer once got a 500 here)
    ("chat-tool-call-function-string", CHAT, tool_turn({"function": "x"}), 400,
     ["messages[1].tool_calls[0].function", "object", "str"]),
    ("chat-tool-call-function-list", CHAT, tool_turn({"function": [1]}), 400,
     ["messages[1].tool_calls[0].function", "object", "list"]),
    ("chat-tool-call-function-number", CHAT, tool_turn({"function": 5}), 400,
     ["messages[1].tool_calls[0].function", "object", "int"]),
    ("chat-tool-call-arguments-number", CHAT, tool_turn({"function": {"arguments": 5}}), 400,
     ["messages[1].tool_calls[0].function.arguments", "JSON string", "int"]),
    ("chat-tool-call-arguments-nested", CHAT,
     tool_turn({"function": {"arguments": "[" * 5000}}), 400,
     ["messages[1].tool_calls[0].function.arguments", "nested too deeply"]),
    ("chat-tool-call-arguments-not-json", CHAT, tool_turn({"function": {"arguments": "{x"}}),
     400, ["messages[1].tool_calls[0].function.arguments", "not valid JSON"]),
    ("chat-tool-call-id-number", CHAT,
     {"messages": [*USER, {"role": "tool", "content": "4", "tool_call_id": 7}]}, 400,
     ["messages[1].tool_call_id", "expected str"]),
    ("unknown-field", COMP, c(guided_foo=1), 400, ["guided_foo", "not supported"]),
    ("chat-top-logprobs-alone", CHAT, ch(top_logprobs=2), 400, ["top_logprobs", "logprobs"]),
    ("chat-top-logprobs-30", CHAT, ch(logprobs=True, top_logprobs=30), 400,
     ["top_logprobs:", "20"]),
    ("chat-logprobs-string", CHAT, ch(logprobs="yes"), 400, ["logprobs", "expected bool"]),
    ("chat-max-completion-tokens-0", CHAT, ch(max_completion_tokens=0), 400,
     ["max_completion_tokens:"]),
    ("chat-over-context", CHAT, ch(max_tokens=5000), 400, ["256", "5000"]),
    ("chat-n-17", CHAT, ch(n=17), 400, ["n:", "16"]),
    ("chat-streamed-bad-param", CHAT, ch(stream=True, temperature=-1), 400, ["temperature"]),
    # -- /generate -----------------------------------------------------------------
    ("gen-no-input", GEN, {"sampling_params": {}}, 400, ["text", "input_ids"]),
    ("gen-text-and-ids", GEN, {"text": "a", "input_ids": [1]}, 400, ["exactly one"]),
    ("gen-empty-ids", GEN, {"input_ids": []}, 400, ["input_ids"]),
    ("gen-mixed-ids", GEN, {"input_ids": [1, [2]]}, 400, ["input_ids"]),
    ("gen-empty-id-list", GEN, {"input_ids": [[]]}, 400, ["prompt", "empty"]),
    ("gen-empty-text-list", GEN, {"text": []}, 400, ["text", "empty"]),
    ("gen-params-count-mismatch", GEN, {"text": ["a", "b"], "sampling_params": [{}]}, 400,
     ["one per prompt (2)"]),
    ("gen-rid-count-mismatch", GEN, {"text": "a", "rid": ["x", "y"]}, 400, ["rid"]),
    ("gen-rid-int", GEN, {"text": "a", "rid": 5}, 400, ["rid", "expected"]),
    ("gen-rid-empty", GEN, {"text": "a", "rid": ""}, 400, ["rid", "non-empty"]),
    ("gen-rid-repeated-in-batch", GEN, {"text": ["a", "b"], "rid": ["x", "x"]}, 409,
     ["rid", "'x'"]),
    ("gen-sampling-params-string", GEN, {"text": "a", "sampling_params": "x"}, 400,
     ["sampling_params", "expected"]),
    ("gen-max-new-tokens-0", GEN, g(max_new_tokens=0), 400, ["sampling_params.max_new_tokens"]),
    ("gen-n-0", GEN, g(n=0), 400, ["sampling_params.n"]),
    ("gen-temperature-negative", GEN, g(temperature=-1), 400, ["sampling_params.temperature"]),
    ("gen-top-k-minus-5", GEN, g(top_k=-5), 400, ["sampling_params.top_k"]),
    ("gen-seed-float", GEN, g(sampling_seed=1e30), 400, ["sampling_params.sampling_seed"]),
    ("gen-stop-token-out-of-vocab", GEN, g(stop_token_ids=[99999]), 400, ["stop_token_ids"]),
    ("gen-json-schema-bad", GEN, g(json_schema="{bad"), 400, ["json_schema"]),
    ("gen-min-new-tokens-negative", GEN, g(min_new_tokens=-1), 400,
     ["sampling_params.min_new_tokens"]),
    ("gen-min-new-tokens-with-20-stop-ids", GEN,
     g(min_new_tokens=2, stop_token_ids=list(range(5, 25))), 400, ["stop_token_ids", "16"]),
    ("gen-top-logprobs-50", GEN, {"text": "a", "return_logprob": True, "top_logprobs_num": 50},
     400, ["top_logprobs_num"]),
    ("gen-return-logprob-string", GEN, {"text": "a", "return_logprob": "yes"}, 400,
     ["return_logprob"]),
    ("gen-streamed-bad-param", GEN, {"text": "a", "stream": True, "sampling_params": {"n": 99}},
     400, ["sampling_params.n"]),
    # -- /abort_request, routing ---------------------------------------------------
    ("abort-without-rid", ABORT, {}, 400, ["rid"]),
    ("abort-rid-int", ABORT, {"rid": 5}, 400, ["rid", "expected str"]),
    ("abort-all-string", ABORT, {"abort_all": "yes"}, 400, ["abort_all", "expected bool"]),
    ("abort-truncated-json", ABORT, b'{"rid": "x', 400, ["malformed JSON"]),
    ("unknown-route", "/v1/nothing", {}, 404, ["/v1/nothing", "no such route"]),
]  # fmt: skip

IDS = [case[0] for case in CASES]
assert len(set(IDS)) == len(IDS)


@pytest.fixture(scope="module")
def server(reliability_checkpoint, tmp_path_factory):
    with run_server(
        reliability_checkpoint, tmp_path_factory.mktemp("logs"), max_model_len=MAX_MODEL_LEN
    ) as s:
        yield s


PROBE = {"prompt": "The for statement", "max_tokens": 8, **GREEDY}


@pytest.fixture(scope="module")
def probe_text(server) -> str:
    """The probe's greedy answer before any bad input."""
    response = httpx.post(server.base_url + COMP, json=PROBE, headers=server.headers, timeout=60)
    return response.json()["choices"][0]["text"]


@pytest.mark.parametrize("route, body, status, words", [c[1:] for c in CASES], ids=IDS)
async def test_bad_input_is_a_4xx_naming_the_problem(
    server, probe_text, route, body, status, words
):
    async with server.client() as client:
        if isinstance(body, dict):
            response = await client.post(route, json=body)
        else:
            content, kind = body if isinstance(body, tuple) else (body, "application/json")
            response = await client.post(route, content=content, headers={"content-type": kind})
        assert response.status_code == status, response.text[:500]
        assert response.headers["content-type"] == "application/json"
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        for word in words:
            assert word in error["message"], error["message"]
        assert "Traceback" not in response.text and 'File "' not in response.text
        ok = await client.post(COMP, json={"prompt": "still serving?", "max_tokens": 1})
        assert ok.status_code == 200, ok.text


async def test_tool_messages_of_odd_but_valid_shapes_are_served(server):
    """A tool message with no content, with text parts, without a tool_call_id, with a
    call whose arguments are empty or an object: each rendered and served."""
    tools = [
        {"role": "tool", "content": None},
        {"role": "tool", "content": [{"type": "text", "text": "4"}], "tool_call_id": "c1"},
        {"role": "tool", "content": "4"},
        {"role": "tool", "content": None, "tool_calls": [{"function": {"arguments": ""}}]},
        {"role": "tool", "tool_calls": [{"id": "c2", "function": {"arguments": {"a": 1}}}]},
        {"role": "tool", "content": "", "tool_calls": [{}], "name": "f"},
    ]
    async with server.client() as client:
        for message in tools:
            body = {"messages": [*USER, message], "max_tokens": 1}
            response = await client.post(CHAT, json=body)
            assert response.status_code == 200, (message, response.text)


async def test_unknown_fields_are_refused_by_name(server):
    """OpenAI routes and SGLang's /generate: an unknown field is a 400 naming it, never
    silently ignored."""
    garbage = {"x": [1, {"y": None}], "z": float(2**70), "w": "\u0000"}
    async with server.client() as client:
        for route, body in (
            (COMP, c(max_tokens=1)),
            (CHAT, ch(max_tokens=1)),
            (GEN, g(max_new_tokens=1)),
        ):
            response = await client.post(route, json={**body, **garbage})
            assert response.status_code == 400, response.text
            assert response.json()["error"]["param"] in garbage
        assert (await client.post(GEN, json=g(max_new_tokens=1))).status_code == 200


async def test_a_body_that_names_its_type_must_name_json(server):
    """A cross-site page can send text/plain without a CORS preflight: refused even when
    the body is valid JSON. No Content-Type at all (a bare client) is read as JSON."""
    body = json.dumps(c(max_tokens=1))
    async with server.client() as client:
        plain = await client.post(COMP, content=body, headers={"content-type": "text/plain"})
        assert plain.status_code == 415, plain.text
        assert plain.json()["error"]["param"] == "Content-Type"
        for kind in ("application/json; charset=utf-8", None):
            headers = {"content-type": kind} if kind else {}
            ok = await client.post(COMP, content=body, headers=headers)
            assert ok.status_code == 200, (kind, ok.text)


async def test_after_every_bad_input_the_server_serves_the_same_answers(server, probe_text):
    async with server.client() as client:
        assert (await client.get("/health")).status_code == 200
        again = await client.post(COMP, json=PROBE)
        assert again.json()["choices"][0]["text"] == probe_text
    await server.wait_idle()
    log = server.log()
    assert "Traceback" not in log and " ERROR " not in log, log[-3000:]
    print(f"reliability: bad-inputs cases={len(CASES)} (routes: "
          f"{sorted({case[1] for case in CASES})})")  # fmt: skip


async def test_streamed_text_with_unicode_line_separators_stays_one_event_per_line(server):
    """U+2028, U+2029 and U+0085 are line breaks to str.splitlines() (and so to httpx's
    aiter_lines) but not to SSE: the echoed prompt carries them into the stream, which
    both httpx's lines and this project's AsyncClient must still read event by event."""
    from tokenspeed_aio.client import AsyncClient

    prompt = "one\u2028two\u2029three\x85four"
    body = {"prompt": prompt, "max_tokens": 2, "echo": True, "stream": True}
    async with server.client() as client, client.stream("POST", COMP, json=body) as r:
        events = [line async for line in r.aiter_lines() if line.startswith("data: {")]
    text = "".join(json.loads(e[6:])["choices"][0]["text"] for e in events)
    assert text.startswith(prompt)
    async with AsyncClient(server.base_url, api_key=server.api_key) as client:
        stream = await client.completions(prompt, stream=True, max_tokens=2, echo=True)
        chunks = [chunk async for chunk in stream]
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices).startswith(prompt)
