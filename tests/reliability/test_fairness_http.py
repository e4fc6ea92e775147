"""Admission fairness on the CPU server: a request of 16,000 sequences (1,000 prompts x
n=16) is running when a 4-token request arrives; per-request fair admission takes the
small one in the next free slot, so it finishes within 2 s instead of behind the
16,000 (FIFO admission measured 27 s)."""

from __future__ import annotations

import asyncio
import time

from reliability.harness import GREEDY, run_server

BIG_PROMPTS, BIG_N = 1000, 16


def test_a_small_request_beside_a_16000_sequence_request_finishes_within_2s(
    reliability_checkpoint, tmp_path
):
    extra = ("--max-sequences-per-request=16000", "--max-waiting-sequences=20000")
    with run_server(reliability_checkpoint, tmp_path, api_key=None, extra=extra) as server:

        async def scenario() -> tuple[float, float, int]:
            async with server.client(timeout=600) as client:
                prompts = [f"p{i} q" for i in range(BIG_PROMPTS)]
                body = {"prompt": prompts, "n": BIG_N, "max_tokens": 4, **GREEDY}
                big = asyncio.create_task(client.post("/v1/completions", json=body))
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
                began = time.monotonic()
                small = await client.post(
                    "/v1/completions", json={"prompt": "a b", "max_tokens": 4, **GREEDY}
                )
                small_s = time.monotonic() - began
                assert small.status_code == 200, small.text
                assert small.json()["usage"]["completion_tokens"] == 4
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
