"""The README's commands work as written: the main job's server command starts the
server on the built-in default model, and the curl example gets a completion."""

from __future__ import annotations

import contextlib
import json
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_commands() -> tuple[str, str]:
    text = README.read_text()
    blocks = re.findall(r"```bash\n(.*?)\n```", text, flags=re.S)
    serve = next(b for b in blocks if "tokenspeed_aio serve" in b and "pip install" in b)
    curl = next(b for b in blocks if b.startswith("curl "))
    return serve, curl


def test_readme_server_command_and_curl_example_work(tmp_path):
    serve, curl = readme_commands()
    # The setup part (venv, pip) already ran to get here; run the server part as written.
    server_part = serve.split("&&")[-1].strip()
    assert server_part == "python -m tokenspeed_aio serve"
    url = re.search(r"(http://\S+?)/v1/completions", curl).group(1)
    with contextlib.suppress(httpx.ConnectError):  # nothing listens there yet: good
        httpx.get(url + "/health", timeout=1)
        pytest.fail(f"{url} is already in use; the README's example needs that port")
    argv = [sys.executable, *shlex.split(server_part)[1:]]
    with open(tmp_path / "serve.log", "w") as log:
        server = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                assert server.poll() is None, (tmp_path / "serve.log").read_text()[-2000:]
                try:
                    if httpx.get(url + "/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    time.sleep(0.3)
            result = subprocess.run(shlex.split(curl), capture_output=True, text=True, timeout=60)
            assert result.returncode == 0, result.stderr
            body = json.loads(result.stdout)
            choice = body["choices"][0]
            assert choice["finish_reason"] in ("stop", "length") and choice["text"]
            assert body["usage"]["completion_tokens"] >= 1
        finally:
            server.send_signal(signal.SIGINT)
            assert server.wait(timeout=30) == 0
    assert "curl http://127.0.0.1:8000/v1/completions" in (tmp_path / "serve.log").read_text()
