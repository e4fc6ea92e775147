"""Soak: two minutes of a bounded request loop -- every route, streamed or not, clients
that leave at random points, /abort_request, structured output with json_schema
(some schemas repeated, some new each time) -- after a warm-up. The resident memory
of the server's processes (frontend + rank, via psutil) must stay within a bound of
its post-warm-up value, no request may fail unexpectedly, and the engine must end
idle."""

from __future__ import annotations

import asyncio
import json
import random
import time

import pytest
from helpers.workload import Tally, run_workload

from reliability.harness import run_server

WARMUP_SECONDS = 15
SOAK_SECONDS = 120
RSS_GROWTH_LIMIT = 50 * 2**20
BATCH = 60  # requests per loop iteration (bounded: at most CONCURRENCY at once)
CONCURRENCY = 16


@pytest.fixture(scope="module")
def server(reliability_checkpoint, tmp_path_factory):
    with run_server(reliability_checkpoint, tmp_path_factory.mktemp("logs")) as s:
        yield s


async def fresh_schemas(c, rng: random.Random, n: int, tally: Tally) -> None:
    """Structured requests whose schema is new each time (a client that templates
    field names into it): every one is a grammar the engine has not seen."""
    for _ in range(n):
        fields = {f"f{rng.getrandbits(40):x}": {"type": rng.choice(["string", "integer"])}
                  for _ in range(4)}  # fmt: skip
        schema = {"type": "object", "properties": fields, "required": list(fields)}
        body = {"text": "JSON:", "sampling_params": {"max_new_tokens": 8,
                "json_schema": json.dumps(schema), "temperature": 0.0}}  # fmt: skip
        r = await c.post("/generate", json=body)
        tally.actions["fresh_schema"] += 1
        if r.status_code != 200:
            tally.errors.append(f"fresh schema: HTTP {r.status_code}: {r.text[:200]}")
        else:
            tally.outcomes["completed"] += 1


async def loop_for(server, c, seconds: float, seed: int) -> tuple[Tally, list[int]]:
    tally, samples = Tally(), []
    rng = random.Random(seed)
    deadline = time.monotonic() + seconds
    i = 0
    while time.monotonic() < deadline:
        part, _ = await asyncio.gather(
            run_workload(c, requests=BATCH, concurrency=CONCURRENCY, seed=seed * 1000 + i,
                         structured_every=5),
            fresh_schemas(c, rng, 10, tally),
        )  # fmt: skip
        tally.merge(part)
        samples.append(server.rss())
        i += 1
    return tally, samples


@pytest.mark.slow
async def test_two_minutes_of_mixed_traffic_keep_memory_bounded_and_lose_nothing(server):
    async with server.client(timeout=120) as c:
        warm, _ = await loop_for(server, c, WARMUP_SECONDS, seed=1)
        await server.wait_idle()
        baseline = server.rss()
        start = time.monotonic()
        tally, samples = await loop_for(server, c, SOAK_SECONDS, seed=2)
        elapsed = time.monotonic() - start
        idle = await server.wait_idle()
        final = server.rss()
    growth = max([*samples, final]) - baseline
    mib = 2**20
    print(f"reliability: soak seconds={elapsed:.0f} sent={tally.sent} "
          f"actions={dict(tally.actions)} outcomes={dict(tally.outcomes)} "
          f"rss_baseline={baseline / mib:.1f}MiB rss_final={final / mib:.1f}MiB "
          f"rss_max_growth={growth / mib:.1f}MiB rss_samples={len(samples)} "
          f"rss_every_10th={[round(s / mib) for s in samples[::10]]}")  # fmt: skip
    assert warm.errors == [] and tally.errors == [], (warm.errors + tally.errors)[:10]
    assert elapsed >= SOAK_SECONDS
    assert tally.outcomes["completed"] > 0 and tally.outcomes["cancelled"] > 0
    assert idle["tokenspeed:kv_blocks_active"] == 0
    assert growth < RSS_GROWTH_LIMIT, f"RSS grew {growth / mib:.1f} MiB after warm-up"
