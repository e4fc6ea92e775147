"""Waiting for a server started by a test."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import httpx


def wait_healthy(base_url: str, alive: Callable[[], bool], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and alive():
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                return
        time.sleep(0.1)
    raise RuntimeError(f"the server at {base_url} did not become healthy")
