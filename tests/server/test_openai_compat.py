"""What vLLM and SGLang users send and call, through the official ``openai`` client and
plain HTTP: the structured-output spellings (guided_*, structured_outputs, response_format
regex / choice), logit_bias, prompt_logprobs, min_tokens, truncate_prompt_tokens, unknown
fields refused by name; the utility routes; reasoning parsers; the access rules (API key,
metrics key, CORS) and the request-body timeout."""

from __future__ import annotations

import asyncio
import json
import re
import types

import httpx
import jsonschema
import openai
import pytest
from helpers.apps import serve_apps
from helpers.instruct import make_instruct_checkpoint

from tokenspeed_aio.control.transport import LoadReporter
from tokenspeed_aio.server.metrics import ServerMetrics
from tokenspeed_aio.server.options import ServerOptions
from tokenspeed_aio.wire.messages import Load

MESSAGES = [{"role": "user", "content": "Say something."}]
KEY, METRICS_KEY = "sekret", "scrape-key"


@pytest.fixture(scope="module")
def apps(tmp_path_factory):
    model = make_instruct_checkpoint(tmp_path_factory.mktemp("compat") / "instruct")
    quiet = dict(access_log=False)
    options = {
        "plain": (ServerOptions(**quiet), ["tiny", "tiny-alias"]),
        "qwen3": ServerOptions(reasoning_parser="qwen3", **quiet),
        "r1": ServerOptions(reasoning_parser="deepseek_r1", **quiet),
        "keys": ServerOptions(api_key=KEY, **quiet),
        "metrics-key": ServerOptions(api_key=KEY, metrics_api_key=METRICS_KEY, **quiet),
        "cors": ServerOptions(allowed_origins=("https://app.example",), **quiet),
        "slow-body": ServerOptions(body_timeout_seconds=1.0, **quiet),
    }
    with serve_apps(model, options) as urls:
        yield urls


def oai(apps, name="plain", key="none") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=apps[name] + "/v1", api_key=key, max_retries=0)


async def complete(apps, **kw):
    async with oai(apps) as client:
        kw.setdefault("max_tokens", 16)
        return await client.completions.create(model="tiny", prompt="The for statement", **kw)


# -- structured output -----------------------------------------------------------------
SCHEMA = {"type": "object", "properties": {"ok": {"enum": ["yes", "no"]}}, "required": ["ok"]}
GRAMMARS = [
    ("guided_json", SCHEMA, lambda t: jsonschema.validate(json.loads(t), SCHEMA)),
    ("guided_regex", "[a-c]{3}x", lambda t: re.fullmatch("[a-c]{3}x", t)),
    ("guided_choice", ["red", "green"], lambda t: t in ("red", "green")),
    ("guided_grammar", 'root ::= "yes" | "no"', lambda t: t in ("yes", "no")),
    ("structured_outputs", {"choice": ["up", "down"]}, lambda t: t in ("up", "down")),
    ("structured_outputs", {"regex": "[0-9]{4}"}, lambda t: re.fullmatch("[0-9]{4}", t)),
    ("structured_outputs", {"json": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA)),
    ("response_format", {"type": "regex", "regex": "z{2}[0-9]"}, lambda t: re.fullmatch("z{2}[0-9]", t)),
    ("response_format", {"type": "choice", "choice": ["on", "off"]}, lambda t: t in ("on", "off")),
]  # fmt: skip


@pytest.mark.parametrize("field, value, check", GRAMMARS, ids=lambda v: str(v)[:24])
async def test_every_structured_output_spelling_constrains_the_reply(apps, field, value, check):
    out = await complete(apps, max_tokens=24, temperature=1.0, seed=3, extra_body={field: value})
    text = out.choices[0].text
    assert check(text) is not False, f"{field}: {text!r}"
    assert out.choices[0].finish_reason == "stop"


async def test_two_structured_output_fields_are_refused_by_name(apps):
    with pytest.raises(openai.BadRequestError, match="guided_choice"):
        await complete(apps, extra_body={"guided_regex": "a", "guided_choice": ["b"]})


@pytest.mark.parametrize("field", ["guided_foo", "best_of_n", "functions"])
async def test_an_unknown_field_is_a_400_naming_it(apps, field):
    with pytest.raises(openai.BadRequestError, match=field) as err:
        await complete(apps, extra_body={field: 1})
    assert err.value.body["param"] == field


