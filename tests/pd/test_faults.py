"""Cancellation and faults of disaggregated transfers, through the real gateway: what a
client cancels (mid-transfer, or 500 times at random points) leaves no page held and no
room stuck on either engine; a prefill engine SIGKILLed mid-transfer fails its requests
on the decode side within the timeout while the decode engine keeps serving; a decode
engine that dies releases the prefill engine's source pages."""

from __future__ import annotations

import asyncio
import contextlib
import random
import signal
import time

import httpx
import psutil
import pytest

from pd.harness import (
    BOOTSTRAP_TIMEOUT,
    MODEL,
    WRITE_DELAY,
    scrape,
    start_gateway,
    wait_clean,
)
from pd.workload import GREEDY, PROMPTS, completion

# The deployment's engines start once, inside the first test's setup.
pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def slow_prefill(deployment):
    """P-slow, whose writes start WRITE_DELAY late (so transfers are in flight long
    enough to cancel or kill), with a gateway pairing it with D1."""
    engine = deployment.engines["P-slow"]
    gateway = start_gateway(
        deployment.logs, "gw-slow", prefill=[engine], decode=[deployment.engines["D1"]]
    )
    yield engine, gateway
    gateway.stop()


def in_flight(engine) -> float:
    return scrape(engine.url).get("tokenspeed:pd_rooms_in_flight", 0)


def wait_in_flight(engine, n: int = 1, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while in_flight(engine) < n:
        assert time.monotonic() < deadline, "no transfer went in flight"
        time.sleep(0.05)


async def _stream(url: str) -> None:
    body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 32, "stream": True, **GREEDY}
    async with (
        httpx.AsyncClient(timeout=60) as client,
        client.stream("POST", f"{url}/v1/completions", json=body) as response,
    ):
        async for _ in response.aiter_lines():
            pass


def test_a_client_cancelling_mid_transfer_leaves_nothing_held(deployment, slow_prefill):
    prefill, gateway = slow_prefill
    decode = deployment.engines["D1"]

    async def run() -> float:
        # (the gateway answers a stream only once the prefill engine's half ended)
        task = asyncio.create_task(_stream(gateway.url))
        await asyncio.to_thread(wait_in_flight, decode)  # the decode waits for its KV
        await asyncio.to_thread(wait_in_flight, prefill)
        seen = time.monotonic()  # the write starts after this, once the prompt's forward ran
        # The tiny prompt's forward takes milliseconds: a second later its write is
        # executing (its WRITE_DELAY first), so the client leaves mid-write. A cancel that
        # came before the write started would rightly retire the room at once.
        await asyncio.sleep(1.0)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return seen

    seen = asyncio.run(run())
    while in_flight(decode):  # its landing pages wait for the executing write to retire
        time.sleep(0.05)
    assert time.monotonic() - seen > WRITE_DELAY - 0.5, "retired before the write returned"
    wait_clean([prefill, decode], timeout=WRITE_DELAY + 8)  # well before the rooms' timeout
    cancelled = '{outcome="cancelled",role="decode"}'
    assert scrape(decode.url)[f"tokenspeed:pd_transfers_total{cancelled}"] >= 1


