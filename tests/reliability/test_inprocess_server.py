"""A server whose engine runs in this process (real uvicorn, real HTTP), so tests can
look inside it:

* the cancellation workload again, with a leak check that reaches every owner of
  request state: the frontend's streams, the HTTP layer's request registry and tasks,
  the output processor, the scheduler and the block pool (``AsyncEngine.check_idle()``);
* the same through the Python API: ``AsyncEngine.generate()`` consumers cancelled at
  random points, and rids reused right after their abort;
* the frontend's internal-error path, forced: a 500 (or an error event) naming the
  request id, with no traceback for the client and the traceback in the log.
"""

from __future__ import annotations

import asyncio
import json
import random
import re

import pytest
from helpers.workload import run_workload

from reliability.harness import GREEDY, run_thread_server
from tokenspeed_aio.sampling_params import SamplingParams

REQUESTS = 500


@pytest.fixture(scope="module")
def served(reliability_checkpoint):
    with run_thread_server(reliability_checkpoint, in_flight_depth=1) as pair:
        yield pair


async def held_state(engine, app) -> dict[str, int]:
    """Everything that holds a request, after waiting for the engine to go idle."""
    await engine.wait_idle()
    await asyncio.sleep(0.2)  # let cancelled HTTP tasks finish unwinding
    await engine.check_idle()  # raises naming what is held
    loop = engine.control_loop
    return {
        "frontend_streams": len(engine.frontend.streams),
        "frontend_draining": len(engine.frontend.draining),
        "http_registry": len(app.state.context.registry._by_id),  # no public count
        "output_owned": len(loop.output._states),
        "scheduler_requests": len(loop.scheduler.requests),
        "active_blocks": loop.scheduler.pool.num_active,
        "tasks": len(asyncio.all_tasks()),
    }


async def test_http_cancellations_leave_no_state_in_any_owner(served):
    server, thread = served
    baseline = thread.call(held_state, thread.engine, thread.app)
    async with server.client(timeout=120) as c:
        tally = await run_workload(c, requests=REQUESTS, concurrency=24, seed=11)
    held = thread.call(held_state, thread.engine, thread.app)
    print(f"reliability: cancellation-inprocess-http sent={tally.sent} "
          f"outcomes={dict(tally.outcomes)} held={held}")  # fmt: skip
    assert tally.errors == []
    assert tally.outcomes["cancelled"] + tally.outcomes["aborted"] >= REQUESTS // 3
    assert held == {**baseline, "tasks": held["tasks"]}
    assert held["tasks"] <= baseline["tasks"], "request tasks outlived their requests"


async def cancel_consumers(engine, n: int, seed: int) -> dict[str, int]:
    """n generate() consumers, each cancelled before its first output, after k
    outputs, or right after its final one -- or left to finish."""
    rng = random.Random(seed)
    counts = {"before_first": 0, "after_k": 0, "after_final": 0, "finished": 0}

    async def consume(i: int, mode: str, k: int, gate: asyncio.Event) -> None:
        params = SamplingParams(max_tokens=rng.randint(1, 40), **GREEDY)
        ids = [rng.randrange(5, 500) for _ in range(rng.randint(1, 60))]
        seen = 0
        async for out in engine.generate(prompt_token_ids=ids, sampling_params=params):
            seen += 1
            if (mode == "after_k" and seen >= k) or (mode == "after_final" and out.finished):
                gate.set()
                await asyncio.sleep(3600)  # cancelled here, holding the stream open
        gate.set()

    async def one(i: int) -> None:
        mode = rng.choice(list(counts))
        gate = asyncio.Event()
        task = asyncio.create_task(consume(i, mode, rng.randint(1, 8), gate))
        if mode == "before_first":
            await asyncio.sleep(0)  # submitted, nothing received yet
        else:
            await gate.wait()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        counts[mode] += 1

    sem = asyncio.Semaphore(32)

    async def gated(i: int) -> None:
        async with sem:
            await one(i)

    await asyncio.gather(*(gated(i) for i in range(n)))
    return counts