# -- sampling fields ---------------------------------------------------------------------
async def token_id(apps, text: str) -> int:
    async with httpx.AsyncClient(base_url=apps["plain"]) as http:
        ids = (await http.post("/tokenize", json={"prompt": text})).json()["tokens"]
    assert len(ids) == 1, ids
    return ids[0]


async def test_logit_bias_forces_and_bans_tokens(apps):
    the = await token_id(apps, " the")
    forced = await complete(apps, temperature=0, logit_bias={str(the): 100}, max_tokens=5)
    assert forced.choices[0].text == " the" * 5
    plain = await complete(apps, temperature=0, max_tokens=1, logprobs=0)
    first = plain.choices[0].logprobs.tokens[0]
    banned_id = await token_id(apps, first)
    banned = await complete(apps, temperature=0, max_tokens=1, logit_bias={str(banned_id): -100})
    assert banned.choices[0].text != first
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        await complete(apps, logit_bias={"999999": 1})


async def test_min_tokens_holds_back_eos(apps):
    eos = await token_id(apps, "<|endoftext|>")
    early = await complete(apps, temperature=0, logit_bias={str(eos): 100}, max_tokens=8)
    assert early.usage.completion_tokens == 1 and early.choices[0].finish_reason == "stop"
    held = await complete(
        apps, temperature=0, logit_bias={str(eos): 100}, max_tokens=8, extra_body={"min_tokens": 5}
    )
    assert held.usage.completion_tokens == 6 and held.choices[0].finish_reason == "stop"


async def test_prompt_logprobs_in_completions_and_chat(apps):
    out = await complete(apps, max_tokens=2, extra_body={"prompt_logprobs": 2})
    entries = out.choices[0].prompt_logprobs
    assert len(entries) == out.usage.prompt_tokens and entries[0] is None
    for entry in entries[1:]:
        assert 1 <= len(entry) <= 3 and all(v["logprob"] <= 0 for v in entry.values())
    async with oai(apps) as client:
        chat = await client.chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=2, extra_body={"prompt_logprobs": 0}
        )
    assert len(chat.prompt_logprobs) == chat.usage.prompt_tokens


async def test_truncate_prompt_tokens_keeps_the_prompt_tail(apps):
    out = await complete(apps, max_tokens=2, extra_body={"truncate_prompt_tokens": 2})
    assert out.usage.prompt_tokens == 2
    async with oai(apps) as client:
        chat = await client.chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=2, extra_body={"truncate_prompt_tokens": 3}
        )
    assert chat.usage.prompt_tokens == 3


# -- routes ------------------------------------------------------------------------------
async def test_utility_routes(apps):
    async with httpx.AsyncClient(base_url=apps["plain"]) as http:
        tok = (
            await http.post("/tokenize", json={"prompt": "The for", "return_token_strs": True})
        ).json()
        assert (
            tok["count"] == len(tok["tokens"]) == len(tok["token_strs"])
            and tok["max_model_len"] == 1024
        )
        text = (await http.post("/detokenize", json={"tokens": tok["tokens"]})).json()
        assert text == {"prompt": "The for"}
        chat = (await http.post("/tokenize", json={"messages": MESSAGES})).json()
        assert chat["count"] > tok["count"]
        bad = await http.post("/detokenize", json={"tokens": [10**9]})
        assert bad.status_code == 400 and "tokens" in bad.json()["error"]["message"]
        assert (await http.get("/version")).json()["version"]
        for path in ("/server_info", "/get_server_info"):
            info = (await http.get(path)).json()
            assert (
                info["engine_args"]["max_model_len"] == 1024
                and "api_key" not in info["server_args"]
            )
        for path in ("/model_info", "/get_model_info"):
            model = (await http.get(path)).json()
            assert model["served_model_names"] == ["tiny", "tiny-alias"] and model["is_generation"]
    async with oai(apps) as client:
        cards = (await client.models.list()).data
        assert [c.id for c in cards] == ["tiny", "tiny-alias"]
        assert all(c.max_model_len == 1024 and c.root.endswith("instruct") for c in cards)
        out = await client.completions.create(model="tiny-alias", prompt="a", max_tokens=1)
        assert out.model == "tiny"  # responses carry the first name


# -- reasoning ---------------------------------------------------------------------------
THINK = r"<think>[a-z]{2,6}</think>[A-Z]{2,6}"


