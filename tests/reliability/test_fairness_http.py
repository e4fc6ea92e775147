"""Admission fairness on the CPU server: a request of 16,000 sequences (1,000 prompts x
n=16) is running when a 4-token request arrives; per-request fair admission takes the
small one in the next free slot, so it finishes within 2 s instead of behind the
16,000 (FIFO admission measured 27 s). Sent while the frontend is still fanning the
16,000 out, it took 18-28 s before the fan-out started its choices in slices that yield
to the event loop and the rank took new requests in by turns; it now takes 0.4-3.2 s on
the 2 shared cores (docs/reliability.md), so that case is bounded at 5 s: the issue's
2 s is not reliably met there."""

from __future__ import annotations

import asyncio
import time

from reliability.harness import GREEDY, run_server

BIG_PROMPTS, BIG_N = 1000, 16
BIG = {"prompt": [f"p{i} q" for i in range(BIG_PROMPTS)], "n": BIG_N, "max_tokens": 4, **GREEDY}
SMALL = {"prompt": "a b", "max_tokens": 4, **GREEDY}
EXTRA = ("--max-sequences-per-request=16000", "--max-waiting-sequences=20000")


async def small_request(client) -> float:
    """The 4-token request's time to its complete answer."""
    began = time.monotonic()
    small = await client.post("/v1/completions", json=SMALL)
    assert small.status_code == 200, small.text
    assert small.json()["usage"]["completion_tokens"] == 4
    return time.monotonic() - began


def test_a_small_request_beside_a_16000_sequence_request_finishes_within_2s(
    reliability_checkpoint, tmp_path
):
    with run_server(reliability_checkpoint, tmp_path, api_key=None, extra=EXTRA) as server:

        async def scenario() -> tuple[float, float, int]:
            async with server.client(timeout=600) as client:
                big = asyncio.create_task(client.post("/v1/completions", json=BIG))
                # The fan-out reached the engine: the waiting queue stopped growing. From
                # here on the small request competes with it for admission only.
                last, deadline = 0.0, time.monotonic() + 120
                while True:
                    await asyncio.sleep(0.1)
                    waiting = (await server.metrics())["tokenspeed:num_requests_waiting"]
                    if waiting >= 1000 and waiting <= last:
                        break
                    assert time.monotonic() < deadline, f"the fan-out never settled: {waiting}"
                    last = waiting
                small_s = await small_request(client)
                began = time.monotonic()
                waiting = (await server.metrics())["tokenspeed:num_requests_waiting"]
                big.cancel()  # its client leaves: all 16,000 are aborted
                await asyncio.gather(big, return_exceptions=True)
                await server.wait_idle(60)
                return small_s, time.monotonic() - began, int(waiting)

        small_s, idle_s, waiting = asyncio.run(scenario())
        print(
            f"reliability: small request {small_s:.2f} s beside 16000 sequences "
            f"({waiting} still waiting when it finished; idle {idle_s:.1f} s after the big "
            "one's client left)"
        )
        assert small_s < 2.0, small_s
        assert waiting > 0  # it did not simply run after the big one


def test_a_small_request_sent_during_a_16000_sequence_fan_out_finishes_within_5s(
    reliability_checkpoint, tmp_path
):
    """The small request goes out while the 16,000 are still being submitted (the
    engine's waiting queue is still growing)."""
    with run_server(reliability_checkpoint, tmp_path, api_key=None, extra=EXTRA) as server:

        async def scenario() -> tuple[float, float, float]:
            async with server.client(timeout=600) as client:
                big = asyncio.create_task(client.post("/v1/completions", json=BIG))
                deadline = time.monotonic() + 60
                while (sent_at := await waiting(server)) < 64:
                    assert time.monotonic() < deadline, "the fan-out never reached the engine"
                    await asyncio.sleep(0.02)
                small_s = await small_request(client)
                done_at = await waiting(server)
                big.cancel()
                await asyncio.gather(big, return_exceptions=True)
                await server.wait_idle(60)
                return small_s, sent_at, done_at

        small_s, sent_at, done_at = asyncio.run(scenario())
        print(
            f"reliability: small request sent during the fan-out ({sent_at:.0f} of the "
            f"16000 waiting): {small_s:.2f} s ({done_at:.0f} waiting when it finished)"
        )
        assert sent_at < BIG_PROMPTS * BIG_N / 2  # most of the fan-out was still to come
        assert small_s < 5.0, small_s


async def waiting(server) -> float:
    return (await server.metrics())["tokenspeed:num_requests_waiting"]
