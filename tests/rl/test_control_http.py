"""The control routes over real HTTP on a `serve` process: the verl/slime-style example
script runs the RL cycle against it, and each route answers SGLang's shape, refusals with
the status and an OpenAI-style error naming the reason."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from helpers.reference import checkpoint_path
from helpers.server import wait_healthy

from rl.harness import ROOT
from tokenspeed_aio.bench.ports import free_port


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    ckpt = checkpoint_path(tmp_path_factory.mktemp("control-http"), "llama")
    port = free_port()
    cmd = [
        sys.executable, "-m", "tokenspeed_aio", "serve", str(ckpt), f"--port={port}",
        "--max-model-len=512", "--page-size=4", "--num-kv-blocks=256", "--max-num-seqs=8",
        "--log-level=warning",
    ]  # fmt: skip
    log = tmp_path_factory.mktemp("control-http-log") / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", lambda: proc.poll() is None)
        yield f"http://127.0.0.1:{port}", ckpt
    finally:
        proc.terminate()
        try:
            assert proc.wait(60) == 0, log.read_text()[-3000:]
        finally:
            if proc.poll() is None:
                proc.kill()


def test_route_answers_and_refusals(server, tmp_path):
    url, _ = server
    with httpx.Client(base_url=url, timeout=60) as http:
        bad = http.post("/pause_generation", json={"mode": "sideways"})
        assert bad.status_code == 400
        body = bad.json()
        assert body["success"] is False and "mode" in body["message"]
        assert body["error"]["type"] == "invalid_request_error"
        assert http.post("/pause_generation", json={"mode": "keep"}).json()["success"]
        refused = http.post("/release_memory_occupation", json={"tags": ["kv_cache"]})
        assert refused.status_code == 409 and "keep pause" in refused.json()["message"]
        assert http.get("/health_generate").status_code == 503  # paused
        assert http.post("/continue_generation").json()["success"]
        assert http.get("/health_generate").json()["status"] == "ok"
        assert http.post("/flush_cache").json()["success"]
        (load,) = http.get("/v1/loads").json()["loads"]
        assert load["dp_rank"] == 0 and load["reported"] and load["running"] == 0
        assert http.get("/get_weight_version").json() == {"weight_version": "default"}
        bad = http.post("/update_weights_from_tensor", json={"serialized_named_tensors": ["%%"]})
        assert bad.status_code == 400 and "base64" in bad.json()["error"]["message"]
        bad = http.post(
            "/update_weights_from_distributed",
            json={"names": ["a", "b"], "dtypes": ["float32"], "shapes": [[1]]},
        )
        assert bad.status_code == 400 and "one of each" in bad.json()["message"]
        missing = http.post("/update_weights_from_disk", json={"model_path": str(tmp_path)})
        assert missing.status_code == 400 and "safetensors" in missing.json()["message"]
        profile = tmp_path / "profile"
        assert http.post("/start_profile", json={"output_dir": str(profile)}).json()["success"]
        http.post("/generate", json={"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 3}})
        stopped = http.post("/stop_profile").json()
        trace = Path(stopped["message"].removeprefix("trace: "))
        assert stopped["success"] and trace.parent == profile
        assert json.loads(trace.read_text())["traceEvents"]
        again = http.post("/stop_profile")
        assert again.status_code == 409 and "not running" in again.json()["message"]


@pytest.mark.parametrize("mode", ["distributed", "disk"])
def test_the_rl_cycle_example_runs_against_the_server(server, mode):
    url, ckpt = server
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "rl_cycle.py"), f"--url={url}",
         f"--checkpoint={ckpt}", f"--mode={mode}", "--steps=2"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "step 2: step-2 served, 2/2 rollouts changed" in result.stdout, result.stdout
