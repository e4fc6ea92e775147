"""The PD tests' engines and gateways: bench/deployment.py's processes with the tests'
tiny engine settings, and the leak check every test ends with."""

from __future__ import annotations

import time
from pathlib import Path

from tokenspeed_aio.bench import deployment
from tokenspeed_aio.bench.deployment import Proc, start_gateway, wait_engine
from tokenspeed_aio.bench.ports import free_port

__all__ = ["MODEL", "Proc", "free_port", "scrape", "start_engine", "start_gateway", "wait_clean"]
__all__ += ["wait_engine"]

MODEL = "tiny-llama"
ENGINE_FLAGS = dict(
    max_model_len=512, page_size=4, num_kv_blocks=512, max_num_seqs=32, kv_cache_memory_gb=0.5
)
BOOTSTRAP_TIMEOUT = 20  # seconds: every PD engine's --disaggregation-bootstrap-timeout
WRITE_DELAY = 3.0  # seconds every write of the slow prefill engine (P-slow) waits first


def start_engine(checkpoint: Path, log_dir: Path, name: str, **kw) -> Proc:
    flags = dict(ENGINE_FLAGS, **kw)
    if flags.get("role", "plain") != "plain":
        flags.setdefault("disaggregation_bootstrap_timeout", BOOTSTRAP_TIMEOUT)
    return deployment.start_engine(checkpoint, log_dir, name, model_name=MODEL, **flags)


def scrape(url: str) -> dict[str, float]:
    return deployment.scrape(url, MODEL)


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
