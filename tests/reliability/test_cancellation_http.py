"""Clients that leave at random points never leak: after 500 requests abandoned
before their first token, mid-stream, right after their finish, by tiny client
timeouts and by /abort_request (by rid, and now and then abort_all), the engine's
running/waiting counts and active KV blocks are back to zero (read from /metrics)
and it still answers a greedy probe as before."""

from __future__ import annotations

import asyncio

import pytest
from helpers.workload import run_workload

from reliability.harness import GREEDY, run_server

REQUESTS = 500
CONCURRENCY = 24


@pytest.fixture(scope="module")
def server(reliability_checkpoint, tmp_path_factory):
    with run_server(reliability_checkpoint, tmp_path_factory.mktemp("logs")) as s:
        yield s


async def test_500_randomly_cancelled_requests_leave_no_request_or_block_held(server):
    probe = {"prompt": "The for statement", "max_tokens": 12, **GREEDY}
    async with server.client(timeout=120) as c:
        before = (await c.post("/v1/completions", json=probe)).json()["choices"][0]["text"]
        workload = asyncio.create_task(
            run_workload(c, requests=REQUESTS, concurrency=CONCURRENCY, seed=7)
        )
        aborted_all = 0
        while not workload.done():  # now and then, POST /abort_request {"abort_all": true}
            await asyncio.sleep(0.5)
            r = await c.post("/abort_request", json={"abort_all": True})
            assert r.status_code == 200, r.text
            aborted_all += len(r.json()["aborted"])
        tally = await workload
        idle = await server.wait_idle()
        after = await c.post("/v1/completions", json=probe)
        health = await c.get("/health")
    print(f"reliability: cancellation-http sent={tally.sent} actions={dict(tally.actions)} "
          f"outcomes={dict(tally.outcomes)} aborted_by_abort_all={aborted_all} "
          f"kv_blocks_active={idle['tokenspeed:kv_blocks_active']}")  # fmt: skip
    assert tally.errors == []
    assert tally.sent == REQUESTS
    cancelled = tally.outcomes["cancelled"] + tally.outcomes["aborted"]
    assert cancelled >= REQUESTS // 3 and tally.outcomes["completed"] >= REQUESTS // 5
    assert idle["tokenspeed:kv_blocks_active"] == 0
    assert health.status_code == 200
    assert after.status_code == 200 and after.json()["choices"][0]["text"] == before
