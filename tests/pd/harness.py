"""Engines and gateways for the PD tests, as the user runs them: ``python -m
tokenspeed_aio serve`` processes (CPU, Mooncake over TCP on loopback) and the SGLang
Model Gateway (``python -m sglang_router.launch_router``, its Rust gateway or
``--mini-lb``), unmodified, in front of them."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

MODEL = "tiny-llama"
ENGINE_FLAGS = dict(
    max_model_len=512, page_size=4, num_kv_blocks=512, max_num_seqs=32, kv_cache_memory_gb=0.5
)
STARTUP_SECONDS = 180


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Proc:
    name: str
    proc: subprocess.Popen
    url: str
    log_path: Path
    bootstrap_port: int = 0
    children: list[psutil.Process] = field(default_factory=list)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def tree(self) -> list[psutil.Process]:
        with contextlib.suppress(psutil.NoSuchProcess):
            root = psutil.Process(self.proc.pid)
            return [root, *root.children(recursive=True)]
        return []

    def stop(self) -> None:
        procs = self.tree()
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        _, alive = psutil.wait_procs(procs, timeout=10)
        for p in alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()


def _wait(check, proc: Proc, timeout: float = STARTUP_SECONDS) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not proc.alive():
            raise RuntimeError(
                f"{proc.name} exited ({proc.proc.returncode}):\n{proc.log()[-4000:]}"
            )
        with contextlib.suppress(httpx.TransportError):
            if check():
                return
        time.sleep(0.2)
    raise RuntimeError(f"{proc.name} did not start in {timeout}s:\n{proc.log()[-4000:]}")


def start_engine(
    checkpoint: Path, log_dir: Path, name: str, *, role: str = "plain", tp: int = 1, **flags
) -> Proc:
    """``serve`` on a free port; a prefill engine's bootstrap server on another."""
    port = free_port()
    values = dict(ENGINE_FLAGS, **flags)
    bootstrap = 0
    if role != "plain":
        values.update(disaggregation_mode=role, disaggregation_host="127.0.0.1")
        values.setdefault("disaggregation_bootstrap_timeout", 20)
        if role == "prefill":
            bootstrap = free_port()
            values["disaggregation_bootstrap_port"] = bootstrap
    cmd = [
        sys.executable, "-m", "tokenspeed_aio", "serve", f"--model={checkpoint}",
        f"--port={port}", f"--served-model-name={MODEL}", "--log-level=warning", f"--tp={tp}",
        *(f"--{k.replace('_', '-')}={v}" for k, v in values.items()),
    ]  # fmt: skip
    log_path = log_dir / f"{name}.log"
    env = dict(os.environ, GLOG_minloglevel="2")
    proc = subprocess.Popen(cmd, stdout=log_path.open("w"), stderr=subprocess.STDOUT, env=env)
    return Proc(name, proc, f"http://127.0.0.1:{port}", log_path, bootstrap)


def wait_engine(engine: Proc) -> None:
    _wait(lambda: httpx.get(f"{engine.url}/health", timeout=2).status_code == 200, engine)


def start_gateway(
    log_dir: Path,
    name: str,
    *,
    prefill: list[Proc] = (),
    decode: list[Proc] = (),
    regular: list[Proc] = (),
    mini_lb: bool = False,
    policy: str | None = None,
) -> Proc:
    port = free_port()
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--log-level", "warn", "--prometheus-port", str(free_port())]
    if regular:
        cmd += ["--worker-urls", *(e.url for e in regular)]
    else:
        cmd += ["--pd-disaggregation"]
        for p in prefill:
            cmd += ["--prefill", p.url, str(p.bootstrap_port)]
        for d in decode:
            cmd += ["--decode", d.url]
    if mini_lb:
        cmd += ["--mini-lb"]
    if policy:
        cmd += ["--policy", policy]
    log_path = log_dir / f"{name}.log"
    proc = subprocess.Popen(cmd, stdout=log_path.open("w"), stderr=subprocess.STDOUT)
    gateway = Proc(name, proc, f"http://127.0.0.1:{port}", log_path)
    workers = len(regular) or len(prefill) + len(decode)

    def ready() -> bool:
        if httpx.get(f"{gateway.url}/health", timeout=2).status_code != 200:
            return False
        if mini_lb:
            return True
        listed = httpx.get(f"{gateway.url}/workers", timeout=2).json().get("workers", [])
        return sum(1 for w in listed if w.get("is_healthy")) == workers

    _wait(ready, gateway, timeout=60)
    return gateway


def scrape(url: str) -> dict[str, float]:
    """/metrics as {name{labels}: value}, the model_name label removed."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            key = key.replace(f'model_name="{MODEL}",', "").replace(f',model_name="{MODEL}"', "")
            values[key.replace(f'{{model_name="{MODEL}"}}', "")] = float(value)
    return values


LEAK_GAUGES = (
    "num_requests_running",
    "num_requests_waiting",
    "kv_blocks_active",
    "pd_rooms_in_flight",
    "pd_rooms_unclaimed",
    "pd_pages_quarantined",
)


def wait_clean(engines: list[Proc], timeout: float = 30.0) -> None:
    """Every engine idle: no request, no active page, no room in flight or unclaimed,
    no quarantined page (read from each engine's own /metrics)."""
    deadline = time.monotonic() + timeout
    while True:
        held = {
            e.name: {g: scrape(e.url).get(f"tokenspeed:{g}", 0) for g in LEAK_GAUGES}
            for e in engines
        }
        busy = {n: {g: v for g, v in h.items() if v} for n, h in held.items()}
        if not any(busy.values()):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"not clean after {timeout}s: {busy}")
        time.sleep(0.2)