def test_500_random_cancellations_leave_nothing_held(deployment, slow_prefill):
    """Requests through the gateway, each abandoned at a random point (before, during or
    after its transfer, mid-decode) or left to finish; one in ten goes through the slow
    prefill engine, so its cancellations land while writes execute."""
    fast, slow = deployment.gateways["1p1d"].url, slow_prefill[1].url
    rng = random.Random(1234)

    async def one(client: httpx.AsyncClient, i: int) -> None:
        url, patience = (slow, WRITE_DELAY + 1) if i % 10 == 0 else (fast, 0.4)
        stream = rng.random() < 0.5
        body = {
            "model": MODEL,
            "prompt": PROMPTS[i % len(PROMPTS)] + f" {i}",
            "max_tokens": rng.randint(1, 24),
            "stream": stream,
            **GREEDY,
        }
        route = "/v1/completions"
        if rng.random() < 0.3:
            route = "/v1/chat/completions"
            body["messages"] = [{"role": "user", "content": body.pop("prompt")}]

        async def request() -> None:
            if stream:
                async with client.stream("POST", f"{url}{route}", json=body) as r:
                    async for _ in r.aiter_lines():
                        pass
            else:
                await client.post(f"{url}{route}", json=body)

        with contextlib.suppress(asyncio.TimeoutError, httpx.HTTPError):
            await asyncio.wait_for(request(), timeout=rng.uniform(0.0, patience))

    async def run() -> None:
        limits = httpx.Limits(max_connections=32)
        async with httpx.AsyncClient(timeout=60, limits=limits) as client:
            gate = asyncio.Semaphore(32)

            async def bounded(i: int) -> None:
                async with gate:
                    await one(client, i)

            await asyncio.gather(*(bounded(i) for i in range(500)))

    asyncio.run(run())
    engines = [deployment.engines["P1"], deployment.engines["D1"], slow_prefill[0]]
    wait_clean(engines, timeout=60)
    assert completion(fast, PROMPTS[0]).status_code == 200  # and they serve on as before
    wait_clean(engines)


def _kill_tree(engine) -> list[psutil.Process]:
    procs = engine.tree()
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.send_signal(signal.SIGKILL)
    return procs


def test_a_dead_decode_engine_releases_the_prefill_sources(deployment, slow_prefill):
    prefill, decode = slow_prefill[0], deployment.engines["D-dies"]
    gateway = start_gateway(deployment.logs, "gw-dies", prefill=[prefill], decode=[decode])
    try:

        async def run() -> None:
            body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 8, **GREEDY}
            # (the gateway retries a failed pair for a while: the client does not wait)
            async with httpx.AsyncClient(timeout=WRITE_DELAY + 5) as client:
                task = asyncio.create_task(client.post(f"{gateway.url}/v1/completions", json=body))
                await asyncio.to_thread(wait_in_flight, prefill)  # its source pages are held
                procs = _kill_tree(decode)
                _, alive = await asyncio.to_thread(psutil.wait_procs, procs, 10)
                assert not alive, f"orphan processes: {alive}"
                with contextlib.suppress(httpx.HTTPError):
                    await task

        asyncio.run(run())
        # its connection is gone and the executing write returned: the sources are freed
        wait_clean([prefill], timeout=WRITE_DELAY + 20)
    finally:
        gateway.stop()


def test_sigkill_of_the_prefill_engine_fails_its_transfers_and_decode_serves_on(
    deployment, slow_prefill
):
    prefill, gateway = slow_prefill
    decode = deployment.engines["D1"]
    timeout = BOOTSTRAP_TIMEOUT

    async def run() -> list:
        async with httpx.AsyncClient(timeout=60) as client:
            body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 8, **GREEDY}
            tasks = [
                asyncio.create_task(client.post(f"{gateway.url}/v1/completions", json=body))
                for _ in range(3)
            ]
            await asyncio.to_thread(wait_in_flight, decode, 3)
            killed = time.monotonic()
            procs = _kill_tree(prefill)
            results = await asyncio.gather(*tasks, return_exceptions=True)
            elapsed = time.monotonic() - killed
            _, alive = await asyncio.to_thread(psutil.wait_procs, procs, 10)
            assert not alive, f"orphan processes: {alive}"
            assert elapsed < timeout, elapsed
            return results

    results = asyncio.run(run())
    for result in results:  # each failed, with an error naming the lost prefill engine
        assert isinstance(result, httpx.HTTPError) or result.status_code >= 500, result.text
    decode_metrics = scrape(decode.url)
    assert decode_metrics['tokenspeed:pd_transfers_total{outcome="failed",role="decode"}'] >= 3
    # the decode engine serves on (with the other prefill engine), and once the dead
    # one provably stopped (nothing listens on its port) its landing pages are free
    assert completion(deployment.gateways["1p1d"].url, PROMPTS[0]).status_code == 200
    wait_clean([decode], timeout=20)
