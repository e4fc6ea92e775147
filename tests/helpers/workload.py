"""Random client behaviour against a running server: requests on every generating
route, streamed or not, that their clients abandon at random points. Shared by the
cancellation, soak and fault tests; every request is tallied by what happened to
it, so a test can state how many were cancelled where and how many completed."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
from collections import Counter
from dataclasses import dataclass, field

import httpx

ROUTES = ("/v1/completions", "/v1/chat/completions", "/generate")
# How a client ends its request:
#   complete      read the whole response (and check it is well formed)
#   timeout       non-streaming, with a tiny client timeout (0.5 ms .. 150 ms)
#   before_first  streaming; close once the headers arrived, before any token
#   mid_stream    streaming; close after 1..6 events
#   after_finish  streaming; close right after the event with the finish reason,
#                 before the final [DONE]
#   abort_route   streaming /generate with a rid, ended with POST /abort_request
ACTIONS = ("complete", "timeout", "before_first", "mid_stream", "after_finish", "abort_route")
WEIGHTS = (3, 2, 2, 3, 2, 1)
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


@dataclass
class Tally:
    """What happened to every request a workload sent."""

    actions: Counter = field(default_factory=Counter)  # by action
    outcomes: Counter = field(default_factory=Counter)  # completed / cancelled / ...
    errors: list[str] = field(default_factory=list)  # anything unexpected (must stay empty)

    @property
    def sent(self) -> int:
        return sum(self.actions.values())

    def merge(self, other: Tally) -> None:
        self.actions.update(other.actions)
        self.outcomes.update(other.outcomes)
        self.errors.extend(other.errors)


def request_body(
    route: str, rng: random.Random, *, stream: bool, structured: bool = False, model: str | None
):
    """A valid body for ``route``: a short random prompt, 1..48 new tokens, greedy or
    sampled, sometimes n=2 (completions/chat) or a json_schema (structured); naming
    ``model`` where given (a gateway needs it)."""
    words = " ".join(rng.choice(("alpha", "beta", "for", "while", "def", "class", "x"))
                     for _ in range(rng.randint(1, 24)))  # fmt: skip
    max_tokens = rng.randint(1, 48)
    sampling = {"temperature": rng.choice((0.0, 0.7, 1.0)), "ignore_eos": rng.random() < 0.7}
    if route == "/generate":
        sp = {"max_new_tokens": max_tokens, **sampling}
        if structured:
            sp["json_schema"] = json.dumps(SCHEMA)
        return {"text": words, "sampling_params": sp, "stream": stream}
    body = {"max_tokens": max_tokens, "stream": stream, **sampling}
    if model is not None:
        body["model"] = model
    if rng.random() < 0.15:
        body["n"] = 2
    if structured:
        body["response_format"] = {"type": "json_schema", "json_schema": {"schema": SCHEMA}}
    if route == "/v1/completions":
        body["prompt"] = words
    else:
        body["messages"] = [{"role": "user", "content": words}]
    return body


def finish_seen(route: str, data: dict) -> bool:
    """Whether an SSE event's payload carries a finish reason."""
    if route == "/generate":
        return (data.get("meta_info") or {}).get("finish_reason") is not None
    return any(c.get("finish_reason") for c in data.get("choices", ()))


async def one_request(
    client: httpx.AsyncClient,
    rng: random.Random,
    tally: Tally,
    *,
    rid_prefix: str,
    structured: bool = False,
    model: str | None = None,
    abort_route: bool = True,
) -> None:
    """Send one request and end it as a random action says (``abort_route`` False: never
    by ``/abort_request``, which a gateway does not route); record the outcome."""
    action = rng.choices(ACTIONS, WEIGHTS if abort_route else (*WEIGHTS[:-1], 0))[0]
    route = "/generate" if action == "abort_route" else rng.choice(ROUTES)
    stream = action not in ("complete", "timeout") or rng.random() < 0.5
    body = request_body(route, rng, stream=stream, structured=structured, model=model)
    tally.actions[action] += 1
    try:
        if not stream:
            timeout = rng.uniform(0.0005, 0.15) if action == "timeout" else 120
            try:
                response = await client.post(route, json=body, timeout=timeout)
            except httpx.TimeoutException:
                tally.outcomes["cancelled"] += 1
                return
            if response.status_code == 200:
                tally.outcomes["completed"] += 1
            _expect_ok(response.status_code, response.text, tally, route)
            return
        if action == "abort_route":
            body["rid"] = f"{rid_prefix}-abort"
            await _abort_via_route(client, route, body, rng, tally)
            return
        await _stream(client, route, body, action, rng, tally)
    except httpx.TransportError as exc:
        tally.errors.append(f"{action} {route}: transport error {exc!r}")


async def _stream(client, route, body, action, rng, tally) -> None:
    budget = rng.randint(1, 6)
    events = 0
    async with client.stream("POST", route, json=body) as response:
        if response.status_code != 200:
            _expect_ok(response.status_code, (await response.aread()).decode(), tally, route)
            return
        if action == "before_first":
            tally.outcomes["cancelled"] += 1
            return  # leaving the block closes the connection
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                tally.outcomes["completed"] += 1
                return
            data = json.loads(line[6:])
            if "error" in data:
                tally.errors.append(f"{action} {route}: error event {data['error']}")
                return
            events += 1
            if action == "mid_stream" and events >= budget:
                tally.outcomes["cancelled"] += 1
                return
            if action == "after_finish" and finish_seen(route, data):
                tally.outcomes["cancelled_after_finish"] += 1
                return
    tally.errors.append(f"{action} {route}: the stream ended without [DONE]")


async def _abort_via_route(client, route, body, rng, tally) -> None:
    async with client.stream("POST", route, json=body) as response:
        if response.status_code != 200:
            _expect_ok(response.status_code, (await response.aread()).decode(), tally, route)
            return
        lines = response.aiter_lines()
        if rng.random() < 0.7:  # otherwise abort before reading anything
            with contextlib.suppress(StopAsyncIteration):
                await anext(lines)
        aborted = await client.post("/abort_request", json={"rid": body["rid"]})
        _expect_ok(aborted.status_code, aborted.text, tally, "/abort_request")
        async for line in lines:
            if line.startswith("data: {") and '"error"' in line[:20]:
                tally.errors.append(f"abort_route: error event {line}")
    tally.outcomes["aborted"] += 1


def _expect_ok(status: int, text: str, tally: Tally, route: str) -> None:
    if status != 200:
        tally.errors.append(f"{route}: HTTP {status}: {text[:300]}")


async def run_workload(
    client: httpx.AsyncClient,
    *,
    requests: int,
    concurrency: int,
    seed: int,
    structured_every: int = 0,
    model: str | None = None,
    abort_route: bool = True,
) -> Tally:
    """``requests`` random requests, ``concurrency`` at a time."""
    tally = Tally()
    rng = random.Random(seed)
    seeds = [rng.getrandbits(32) for _ in range(requests)]
    gate = asyncio.Semaphore(concurrency)

    async def worker(i: int) -> None:
        async with gate:
            structured = bool(structured_every) and i % structured_every == 0
            await one_request(
                client, random.Random(seeds[i]), tally, rid_prefix=f"w{seed}-{i}",
                structured=structured, model=model, abort_route=abort_route,
            )  # fmt: skip

    await asyncio.gather(*(worker(i) for i in range(requests)))
    return tally
