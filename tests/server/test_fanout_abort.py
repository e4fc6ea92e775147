"""An abort that lands between a request's start and its choice tasks' first step
still ends the merged stream (a task cancelled before it runs executes none of its
code, so the fanout itself must produce that choice's final output)."""

from __future__ import annotations

import asyncio

from tokenspeed_aio.sampling_params import SamplingParams
from tokenspeed_aio.server.generation import Fanout, Job
from tokenspeed_aio.server.metrics import ServerMetrics
from tokenspeed_aio.server.request_registry import RequestRegistry


async def test_abort_before_the_choice_runs_ends_the_stream(start_engine):
    engine = await start_engine()
    params = SamplingParams(max_tokens=50, temperature=0.0)
    jobs = [Job(i, 0, f"req-{i}", [5, 6, 7], params) for i in range(2)]
    fanout = Fanout(
        engine.frontend, ServerMetrics(engine.frontend, "m"), RequestRegistry(), "req", jobs
    )
    outputs = fanout.outputs()
    first = asyncio.ensure_future(outputs.__anext__())
    await asyncio.sleep(0)  # outputs() created the choice tasks; none has run yet
    assert sorted(fanout.abort()) == ["req-0", "req-1"]
    finals = [await asyncio.wait_for(first, 5), await asyncio.wait_for(outputs.__anext__(), 5)]
    assert {(job.rid, out.finish_reason) for job, out in finals} == {
        ("req-0", "abort"),
        ("req-1", "abort"),
    }
    await outputs.aclose()
