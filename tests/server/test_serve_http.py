"""serve_http: runs on the caller's loop, stops gracefully when cancelled or on
SIGTERM (in-flight requests drain, then are cut and aborted), reports a port it
cannot bind as OSError."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time

import httpx
import pytest

from tokenspeed_aio.bench.ports import free_port
from tokenspeed_aio.server.app import build_app, serve_http


async def wait_up(url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient() as client:
        while time.monotonic() < deadline:
            try:
                if (await client.get(f"{url}/health")).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.05)
    raise TimeoutError(url)


async def read_stream(client: httpx.AsyncClient, url: str, body: dict) -> list[str]:
    """The SSE lines received until the stream ended or the connection was cut."""
    lines: list[str] = []
    try:
        async with client.stream("POST", url, json=body) as response:
            async for line in response.aiter_lines():
                lines.append(line)
    except httpx.TransportError:
        pass  # cut by the server's shutdown
    return lines


async def test_cancel_drains_short_requests_and_cuts_long_ones(start_engine):
    engine = await start_engine()
    app = build_app(engine, served_model_name="m")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    serving = asyncio.create_task(
        serve_http(app, "127.0.0.1", port, log_level="critical", drain_seconds=0.5)
    )
    await wait_up(url)
    async with httpx.AsyncClient(timeout=30) as client:
        long_body = {"prompt": "long", "max_tokens": 900, "ignore_eos": True, "stream": True}
        long = asyncio.create_task(read_stream(client, f"{url}/v1/completions", long_body))
        while not engine.frontend.streams:
            await asyncio.sleep(0.01)
        short = asyncio.create_task(
            client.post(f"{url}/v1/completions", json={"prompt": "short", "max_tokens": 3})
        )
        await asyncio.sleep(0.05)
        serving.cancel()
        with pytest.raises(asyncio.CancelledError):
            await serving
        assert (await short).status_code == 200  # finished within the drain
        lines = await long
        assert lines and "data: [DONE]" not in lines  # cut after the drain
        with pytest.raises(httpx.ConnectError):
            await client.get(f"{url}/health")  # no longer listening
    await engine.check_idle()  # the cut request was aborted, its blocks freed


async def test_sigterm_stops_serving_and_port_in_use_is_oserror(start_engine):
    engine = await start_engine()
    app = build_app(engine, served_model_name="m")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(OSError, match="could not listen"):
            await serve_http(app, "127.0.0.1", taken.getsockname()[1], log_level="critical")

    port = free_port()
    serving = asyncio.create_task(serve_http(app, "127.0.0.1", port, log_level="critical"))
    await wait_up(f"http://127.0.0.1:{port}")
    # serve_http holds SIGTERM now (were it not, the signal would end the test run)
    assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None)
    os.kill(os.getpid(), signal.SIGTERM)
    await asyncio.wait_for(serving, timeout=15)  # returns; the signal is not re-raised
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
