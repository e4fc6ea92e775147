"""Disaggregated deployments on one machine, as a user runs them: ``python -m
tokenspeed_aio serve`` processes (prefill, decode or plain) and the SGLang Model Gateway
(``python -m sglang_router.launch_router``: its Rust gateway, regular or
``--pd-disaggregation``, or its ``--mini-lb``), unmodified, in front of them; and a
``mooncake_master`` for the L3 storage tier. Used by bench/pd_gateway.py, bench/l3_ttft.py
and the PD and L3 tests."""

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

from tokenspeed_aio.bench.ports import free_port

STARTUP_SECONDS = 600  # an 8B-shaped engine captures its CUDA graphs at start


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


@dataclass
class MooncakeMaster:
    """A ``mooncake_master`` on loopback with its HTTP metadata server; ``restart`` brings
    it back on the same ports (its objects are gone: they lived in the clients' segments
    the master tracked)."""

    log_path: Path
    rpc_port: int = field(default_factory=free_port)
    metadata_port: int = field(default_factory=free_port)
    metrics_port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def metadata_server(self) -> str:
        return f"http://127.0.0.1:{self.metadata_port}/metadata"

    def start(self) -> MooncakeMaster:
        binary = Path(sys.executable).with_name("mooncake_master")
        cmd = [
            str(binary) if binary.exists() else "mooncake_master",
            f"--rpc_port={self.rpc_port}", "--rpc_address=127.0.0.1",
            "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
            f"--http_metadata_server_port={self.metadata_port}",
            f"--metrics_port={self.metrics_port}", "--default_kv_lease_ttl=100",
        ]  # fmt: skip
        self.proc = subprocess.Popen(cmd, stdout=self.log_path.open("a"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mooncake_master exited:\n{self.log_path.read_text()[-4000:]}")
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.rpc_port), timeout=0.5),
                contextlib.suppress(httpx.TransportError),
            ):
                httpx.get(f"http://127.0.0.1:{self.metadata_port}/metadata", timeout=1)
                return self
            time.sleep(0.1)
        raise RuntimeError("mooncake_master did not start in 30 s")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def restart(self) -> MooncakeMaster:
        self.kill()
        return self.start()


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
    checkpoint: Path,
    log_dir: Path,
    name: str,
    *,
    model_name: str,
    role: str = "plain",
    tp: int = 1,
    env: dict[str, str] | None = None,
    **flags,
) -> Proc:
    """``serve`` on a free port (each keyword a ``--flag=value``); a prefill engine's
    bootstrap server on another."""
    port = free_port()
    values = dict(flags)
    bootstrap = 0
    if role != "plain":
        values.update(disaggregation_mode=role)  # its transfer endpoints on loopback
        if role == "prefill":
            bootstrap = free_port()
            values["disaggregation_bootstrap_port"] = bootstrap
    cmd = [
        sys.executable, "-m", "tokenspeed_aio", "serve", f"--model={checkpoint}",
        f"--port={port}", f"--served-model-name={model_name}", "--log-level=warning",
        f"--tp={tp}",
        *(f"--{k.replace('_', '-')}={v}" for k, v in values.items()),
    ]  # fmt: skip
    log_path = log_dir / f"{name}.log"
    env = {**os.environ, **(env or {})}
    proc = subprocess.Popen(cmd, stdout=log_path.open("w"), stderr=subprocess.STDOUT, env=env)
    return Proc(name, proc, f"http://127.0.0.1:{port}", log_path, bootstrap)


def wait_engine(engine: Proc, timeout: float = STARTUP_SECONDS) -> None:
    _wait(lambda: httpx.get(f"{engine.url}/health", timeout=2).status_code == 200, engine, timeout)


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


def scrape(url: str, model_name: str) -> dict[str, float]:
    """/metrics as {name{labels}: value}, the model_name label removed."""
    return parse_metrics(httpx.get(f"{url}/metrics", timeout=10).text, model_name)


def parse_metrics(text: str, model_name: str) -> dict[str, float]:
    """Prometheus text as {name{labels}: value}, the model_name label removed."""
    values: dict[str, float] = {}
    label = f'model_name="{model_name}"'
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            key = key.replace(f"{label},", "").replace(f",{label}", "")
            values[key.replace(f"{{{label}}}", "")] = float(value)
    return values