@pytest.mark.parametrize("app", ["qwen3", "r1"])
@pytest.mark.parametrize("stream", [False, True])
async def test_reasoning_is_split_out_of_the_reply(apps, app, stream):
    kw = dict(model="tiny", messages=MESSAGES, max_tokens=40, extra_body={"guided_regex": THINK})
    async with oai(apps, app) as client:
        if stream:
            reasoning = content = ""
            async for chunk in await client.chat.completions.create(**kw, stream=True):
                delta = chunk.choices[0].delta if chunk.choices else None
                reasoning += getattr(delta, "reasoning_content", None) or ""
                content += (delta.content if delta else None) or ""
        else:
            message = (await client.chat.completions.create(**kw)).choices[0].message
            reasoning, content = message.reasoning_content, message.content
    assert re.fullmatch("[a-z]{2,6}", reasoning) and re.fullmatch("[A-Z]{2,6}", content)


async def test_sglangs_extension_fields_as_its_gateway_sends_them(apps):
    """The SGLang Model Gateway adds its extensions at their defaults to every request;
    each either acts or is refused by name."""
    url = apps["qwen3"] + "/v1/chat/completions"
    base = dict(model="tiny", messages=MESSAGES, max_tokens=40, guided_regex=THINK)
    defaults = dict(
        no_stop_trim=False, ignore_eos=False, skip_special_tokens=True, return_hidden_states=False,
        continue_final_message=False, separate_reasoning=True, stream_reasoning=True,
    )  # fmt: skip
    async with httpx.AsyncClient(timeout=60) as http:
        split = (await http.post(url, json={**base, **defaults})).json()["choices"][0]["message"]
        assert re.fullmatch("[a-z]{2,6}", split["reasoning_content"])
        joined = await http.post(url, json={**base, **defaults, "separate_reasoning": False})
        message = joined.json()["choices"][0]["message"]
        assert not message.get("reasoning_content")
        assert re.fullmatch("<think>[a-z]{2,6}</think>[A-Z]{2,6}", message["content"])
        for field, value in (("return_hidden_states", True), ("stream_reasoning", False)):
            r = await http.post(url, json={**base, field: value})
            assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
        # continue_final_message: the reply continues the assistant's last text
        go_on = [*MESSAGES, {"role": "assistant", "content": "Once"}]
        body = dict(model="tiny", messages=go_on, max_tokens=4, temperature=0)
        cont = await http.post(url, json={**body, "continue_final_message": True})
        closed = await http.post(url, json={**body, "add_generation_prompt": False})
        assert cont.status_code == 200 and closed.status_code == 200, cont.text
        # the continued prompt stops at "Once": the closed turn's end-of-turn tokens go
        assert cont.json()["usage"]["prompt_tokens"] < closed.json()["usage"]["prompt_tokens"]
        bad = await http.post(url, json={**base, "continue_final_message": True})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "continue_final_message"
    completion = apps["plain"] + "/v1/completions"
    stop = dict(model="tiny", prompt="The for statement", max_tokens=16, temperature=0)
    async with httpx.AsyncClient(timeout=60) as http:
        free = (await http.post(completion, json=stop)).json()["choices"][0]["text"]
        word = free.strip().split()[0] if free.strip() else free[:1]
        kept = await http.post(completion, json={**stop, "stop": [word], "no_stop_trim": True})
        trimmed = await http.post(completion, json={**stop, "stop": [word]})
    assert kept.json()["choices"][0]["text"].endswith(word)
    assert not trimmed.json()["choices"][0]["text"].endswith(word)


async def test_reasoning_parsers_on_free_text(apps):
    """No think tags: deepseek_r1's reply is all reasoning (its template opens the block);
    qwen3 with enable_thinking false (an empty block in the prompt) is all content."""
    kw = dict(model="tiny", messages=MESSAGES, max_tokens=8, temperature=0)
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    async with oai(apps, "plain") as client:
        plain = (await client.chat.completions.create(**kw, extra_body=off)).choices[0].message
        plain_on = (await client.chat.completions.create(**kw)).choices[0].message
    async with oai(apps, "qwen3") as client:
        qwen = (await client.chat.completions.create(**kw, extra_body=off)).choices[0].message
    async with oai(apps, "r1") as client:
        r1 = (await client.chat.completions.create(**kw)).choices[0].message
    assert "<think>" not in plain.content
    assert (qwen.content, qwen.reasoning_content) == (plain.content, None)
    if "</think>" not in plain_on.content:
        assert (r1.content, r1.reasoning_content) == (None, plain_on.content)


