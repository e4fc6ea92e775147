"""Delta outputs and the streaming fan-out's byte backlog.

A ``delta`` stream's outputs, concatenated, are the ``cumulative`` stream's last output
(tokens, text, logprobs), while the frontend keeps none of its tokens. ``Fanout.events``
renders each delta output to bytes as it arrives; a consumer that stops taking them
past the bound gets a StreamBacklogError and every choice is aborted."""

from __future__ import annotations

import asyncio
import json

import pytest

from tokenspeed_aio.sampling_params import SamplingParams
from tokenspeed_aio.server.generation import Fanout, Job, StreamBacklogError
from tokenspeed_aio.server.metrics import ServerMetrics
from tokenspeed_aio.server.request_registry import RequestRegistry

PROMPT = [5, 6, 7, 8]
PARAMS = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)


async def run(engine, kind: str, rid: str) -> list:
    stream = engine.generate(
        prompt_token_ids=PROMPT, sampling_params=PARAMS, rid=rid, output_kind=kind
    )
    return [out async for out in stream]


async def test_delta_outputs_add_up_to_the_cumulative_ones(start_engine):
    engine = await start_engine()
    cumulative = await run(engine, "cumulative", "c")
    delta = await run(engine, "delta", "d")
    last = cumulative[-1]
    assert len(delta) > 1  # streamed in several outputs
    assert [t for out in delta for t in out.token_ids] == last.token_ids
    assert "".join(out.text for out in delta) == last.text
    assert [lp for out in delta for lp in out.logprobs] == last.logprobs
    assert all(out.token_ids == out.delta_token_ids for out in delta)
    assert [out.num_tokens for out in delta][-1] == len(last.token_ids) == 24
    assert engine.frontend.streams == {}  # both ended and were dropped


async def test_an_unknown_output_kind_is_refused_before_submission(start_engine):
    engine = await start_engine()
    with pytest.raises(ValueError, match="output_kind: 'final' is not one of"):
        await run(engine, "final", "x")
    assert engine.frontend.streams == {}


def fanout_of(
    engine, n: int, max_backlog: int, max_tokens: int, registry: RequestRegistry | None = None
) -> Fanout:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    jobs = [Job(i, 0, f"req-{i}", PROMPT, params) for i in range(n)]
    metrics = ServerMetrics(engine.frontend, "m")
    registry = registry if registry is not None else RequestRegistry()
    return Fanout(engine.frontend, metrics, registry, "req", jobs, max_backlog)


def render(job: Job, out) -> bytes:
    return json.dumps([job.index, out.token_ids, out.finished]).encode() + b"\n"


async def test_events_carry_every_choice_in_order(start_engine):
    engine = await start_engine()
    fanout = fanout_of(engine, 3, max_backlog=512, max_tokens=12)
    data = b"".join([chunk async for chunk in fanout.events(render)])
    records = [json.loads(line) for line in data.splitlines()]
    reference = (await run(engine, "cumulative", "ref"))[-1].token_ids[:12]
    for i in range(3):
        mine = [r for r in records if r[0] == i]
        assert [t for r in mine for t in r[1]] == reference
        assert [r[2] for r in mine] == [False] * (len(mine) - 1) + [True]


async def test_a_consumer_that_stops_taking_events_is_cut_off(start_engine):
    engine = await start_engine()
    registry = RequestRegistry()
    fanout = fanout_of(engine, 4, max_backlog=6, max_tokens=200, registry=registry)
    events = fanout.events(render)
    first = await events.__anext__()  # what came first; then it stops reading
    assert (registry.requests, registry.sequences) == (1, 4)
    # 200 tokens a choice cannot end with 6 undelivered at most: idle means aborted.
    await engine.wait_idle(60)
    # Aborted, it no longer counts against admission, though its client has not read.
    assert (registry.requests, registry.sequences) == (0, 0)
    with pytest.raises(StreamBacklogError, match="--max-stream-backlog"):
        await asyncio.wait_for(events.__anext__(), 10)
    await events.aclose()
    assert b"false" in first  # a choice's first output, not its end


async def test_a_request_whose_choices_all_ended_leaves_the_registry_before_it_is_read(
    start_engine,
):
    """Unread output holds no sequence: the request's ids and its admission room are free
    once every choice ended, and its bytes are still delivered."""
    engine = await start_engine()
    registry = RequestRegistry()
    fanout = fanout_of(engine, 2, max_backlog=512, max_tokens=8, registry=registry)
    events = fanout.events(render)
    first = await events.__anext__()
    await engine.wait_idle(60)
    assert (registry.requests, registry.sequences) == (0, 0)
    assert not registry.running("req") and not registry.running("req-0")
    data = first + b"".join([chunk async for chunk in events])
    finished = [json.loads(line)[2] for line in data.splitlines()]
    assert finished.count(True) == 2


async def test_a_stream_holds_its_ids_before_its_headers_and_frees_them_unstarted(start_engine):
    # The streamed response registers its request when it is made, so a second request with
    # one of its ids is refused before any header went out; a client gone while its headers
    # were still being written (the events never started) leaves the ids free once the
    # response is done, and nothing was submitted.
    from tokenspeed_aio.errors import RequestConflictError
    from tokenspeed_aio.server.openai_common import stream_response

    engine = await start_engine()
    registry = RequestRegistry()
    fanout = fanout_of(engine, 2, max_backlog=512, max_tokens=8, registry=registry)
    response = stream_response(fanout, fanout.events(render))
    assert registry.running("req") and registry.running("req-1")
    other = fanout_of(engine, 2, max_backlog=512, max_tokens=8, registry=registry)
    with pytest.raises(RequestConflictError, match="is already running"):
        stream_response(other, other.events(render))
    assert (registry.requests, registry.sequences) == (1, 2)

    async def receive():
        return {"type": "http.disconnect"}

    async def send(message):
        await asyncio.Event().wait()  # a socket that takes nothing, not even the headers

    await asyncio.wait_for(response({"type": "http"}, receive, send), 10)
    assert (registry.requests, registry.sequences) == (0, 0)
    assert engine.frontend.streams == {}


async def test_a_stream_aborted_before_its_events_started_ends_with_its_abort(start_engine):
    # A registered stream (its headers not yet out) can be reached by /abort_request before
    # its events start: its choices end as aborted, and the stream then renders those ends
    # and finishes instead of waiting for outputs that will never come.
    from tokenspeed_aio.server.openai_common import stream_response

    engine = await start_engine()
    registry = RequestRegistry()
    fanout = fanout_of(engine, 2, max_backlog=512, max_tokens=8, registry=registry)
    events = fanout.events(render)
    stream_response(fanout, events)
    assert sorted(registry.abort_all()) == ["req-0", "req-1"]
    data = b"".join([chunk async for chunk in _bounded(events, 10)])
    records = [json.loads(line) for line in data.splitlines()]
    assert sorted((r[0], r[1], r[2]) for r in records) == [(0, [], True), (1, [], True)]
    assert (registry.requests, registry.sequences) == (0, 0)
    assert engine.frontend.streams == {}


async def _bounded(source, seconds: float):
    deadline = asyncio.get_running_loop().time() + seconds
    while True:
        try:
            yield await asyncio.wait_for(
                anext(source), deadline - asyncio.get_running_loop().time()
            )
        except StopAsyncIteration:
            return
