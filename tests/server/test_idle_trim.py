"""The idle trim: glibc's malloc_trim is found and runs; a trim waits for the server to
stay idle (a request that starts meanwhile cancels it), collects the cyclic garbage first,
and runs at most once per interval; and the request registry says when the server went
idle."""

from __future__ import annotations

import asyncio
import gc
import platform
import weakref

import pytest

from tokenspeed_aio.server.idle_trim import IdleTrim, libc_malloc_trim


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_glibc_malloc_trim_is_found_and_runs():
    trim = libc_malloc_trim()
    assert trim is not None
    blocks = [bytearray(256 * 1024) for _ in range(64)]  # 16 MiB on the heap, then freed
    del blocks
    assert trim() in (0, 1)


async def test_a_trim_waits_for_the_idle_delay_and_a_busy_server_cancels_it():
    calls = []
    idle = IdleTrim(trim=lambda: calls.append(1) or 1, delay=0.05, interval=0.0)
    idle.idle()
    idle.busy()  # a request came before the delay passed
    await asyncio.sleep(0.1)
    assert calls == []
    idle.idle()
    idle.idle()  # already pending: one trim
    await asyncio.sleep(0.1)
    assert calls == [1] and idle.trims == 1


async def test_a_trim_collects_the_cyclic_garbage_first():
    """What a burst leaves in reference cycles (a cancelled stream's frames, its buffers)
    is freed before the trim, not at the next collection, which an idle server never
    reaches: its allocations stop."""

    class Node:
        """An object that will refer to itself."""

    collected = []
    node = Node()
    node.self = node  # a cycle: only the collector frees it
    weakref.finalize(node, collected.append, "freed")
    del node
    seen = []
    idle = IdleTrim(trim=lambda: seen.append(list(collected)) or 1, delay=0.01)
    gc.disable()  # the test's own allocations must not trigger a collection first
    try:
        idle.idle()
        await asyncio.sleep(0.05)
    finally:
        gc.enable()
    assert seen == [["freed"]]


async def test_trims_are_at_most_one_per_interval():
    calls = []
    idle = IdleTrim(trim=lambda: calls.append(1) or 1, delay=0.01, interval=0.3)
    idle.idle()
    await asyncio.sleep(0.05)
    idle.idle()  # idle again at once: not before the interval has passed
    await asyncio.sleep(0.1)
    assert len(calls) == 1
    await asyncio.sleep(0.3)
    assert len(calls) == 2


async def test_the_registry_reports_idle_when_its_last_request_ends(start_engine):
    from tokenspeed_aio.sampling_params import SamplingParams
    from tokenspeed_aio.server.generation import Fanout, Job
    from tokenspeed_aio.server.metrics import ServerMetrics
    from tokenspeed_aio.server.request_registry import RequestRegistry

    engine = await start_engine()
    calls = []
    registry = RequestRegistry(IdleTrim(trim=lambda: calls.append(1) or 1, delay=0.01))
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    metrics = ServerMetrics(engine.frontend, "m")
    fanouts = [
        Fanout(engine.frontend, metrics, registry, f"r{i}", [Job(0, 0, f"r{i}-0", [5, 6], params)])
        for i in range(2)
    ]

    async def consume(fanout: Fanout) -> int:
        return len([out async for _, out in fanout.outputs()])

    first = asyncio.create_task(consume(fanouts[0]))
    await asyncio.sleep(0)
    assert await consume(fanouts[1]) > 0
    assert calls == []  # the first request still runs (or just ended: the delay)
    assert await first > 0
    await asyncio.sleep(0.1)
    assert calls == [1]