# -- access --------------------------------------------------------------------------------
async def test_api_key_guards_the_api_but_not_health_or_metrics(apps):
    async with httpx.AsyncClient(base_url=apps["keys"]) as http:
        assert (await http.post("/v1/completions", json={"prompt": "a"})).status_code == 401
        assert (await http.get("/v1/models")).status_code == 401
        assert (await http.get("/health")).status_code == 200
        assert (await http.get("/metrics")).status_code == 200
    async with oai(apps, "keys", key=KEY) as client:
        assert (await client.models.list()).data
    async with oai(apps, "keys", key="wrong") as client:
        with pytest.raises(openai.AuthenticationError):
            await client.models.list()


async def test_a_metrics_key_guards_metrics_with_its_own_key(apps):
    async with httpx.AsyncClient(base_url=apps["metrics-key"]) as http:
        assert (await http.get("/metrics")).status_code == 401
        api = {"Authorization": f"Bearer {KEY}"}
        assert (await http.get("/metrics", headers=api)).status_code == 401
        scrape = {"Authorization": f"Bearer {METRICS_KEY}"}
        assert (await http.get("/metrics", headers=scrape)).status_code == 200
        assert (await http.get("/health")).status_code == 200


async def test_cors_preflight_and_origins(apps):
    preflight = {
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization",
    }
    async with httpx.AsyncClient(base_url=apps["cors"]) as http:
        ok = await http.options(
            "/v1/completions", headers={"Origin": "https://app.example", **preflight}
        )
        assert ok.status_code == 200
        assert ok.headers["access-control-allow-origin"] == "https://app.example"
        other = await http.options(
            "/v1/completions", headers={"Origin": "https://evil.example", **preflight}
        )
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
        got = await http.get("/v1/models", headers={"Origin": "https://app.example"})
        assert got.headers["access-control-allow-origin"] == "https://app.example"
        post = await http.post(
            "/v1/completions", headers={"Origin": "https://evil.example"}, json={"prompt": "a"}
        )
        assert post.status_code == 403 and post.json()["error"]["param"] == "Origin"
    async with httpx.AsyncClient(base_url=apps["plain"]) as http:  # default: no other origin
        got = await http.get("/v1/models", headers={"Origin": "https://anywhere.example"})
        assert "access-control-allow-origin" not in got.headers
        blocked = await http.options(
            "/v1/completions", headers={"Origin": "https://anywhere.example", **preflight}
        )
        assert blocked.status_code == 400 and "access-control-allow-origin" not in blocked.headers


async def test_a_body_that_never_ends_is_cut_off(apps):
    host, port = apps["slow-body"].removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 1000\r\n\r\n{\"prompt\": ")  # fmt: skip
    await writer.drain()
    loop = asyncio.get_running_loop()
    start = loop.time()
    head = await asyncio.wait_for(reader.read(4096), timeout=10)
    assert head.startswith(b"HTTP/1.1 408") and b"did not arrive within 1 s" in head
    assert loop.time() - start < 5
    writer.close()


# -- metrics -------------------------------------------------------------------------------
def metric(text: str, name: str) -> float:
    """The sample's value; 0 for a series that has none yet (its HELP line is there)."""
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            return float(line.rsplit(" ", 1)[1])
    assert f"# HELP {name} " in text, f"{name} not in /metrics"
    return 0.0


async def test_prefix_cache_and_process_metrics(apps):
    async with httpx.AsyncClient(base_url=apps["plain"]) as http:
        before = (await http.get("/metrics")).text
        prompt = "The for statement is used to iterate over the elements of a sequence " * 3
        for _ in range(2):  # the second finds the first's blocks
            async with oai(apps) as client:
                await client.completions.create(model="tiny", prompt=prompt, max_tokens=2)
        after = (await http.get("/metrics")).text
    queries = "tokenspeed:prefix_cache_queries_total"
    hits = "tokenspeed:prefix_cache_hits_total"
    tokens = (await token_count(apps, prompt)) * 2
    assert metric(after, queries) - metric(before, queries) == tokens
    assert metric(after, hits) - metric(before, hits) >= tokens // 2 - 16
    for name in ("process_resident_memory_bytes", "process_cpu_seconds_total", "process_open_fds"):
        assert metric(after, name) > 0


