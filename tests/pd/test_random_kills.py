"""An engine of a disaggregated pair SIGKILLed at a random point of a mixed load through
the real gateway: valid requests on every generating route, streamed or not, abandoned by
their clients at random points, beside hostile requests. Every request ends within
ENDS_WITHIN seconds of the kill (half the transfer timeout: the survivor learns of the
dead peer from its control connection, not from the timeout); a hostile request is 4xx
(through the gateway until the kill, straight to the surviving engine throughout); the
killed engine's rank processes follow its frontend within 10 s (no orphan); the
surviving engine holds nothing (no request, block, room or quarantined page) within
ENDS_WITHIN seconds of the kill and serves on with another engine of the victim's
role."""

from __future__ import annotations

import asyncio
import random
import re
import signal
import time
from dataclasses import dataclass

import httpx
import psutil
import pytest
from helpers.hostile import hostile_rounds
from helpers.workload import Tally, run_workload

from pd.harness import BOOTSTRAP_TIMEOUT, MODEL, start_gateway, wait_clean
from pd.workload import PROMPTS, completion

# The deployment's engines start once, inside the first test's setup.
pytestmark = pytest.mark.timeout(900)

REQUESTS = 40
ENDS_WITHIN = 10.0  # seconds after the kill: every request ended, the survivor clean
assert ENDS_WITHIN <= BOOTSTRAP_TIMEOUT / 2  # (so the timeout cannot be what ended them)
# What a valid request may see once an engine of its pair is gone: the gateway's or the
# engine's 5xx, an error event, a cut stream or connection.
LOST = re.compile(r"HTTP 5\d\d|error event|transport error|ended without \[DONE\]")


@dataclass
class Killed:
    tally: Tally
    gateway_hostile: list  # sent through the gateway before the kill
    direct_hostile: list  # sent straight to the surviving engine, before and after
    at: float  # seconds into the load
    ended: float  # seconds after the kill until the last request ended
    gone: float  # seconds after the kill until no process of the victim was left
    orphans: list
    clean: float  # seconds after the kill until the survivor held nothing


def reap(procs: list[psutil.Process], since: float) -> tuple[list, float]:
    """Wait up to 10 s for ``procs`` to exit: (those left, seconds since ``since``)."""
    _, alive = psutil.wait_procs(procs, timeout=10)
    return alive, time.monotonic() - since


def kill_under_mixed_load(gateway, victim, survivor, seed: int) -> Killed:
    """Run the mixed load through ``gateway``, SIGKILL ``victim``'s frontend process at a
    random point of it, and measure what followed."""
    rng = random.Random(seed)
    at = rng.uniform(0.5, 2.0)

    async def run() -> Killed:
        async with (
            httpx.AsyncClient(base_url=gateway.url, timeout=60) as through,
            httpx.AsyncClient(base_url=survivor.url, timeout=60) as direct,
        ):
            before_kill, stop = asyncio.Event(), asyncio.Event()
            gateway_hostile = asyncio.create_task(hostile_rounds(through, before_kill, model=MODEL))
            direct_hostile = asyncio.create_task(
                hostile_rounds(direct, stop, pause=0.2, model=MODEL)
            )
            load = asyncio.create_task(
                run_workload(
                    through,
                    requests=REQUESTS,
                    concurrency=8,
                    seed=seed,
                    model=MODEL,
                    abort_route=False,
                )
            )
            await asyncio.sleep(at)
            assert not load.done(), "the load ended before the kill"
            before_kill.set()  # (one in flight at the kill may get the gateway's 5xx)
            through_gateway = await gateway_hostile
            procs = victim.tree()
            victim.proc.send_signal(signal.SIGKILL)  # the frontend only: its ranks follow
            killed = time.monotonic()
            reaped = asyncio.create_task(asyncio.to_thread(reap, procs, killed))
            try:
                tally = await asyncio.wait_for(load, ENDS_WITHIN)
            except TimeoutError:
                raise AssertionError(
                    f"requests still open {ENDS_WITHIN} s after the kill"
                ) from None
            ended = time.monotonic() - killed
            orphans, gone = await reaped
            left = ENDS_WITHIN - (time.monotonic() - killed)
            await asyncio.to_thread(wait_clean, [survivor], max(left, 0.0))
            clean = time.monotonic() - killed
            stop.set()
            return Killed(
                tally, through_gateway, await direct_hostile, at, ended, gone, orphans, clean
            )

    return asyncio.run(run())


def check(result: Killed, name: str) -> None:
    assert not result.orphans, f"orphan processes: {result.orphans}"
    assert result.gone < 10, result.gone
    assert result.ended < ENDS_WITHIN and result.clean < ENDS_WITHIN, result
    unexpected = [e for e in result.tally.errors if not LOST.search(e)]
    assert not unexpected, unexpected[:5]  # e.g. a 4xx for a valid request
    assert result.gateway_hostile and result.direct_hostile
    assert all(s in (400, 422) for _, s in result.gateway_hostile), result.gateway_hostile
    assert all(s == 400 for _, s in result.direct_hostile), result.direct_hostile
    print(
        f"reliability: {name} killed {result.at:.2f} s into the load: "
        f"{dict(result.tally.outcomes)} lost={len(result.tally.errors)} "
        f"hostile={len(result.gateway_hostile)}+{len(result.direct_hostile)}; "
        f"requests ended {result.ended:.2f} s, processes gone {result.gone:.2f} s, "
        f"survivor clean {result.clean:.2f} s after the kill"
    )


# (role killed, the victim, the survivor, the load's seed): the survivor serves on with the
# deployment's other engine of the victim's role.
KILLS = [
    ("prefill", "P-kill", "D1", 71),
    ("decode", "D-kill", "P1", 72),
]


@pytest.mark.parametrize(
    ("role", "victim_name", "survivor_name", "seed"), KILLS, ids=["prefill", "decode"]
)
def test_an_engine_sigkilled_at_a_random_point(deployment, role, victim_name, survivor_name, seed):
    victim, survivor = deployment.engines[victim_name], deployment.engines[survivor_name]
    roles = {"prefill": [victim], "decode": [survivor]} if role == "prefill" else {
        "prefill": [survivor], "decode": [victim]}  # fmt: skip
    gateway = start_gateway(deployment.logs, f"gw-{victim_name.lower()}", **roles)
    try:
        result = kill_under_mixed_load(gateway, victim, survivor, seed=seed)
    finally:
        gateway.stop()
    check(result, f"{role} engine")
    assert completion(deployment.gateways["1p1d"].url, PROMPTS[0]).status_code == 200
    wait_clean([survivor])
