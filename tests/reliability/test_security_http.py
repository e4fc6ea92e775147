"""Security basics of ``serve``: it listens on loopback unless told otherwise; with
--api-key every route but /health needs the key; request bodies are bounded; and an
engine failure reaches clients as an error body without a traceback (which goes to
the server's log). The frontend's own 500 path (an unexpected exception in a route,
answered with the request id) is forced in test_inprocess_server.py, where the
frontend can be made to raise."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from helpers.sockets import listening

from reliability.harness import API_KEY, GREEDY, run_server

BODY_LIMIT = 65536
DOCS_ROUTES = [("GET", "/docs"), ("GET", "/redoc"), ("GET", "/docs/oauth2-redirect"),
               ("GET", "/openapi.json")]  # fmt: skip


@pytest.fixture(scope="module")
def server(reliability_checkpoint, tmp_path_factory):
    # No --host: the default must be loopback.
    with run_server(
        reliability_checkpoint, tmp_path_factory.mktemp("logs"),
        extra=(f"--max-body-bytes={BODY_LIMIT}",),
    ) as s:  # fmt: skip
        yield s


def test_serve_listens_on_loopback_only_by_default(server):
    sockets = listening(server.processes())
    assert (("127.0.0.1", server.port)) in {(ip, port) for ip, port, _ in sockets}, sockets
    assert all(ip in ("127.0.0.1", "::1") for ip, _, _ in sockets), sockets


def all_routes(server) -> list[tuple[str, str]]:
    spec = httpx.get(server.base_url + "/openapi.json", headers=server.headers).json()
    routes = [(m.upper(), path) for path, ops in spec["paths"].items() for m in ops]
    return routes + DOCS_ROUTES


def test_every_route_but_health_and_metrics_requires_the_api_key(server):
    routes = all_routes(server)
    assert {("POST", "/v1/completions"), ("POST", "/generate"), ("GET", "/metrics"),
            ("POST", "/abort_request")} <= set(routes)  # fmt: skip
    checked = 0
    for method, path in [*routes, ("GET", "/no/such/route")]:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY},
                        {"Authorization": f"Basic {API_KEY}"}):  # fmt: skip
            r = httpx.request(method, server.base_url + path, headers=headers, json={})
            if path in ("/health", "/metrics"):  # probes and scrapers carry no key
                assert r.status_code == 200, (method, path, headers)
                continue
            assert r.status_code == 401, (method, path, headers, r.status_code)
            assert r.json()["error"]["code"] == "invalid_api_key"
            assert r.headers["www-authenticate"] == "Bearer"
            checked += 1
        keyed = httpx.request(method, server.base_url + path, headers=server.headers, json={})
        assert keyed.status_code != 401, (method, path)
    print(f"reliability: api-key routes={len(routes)} refused_without_key={checked}")


async def test_request_bodies_over_the_limit_are_413(server):
    async with server.client() as c:
        pad = BODY_LIMIT - len(json.dumps({"prompt": "a", "max_tokens": 1, "user": ""}))
        exact = json.dumps({"prompt": "a", "max_tokens": 1, "user": "x" * pad}).encode()
        assert len(exact) == BODY_LIMIT
        assert (await c.post("/v1/completions", content=exact)).status_code == 200
        over = await c.post("/v1/completions", content=exact + b" ")
        assert over.status_code == 413 and str(BODY_LIMIT) in over.json()["error"]["message"]

        async def chunks():  # no Content-Length: the bytes that arrive are counted
            for _ in range(BODY_LIMIT // 1024 + 1):
                yield b" " * 1024

        chunked = await c.post("/generate", content=chunks())
        assert chunked.status_code == 413, chunked.text
        assert (await c.get("/health")).status_code == 200


async def test_an_engine_failure_reaches_clients_without_a_traceback(
    reliability_checkpoint, tmp_path_factory
):
    """A rank fails mid-request (an injected rank-local error): the streaming client
    gets an error event, the others a 503, all plain messages; the traceback is in the
    server's log, and serve exits non-zero."""
    with run_server(
        reliability_checkpoint, tmp_path_factory.mktemp("fault-logs"), max_model_len=2048,
        env={"TOKENSPEED_INJECT_FAULT": "rank=0,round=120"}, exit_code=1,
    ) as s:  # fmt: skip
        async with s.client() as c:
            body = {"prompt": "x", "max_tokens": 1500, **GREEDY}

            async def streamed() -> list[str]:
                async with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                    return [line async for line in r.aiter_lines() if line.startswith("data: ")]

            events, plain = await asyncio.gather(streamed(), c.post("/v1/completions", json=body))
            for _ in range(100):  # the server stops serving once the rank is gone
                try:
                    late = await c.post("/v1/completions", json=body)
                except httpx.TransportError:
                    break
                assert late.status_code == 503, late.text
                await asyncio.sleep(0.05)
        log = s.log()
    error = json.loads(events[-2][6:])["error"]
    assert events[-1] == "data: [DONE]" and error["type"] == "service_unavailable_error"
    assert plain.status_code == 503 and "the engine died" in plain.json()["error"]["message"]
    for text in (plain.text, *events):
        assert "Traceback" not in text and "InjectedFault" not in text and 'File "' not in text
    assert "Traceback" in log and "InjectedFault" in log


def test_tp2_ranks_listen_on_loopback_only(reliability_checkpoint, tmp_path):
    """Every socket a --tp 2 server's processes listen on -- the HTTP port, the
    collective mesh, the torch.distributed store and gloo's pairs -- is on loopback."""
    with run_server(reliability_checkpoint, tmp_path, tp=2) as tp2:
        r = httpx.post(
            tp2.base_url + "/v1/completions",
            headers=tp2.headers,
            json={"prompt": "a", "max_tokens": 2, **GREEDY},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        sockets = listening(tp2.processes())
    assert len({pid for _, _, pid in sockets}) >= 2, sockets  # the ranks listen too
    assert all(ip in ("127.0.0.1", "::1") for ip, _, _ in sockets), sockets
    print(f"reliability: tp2 listening sockets {len(sockets)}, all loopback")
