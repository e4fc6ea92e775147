"""Request identity through /generate (whose ``rid`` is the engine request id): a rid
used twice at once is refused 409 while the first request completes intact and stays
abortable; a rid reused right after its request was aborted (or its client left) is
either refused 409 or served intact -- never handed the old request's tokens or
its abort, never left hanging.

The engine-level window (a rid the scheduler still holds after its output ended gets
409 until its in-flight forward commits) is covered round by round in
tests/engine/test_requests.py::test_rid_held_by_the_scheduler_gets_409_until_released.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from reliability.harness import GREEDY, run_server

PROMPT = "Request identity"


@pytest.fixture(scope="module")
def server(reliability_checkpoint, tmp_path_factory):
    with run_server(reliability_checkpoint, tmp_path_factory.mktemp("logs")) as s:
        yield s


def body(rid: str, max_new_tokens: int, stream: bool = False) -> dict:
    sp = {"max_new_tokens": max_new_tokens, **GREEDY}
    return {"text": PROMPT, "rid": rid, "sampling_params": sp, "stream": stream}


async def reference(c, n: int) -> list[int]:
    r = await c.post("/generate", json=body("reference", n))
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


async def read_stream(response) -> list[dict]:
    events = []
    async for line in response.aiter_lines():
        if line.startswith("data: {"):
            events.append(json.loads(line[6:]))
    return events


async def test_second_use_of_a_running_rid_is_409_and_the_first_completes_intact(server):
    async with server.client() as c:
        ref = await reference(c, 64)
        async with c.stream("POST", "/generate", json=body("dup", 64, stream=True)) as first:
            assert first.status_code == 200
            lines = first.aiter_lines()
            while not (await anext(lines)).startswith("data: {"):
                pass  # the first request is running
            for stream in (False, True):
                second = await c.post("/generate", json=body("dup", 4, stream))
                assert second.status_code == 409, second.text
                assert "dup" in second.json()["error"]["message"]
            events = [json.loads(line[6:]) async for line in lines if line.startswith("data: {")]
        assert events[-1]["output_ids"] == ref
        assert events[-1]["meta_info"]["finish_reason"]["type"] == "length"
        await server.wait_idle()


async def test_simultaneous_duplicate_rids_one_refused_the_other_intact_and_abortable(server):
    """Both submissions race through the HTTP layer at once, 20 times: exactly one is
    refused 409; the survivor is the one /abort_request reaches."""
    async with server.client() as c:
        for i in range(20):
            rid = f"race-{i}"
            a, b = await asyncio.gather(  # long enough to overlap: one must be refused
                c.post("/generate", json=body(rid, 64)),
                c.post("/generate", json=body(rid, 64)),
            )
            assert sorted((a.status_code, b.status_code)) == [200, 409], (a.text, b.text)
        ref = await reference(c, 8)
        for i in range(10):
            rid = f"race-abort-{i}"

            async def streamed(rid=rid):
                async with c.stream("POST", "/generate", json=body(rid, 200, True)) as r:
                    if r.status_code != 200:
                        return r.status_code, None
                    return 200, await read_stream(r)

            first, second = asyncio.create_task(streamed()), asyncio.create_task(streamed())
            done, _ = await asyncio.wait({first, second}, return_when=asyncio.FIRST_COMPLETED)
            # The loser is refused by its status, streamed or not: a stream registers its
            # request before its headers go out.
            assert next(iter(done)).result() == (409, None)
            aborted = (await c.post("/abort_request", json={"rid": rid})).json()["aborted"]
            assert aborted == [rid], "the running request must stay reachable by its rid"
            status, events = await (second if first in done else first)
            assert status == 200 and events[-1]["meta_info"]["finish_reason"]["type"] == "abort"
            assert events[-1]["output_ids"] == ref[: len(events[-1]["output_ids"])]
        await server.wait_idle()


async def retry_until_served(c, rid: str, seconds: float = 10.0):
    """Once the old request is gone from every owner, the rid is usable again."""
    deadline = asyncio.get_running_loop().time() + seconds
    while True:
        response = await c.post("/generate", json=body(rid, 12))
        if response.status_code != 409 or asyncio.get_running_loop().time() > deadline:
            return response
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("end", ["abort_request", "disconnect"])
async def test_rid_reused_right_after_its_abort_is_409_or_served_intact(server, end):
    async with server.client() as c:
        ref = await reference(c, 12)
        refused = 0
        for i in range(40):
            rid = f"reuse-{end}-{i}"
            async with c.stream("POST", "/generate", json=body(rid, 200, True)) as r:
                lines = r.aiter_lines()
                while not (await anext(lines)).startswith("data: {"):
                    pass
                if end == "abort_request":
                    assert (await c.post("/abort_request", json={"rid": rid})).status_code == 200
            # reuse at once, while the engine may still hold the old request
            reuse = await asyncio.wait_for(c.post("/generate", json=body(rid, 12)), 30)
            if reuse.status_code == 409:
                refused += 1
                reuse = await retry_until_served(c, rid)
            assert reuse.status_code == 200, reuse.text
            out = reuse.json()
            assert out["meta_info"]["finish_reason"]["type"] == "length", out
            assert out["output_ids"] == ref
        print(f"reliability: rid-reuse-{end} reused=40 first_try_409={refused} all_served_intact")
        await server.wait_idle()
