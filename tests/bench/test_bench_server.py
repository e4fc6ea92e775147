"""The server target: the bench drives ``python -m tokenspeed_aio serve`` over HTTP
(streamed SGLang ``/generate``) and measures what it measured in process."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from tokenspeed_aio.bench import bench_main


@pytest.fixture
def server_url(tiny_dir):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "tokenspeed_aio", "serve", "--model", str(tiny_dir)]
    cmd += ["--port", str(port), "--max-model-len", "1024", "--page-size", "4"]
    cmd += ["--num-kv-blocks", "1024", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None, "the server exited during startup"
            assert time.monotonic() < deadline, "the server did not become healthy in 60 s"
            time.sleep(0.2)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_server_target_streams_exact_lengths(server_url, tiny_dir, tmp_path):
    out = tmp_path / "server.json"
    argv = ["fixed-1k", "--server", server_url, "--model", str(tiny_dir), "--no-roofline"]
    argv += ["--input-len", "12", "--output-len", "6", "--concurrency", "1,3"]
    argv += ["--num-requests", "3", "--out", str(out)]
    assert bench_main(argv) == 0
    doc = json.loads(out.read_text())
    assert doc["target"]["kind"] == "server" and doc["target"]["engine_args"] is None
    for run in doc["runs"]:
        m = run["metrics"]
        assert m["completed"] == 3 and m["output_tokens"] == 18
        assert m["ttft_ms"]["p50"] > 0 and m["itl_ms"]["p50"] > 0
        assert run["control_plane"] is None  # not observable over HTTP