ITERATIONS = "tokenspeed:iteration_tokens_total"


def iteration_histogram(text: str) -> tuple[list[tuple[float, float]], float, float]:
    """The cumulative (le, count) buckets, the sum and the count of the iteration
    histogram."""
    buckets, total, count = [], 0.0, 0.0
    for line in text.splitlines():
        value = float(line.rsplit(" ", 1)[-1]) if line.startswith(ITERATIONS) else None
        if line.startswith(f"{ITERATIONS}_bucket"):
            buckets.append((float(re.search(r'le="([^"]+)"', line)[1]), value))
        elif line.startswith(f"{ITERATIONS}_sum"):
            total = value
        elif line.startswith(f"{ITERATIONS}_count"):
            count = value
    return sorted(buckets), total, count


async def idle_metrics(http: httpx.AsyncClient, timeout: float = 10.0) -> str:
    """/metrics once no request runs or waits."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        text = (await http.get("/metrics")).text
        busy = [metric(text, f"tokenspeed:num_requests_{k}") for k in ("running", "waiting")]
        if busy == [0, 0]:
            return text
        assert loop.time() < deadline, f"running, waiting after {timeout} s: {busy}"
        await asyncio.sleep(0.05)


async def test_iteration_tokens_is_a_histogram_of_tokens_per_round(apps):
    """One request alone, 6 tokens: one prefill round of its whole prompt and five decode
    rounds of one token each, bucketed as vLLM's vllm:iteration_tokens_total."""
    prompt = "Rounds are bucketed by the tokens each one forwards, " * 2  # no other test's
    num_prompt = await token_count(apps, prompt)
    async with httpx.AsyncClient(base_url=apps["plain"]) as http:
        before = iteration_histogram(await idle_metrics(http))  # no other request's rounds
        async with oai(apps) as client:
            out = await client.completions.create(
                model="tiny", prompt=prompt, max_tokens=6, temperature=0,
                extra_body={"min_tokens": 6},
            )  # fmt: skip
        assert out.usage.completion_tokens == 6
        after = iteration_histogram((await http.get("/metrics")).text)
    (buckets0, sum0, count0), (buckets1, sum1, count1) = before, after
    assert [le for le, _ in buckets1][:-1] == [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048,
                                               4096, 8192, 16384]  # fmt: skip
    assert buckets1[-1] == (float("inf"), count1)  # every round is in the +Inf bucket
    assert count1 - count0 == 6
    assert sum1 - sum0 == num_prompt + 5
    # Cumulative buckets: the five decodes from le=1 up, the prefill from the first bound
    # at or above its prompt.
    grew = {le: b1 - b0 for (le, b1), (_, b0) in zip(buckets1, buckets0, strict=True)}
    assert grew == {le: 5 if le < num_prompt else 6 for le in grew}


def test_the_iteration_histogram_sums_the_replicas_reports():
    """Two data-parallel replicas' reports (the load reporter's buckets, the scheduler's
    rounds and tokens) render as one histogram."""
    rounds = {0: [1, 1, 30], 1: [1, 9000]}  # tokens per round, by replica
    loads = {}
    for replica, tokens in rounds.items():
        reporter = LoadReporter(replica)
        for n in tokens:
            reporter.planned(n)
        load = Load(0, 0, 0, 0, 16, forward_rounds=len(tokens), forward_tokens=sum(tokens))
        loads[replica] = (reporter.batch([], load).load, 0.0)
    frontend = types.SimpleNamespace(loads=loads, streams={}, draining=set())
    text = ServerMetrics(frontend, "m").render([], http_requests=0, http_sequences=0)[0].decode()
    buckets, total, count = iteration_histogram(text)
    cumulative = dict(buckets)
    assert (count, total) == (5, 9033)
    assert (cumulative[1], cumulative[16], cumulative[32], cumulative[8192]) == (3, 3, 4, 4)
    assert cumulative[16384] == cumulative[float("inf")] == 5


async def token_count(apps, text: str) -> int:
    async with httpx.AsyncClient(base_url=apps["plain"]) as http:
        return (await http.post("/tokenize", json={"prompt": text})).json()["count"]
