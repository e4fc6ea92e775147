"""AsyncClient's retry policy against real servers: a server that is not up yet is
waited for; 503 is retried (then raised); a 4xx is never retried."""

from __future__ import annotations

import asyncio
import contextlib

import httpx
import pytest

from tokenspeed_aio.bench.ports import free_port
from tokenspeed_aio.client import APIConnectionError, APIStatusError, AsyncClient
from tokenspeed_aio.server.app import build_app, serve_http


def counting_http() -> tuple[httpx.AsyncClient, list[str]]:
    """An httpx client that records every request it sends."""
    sent: list[str] = []

    async def record(request: httpx.Request) -> None:
        sent.append(f"{request.method} {request.url.path}")

    return httpx.AsyncClient(event_hooks={"request": [record]}), sent


async def test_waits_for_a_late_server_then_retries_503_but_never_4xx(start_engine):
    port = free_port()
    http, sent = counting_http()
    client = AsyncClient(f"http://127.0.0.1:{port}", max_retries=6, backoff=0.2, http_client=http)
    # nothing listens yet: the first attempts are refused, the server comes up meanwhile
    early = asyncio.create_task(client.completions("Hi", max_tokens=2))
    engine = await start_engine()
    app = build_app(engine, served_model_name="m")
    serving = asyncio.create_task(serve_http(app, "127.0.0.1", port, log_level="critical"))
    try:
        out = await early
        assert out.choices[0].finish_reason in ("stop", "length")
        assert len(sent) > 1  # it was retried

        sent.clear()
        with pytest.raises(APIStatusError) as err:
            await client.completions("Hi", max_tokens=0)
        assert err.value.status == 400 and len(sent) == 1  # a 4xx is final

        await engine.shutdown()  # the engine is dead: 503, retried max_retries times
        sent.clear()
        client.backoff = 0.01
        with pytest.raises(APIStatusError) as err:
            await client.completions("Hi", max_tokens=2)
        assert err.value.status == 503 and len(sent) == 1 + client.max_retries
        assert not (await client.health()).ok
    finally:
        serving.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await serving
        await http.aclose()


async def test_no_server_at_all_is_a_connection_error():
    async with AsyncClient(
        f"http://127.0.0.1:{free_port()}", max_retries=2, backoff=0.01
    ) as client:
        with pytest.raises(APIConnectionError):
            await client.models()
