"""Stopping ``serve`` under load: SIGTERM drains (new requests 503 with Retry-After, the
running ones finish up to --shutdown-timeout, the rest are aborted), every open stream
ends with a final chunk carrying its finish_reason, then [DONE] and the chunked
terminator (httpx refuses a body cut without it); a second signal stops at once; exit 0
and no IPC socket file left (nor after a failed start). With --dp 2 the stop rides the DP agreement: every rank
exits 0 and none fails in the mesh."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import psutil
import pytest

from reliability.harness import GREEDY, run_server

SETTINGS = {"max_model_len": 2048, "num_kv_blocks": 8192}


async def stream(client: httpx.AsyncClient, body: dict, started: asyncio.Event) -> list:
    """The stream's events (JSON payloads, then the string "[DONE]")."""
    events: list = []
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                data = line[len("data: ") :]
                events.append(data if data == "[DONE]" else json.loads(data))
                started.set()
    return events


def finish_reasons(events: list) -> dict[int, str]:
    return {
        choice["index"]: choice["finish_reason"]
        for event in events
        if isinstance(event, dict) and "choices" in event
        for choice in event["choices"]
        if choice["finish_reason"]
    }


async def load_then_signal(server, bodies: list[dict], signals: list[float]) -> dict:
    """Open a stream per body, send SIGTERM once every one has begun (then again after
    each delay in ``signals``), probe during the drain; the streams' events, the probe's
    answer, and how long the process took to exit."""
    async with server.client(timeout=120) as client:
        started = [asyncio.Event() for _ in bodies]
        tasks = [asyncio.create_task(stream(client, b, e)) for b, e in zip(bodies, started)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
        ranks = server.processes()[1:]
        sent = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.3)
        probe = await client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1})
        health = await client.get("/health")
        for delay in signals:
            await asyncio.sleep(delay)
            server.proc.send_signal(signal.SIGTERM)
        results = await asyncio.wait_for(asyncio.gather(*tasks), 60)
    code = await asyncio.to_thread(server.proc.wait, 30)
    exited = time.monotonic() - sent
    gone = psutil.wait_procs(ranks, timeout=5)[1] == []
    return {
        "streams": results, "probe": probe, "health": health.status_code, "code": code,
        "exited": exited, "gone": gone,
    }  # fmt: skip


def check_streams(results: list[list], bodies: list[dict]) -> list[str]:
    reasons = []
    for events, body in zip(results, bodies):
        assert events and events[-1] == "[DONE]", events[-3:]
        got = finish_reasons(events)
        assert sorted(got) == list(range(body.get("n", 1))), (body, got)
        reasons += got.values()
    assert set(reasons) <= {"length", "abort"}, reasons
    return reasons


@pytest.fixture
def tmpdir_env(tmp_path):
    ipc = tmp_path / "ipc"
    ipc.mkdir()
    return ipc, {"TMPDIR": str(ipc)}


SHORT = {"prompt": "a b", "max_tokens": 4, **GREEDY}
LONG = {"prompt": "c d", "max_tokens": 2000, "n": 2, **GREEDY}


def test_sigterm_drains_and_every_stream_ends_properly(
    reliability_checkpoint, tmp_path, tmpdir_env
):
    ipc, env = tmpdir_env
    bodies = [SHORT] * 10 + [LONG] * 10
    with run_server(
        reliability_checkpoint, tmp_path, api_key=None, env=env, log_level="info",
        extra=("--shutdown-timeout=4",), **SETTINGS,
    ) as server:  # fmt: skip
        got = asyncio.run(load_then_signal(server, bodies, []))
    assert got["probe"].status_code == 503, got["probe"].text
    assert got["probe"].headers["retry-after"] == "5"
    assert got["probe"].json()["error"]["code"] == "shutting_down"
    assert got["health"] == 503  # a load balancer stops routing here
    reasons = check_streams(got["streams"], bodies)
    assert reasons.count("length") >= 10 and reasons.count("abort") >= 10, reasons
    assert got["code"] == 0 and got["gone"]
    assert got["exited"] < 4 + 10, got["exited"]
    assert os.listdir(ipc) == [], os.listdir(ipc)
    log = server.log()
    assert "Traceback" not in log and "rank processes exited with [0]" in log
    print(f"reliability: drain exited in {got['exited']:.1f} s, reasons {sorted(set(reasons))}")


def test_a_second_signal_stops_at_once(reliability_checkpoint, tmp_path, tmpdir_env):
    ipc, env = tmpdir_env
    bodies = [LONG] * 6
    with run_server(
        reliability_checkpoint, tmp_path, api_key=None, env=env,
        extra=("--shutdown-timeout=120",), **SETTINGS,
    ) as server:  # fmt: skip
        got = asyncio.run(load_then_signal(server, bodies, [0.2]))
    assert check_streams(got["streams"], bodies).count("abort") == 12
    assert got["code"] == 0 and got["gone"]
    assert got["exited"] < 10, got["exited"]
    assert os.listdir(ipc) == []


def test_dp2_server_stops_under_load_with_every_rank_clean(
    reliability_checkpoint, tmp_path, tmpdir_env
):
    ipc, env = tmpdir_env
    bodies = [SHORT] * 6 + [LONG] * 6
    with run_server(
        reliability_checkpoint, tmp_path, api_key=None, env=env, log_level="info",
        extra=("--shutdown-timeout=1",), dp=2, **SETTINGS,
    ) as server:  # fmt: skip
        got = asyncio.run(load_then_signal(server, bodies, []))
    check_streams(got["streams"], bodies)
    assert got["code"] == 0 and got["gone"]
    log = server.log()
    assert "rank processes exited with [0, 0]" in log, log[-3000:]
    for bad in ("Traceback", "MeshError", "CollectiveError"):
        assert bad not in log, log[-3000:]
    assert os.listdir(ipc) == []


def test_a_failed_start_exits_nonzero_and_leaves_no_ipc_file(reliability_checkpoint, tmpdir_env):
    ipc, env = tmpdir_env
    proc = subprocess.run(
        [sys.executable, "-m", "tokenspeed_aio", "serve", f"--model={reliability_checkpoint}",
         "--port=0", "--device=cuda", "--log-level=warning"],  # no CUDA here: the rank fails
        env={**os.environ, **env}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "engine startup failed" in proc.stderr
    assert os.listdir(ipc) == []