async def test_cancelled_generate_consumers_leave_no_state(served):
    _, thread = served
    counts = thread.call(cancel_consumers, thread.engine, REQUESTS, 3, timeout=300)
    held = thread.call(held_state, thread.engine, thread.app)
    print(f"reliability: cancellation-inprocess-api counts={counts} held={held}")
    assert sum(counts.values()) == REQUESTS and min(counts.values()) > 0
    assert held["active_blocks"] == 0 and held["scheduler_requests"] == 0


async def reuse_after_abort(engine, rounds: int) -> dict[str, int]:
    """Abort a running request and resubmit its rid at once, ``rounds`` times: each
    reuse is refused (RequestConflictError) or yields exactly the reference tokens."""
    from tokenspeed_aio.errors import RequestConflictError

    params = SamplingParams(max_tokens=6, **GREEDY)
    ids = [5, 6, 7, 8]

    async def run(rid: str) -> list[int]:
        outputs = [
            o async for o in engine.generate(prompt_token_ids=ids, sampling_params=params, rid=rid)
        ]
        return outputs[-1].token_ids

    ref = await run("reference")
    counts = {"refused": 0, "served": 0}
    long = SamplingParams(max_tokens=200, **GREEDY)
    for i in range(rounds):
        rid = f"reuse-{i}"
        stream = engine.generate(prompt_token_ids=ids, sampling_params=long, rid=rid)
        for _ in range(i % 3):
            await anext(stream)
        await stream.aclose()  # an abort, at once or after a few tokens
        try:
            got = await run(rid)
        except RequestConflictError:
            counts["refused"] += 1
            continue
        assert got == ref, (rid, got, ref)
        counts["served"] += 1
    return counts


async def test_a_rid_reused_after_its_abort_gets_409_or_its_own_tokens(served):
    _, thread = served
    counts = thread.call(reuse_after_abort, thread.engine, 100)
    held = thread.call(held_state, thread.engine, thread.app)
    print(f"reliability: rid-reuse-api {counts}")
    assert counts["refused"] + counts["served"] == 100 and counts["refused"] > 0
    assert held["frontend_streams"] == 0 and held["scheduler_requests"] == 0


@pytest.mark.parametrize("stream", [False, True])
async def test_an_internal_error_is_a_500_with_the_request_id_and_no_traceback(
    served, caplog, stream
):
    """The frontend raises an unexpected exception while serving a request (forced by
    replacing its submit with one that fails)."""
    server, thread = served
    frontend = thread.engine.frontend

    def broken(*args, **kwargs):
        raise RuntimeError("secret internal detail")

    frontend.submit = broken
    try:
        async with server.client() as c:
            body = {"prompt": "a", "max_tokens": 3, "stream": stream}
            r = await c.post("/v1/completions", json=body, headers={"x-request-id": "req-42"})
    finally:
        del frontend.submit
    if stream:  # the headers were out: the failure is the stream's last event
        assert r.status_code == 200
        events = [line for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        error = json.loads(events[-2][6:])["error"]
    else:
        assert r.status_code == 500
        error = r.json()["error"]
    assert error["type"] == "server_error" and "see the server log" in error["message"]
    # Non-streamed, the guard names the client's x-request-id; streamed, the stream
    # names its response id (cmpl-...), which is also what its log line carries.
    request_id = re.search(r"request id ([^)]+)\)", error["message"])[1]
    assert request_id == "req-42" if not stream else request_id.startswith("cmpl-")
    assert r.headers["x-request-id"] == "req-42"
    assert "secret" not in r.text and "Traceback" not in r.text and 'File "' not in r.text
    assert "secret internal detail" in caplog.text and request_id in caplog.text
    async with server.client() as c:  # and the server still serves
        ok = await c.post("/v1/completions", json={"prompt": "a", "max_tokens": 2})
    assert ok.status_code == 200
