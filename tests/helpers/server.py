"""Waiting for a server started by a test."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable

import httpx

# What /metrics shows above zero while anything of a request is held, from the HTTP layer's
# running requests through the frontend's streams to the engine's KV blocks.
IDLE_GAUGES = (
    "http_requests_running",
    "http_sequences_running",
    "frontend_streams",
    "frontend_draining_rids",
    "num_requests_running",
    "num_requests_waiting",
    "kv_blocks_active",
)


def wait_healthy(base_url: str, alive: Callable[[], bool], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and alive():
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                return
        time.sleep(0.1)
    raise RuntimeError(f"the server at {base_url} did not become healthy")


async def wait_idle(
    read_metrics: Callable[[], Awaitable[dict[str, float]]], timeout: float
) -> dict[str, float]:
    """Poll /metrics (``read_metrics``) until every ``IDLE_GAUGES`` is zero; raise naming
    what is still held."""
    deadline = time.monotonic() + timeout
    while True:
        m = await read_metrics()
        busy = {k: m[f"tokenspeed:{k}"] for k in IDLE_GAUGES}
        if not any(busy.values()):
            return m
        if time.monotonic() > deadline:
            raise AssertionError(f"not idle after {timeout}s: {busy}")
        await asyncio.sleep(0.05)
