"""Hostile requests a fault test mixes into its load: each a client error the server
must answer 4xx (never 5xx), whatever else is failing at the time."""

from __future__ import annotations

import asyncio

import httpx

# (route, body: a dict sent as JSON or raw bytes)
HOSTILE = [
    ("/v1/completions", {"prompt": [2**64], "max_tokens": 1}),  # a token id past int64
    ("/v1/completions", {"prompt": ["a"] * 33, "n": 32, "max_tokens": 1}),  # 1056 sequences
    ("/v1/completions", b'{"prompt": "a", "max_tokens": '),  # truncated JSON
    ("/v1/completions", {"prompt": "a", "max_tokens": 10**6}),  # past the context
    ("/generate", {"input_ids": [], "sampling_params": {}}),  # no input
    ("/v1/chat/completions", {"messages": [{"role": "nobody"}]}),  # no such role
]


async def send_hostile(
    client: httpx.AsyncClient, route: str, body: dict | bytes, model: str | None = None
) -> int:
    if isinstance(body, bytes):
        r = await client.post(route, content=body, headers={"content-type": "application/json"})
    else:
        named = {"model": model} if model is not None and route != "/generate" else {}
        r = await client.post(route, json={**named, **body})
    return r.status_code


async def hostile_rounds(
    client: httpx.AsyncClient,
    until: asyncio.Event,
    pause: float = 0.05,
    model: str | None = None,
) -> list[tuple[str, int | str]]:
    """Every hostile request (naming ``model`` where given: a gateway needs it), again and
    again until ``until``: (route, status), or (route, "closed") where the connection
    failed."""
    seen: list[tuple[str, int | str]] = []
    while not until.is_set():
        for route, body in HOSTILE:
            try:
                seen.append((route, await send_hostile(client, route, body, model)))
            except httpx.TransportError:
                seen.append((route, "closed"))
        await asyncio.sleep(pause)
    return seen
