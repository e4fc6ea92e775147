"""One disaggregated deployment for the whole PD suite (engines start once, in
parallel): prefill engines P1, P2, decode engines D1, D2, an aggregated engine A, and
the SGLang Model Gateway in front of them -- its Rust gateway for 1P1D, 2P1D and 1P2D,
its mini-lb for 1P1D, and regular mode with the cache-aware policy for A. The fault
tests' engines start with them: P-slow (every write waits WRITE_DELAY first), D-dies
(killed by a test), and P-kill, D-kill (SIGKILLed at a random point of a mixed load)."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers.reference import checkpoint_path

from pd.harness import WRITE_DELAY, Proc, start_engine, start_gateway, wait_engine

MISSING = [m for m in ("mooncake", "sglang_router") if importlib.util.find_spec(m) is None]


def pytest_collection_modifyitems(items):
    if not MISSING:
        return
    reason = f"needs {', '.join(MISSING)}: pip install -e '.[pd]' (and libibverbs1)"
    for item in items:
        if "tests/pd/" in str(item.fspath):
            item.add_marker(pytest.mark.skip(reason=reason))


@dataclass
class Deployment:
    checkpoint: Path
    logs: Path
    engines: dict[str, Proc]
    gateways: dict[str, Proc]


def stop_all(procs) -> None:
    for proc in procs:
        proc.stop()


@pytest.fixture(scope="session")
def pd_checkpoint(tmp_path_factory) -> Path:
    return checkpoint_path(tmp_path_factory.mktemp("pd-checkpoints"), "llama")


@pytest.fixture(scope="session")
def pd_logs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("pd-logs")


@pytest.fixture(scope="session")
def deployment(pd_checkpoint, pd_logs):
    roles = {"P1": "prefill", "P2": "prefill", "D1": "decode", "D2": "decode", "A": "plain"}
    roles |= {"P-slow": "prefill", "D-dies": "decode", "P-kill": "prefill", "D-kill": "decode"}
    slow = {"P-slow": {"TOKENSPEED_PD_WRITE_DELAY": str(WRITE_DELAY)}}
    engines = {
        n: start_engine(pd_checkpoint, pd_logs, n, role=r, env=slow.get(n))
        for n, r in roles.items()
    }
    gateways: dict[str, Proc] = {}
    try:
        for engine in engines.values():
            wait_engine(engine)
        p1, p2, d1, d2 = (engines[n] for n in ("P1", "P2", "D1", "D2"))
        gateways["1p1d"] = start_gateway(pd_logs, "gw-1p1d", prefill=[p1], decode=[d1])
        gateways["mini-lb"] = start_gateway(
            pd_logs, "gw-mini-lb", prefill=[p1], decode=[d1], mini_lb=True
        )
        gateways["2p1d"] = start_gateway(pd_logs, "gw-2p1d", prefill=[p1, p2], decode=[d1])
        gateways["1p2d"] = start_gateway(pd_logs, "gw-1p2d", prefill=[p1], decode=[d1, d2])
        gateways["regular"] = start_gateway(
            pd_logs, "gw-regular", regular=[engines["A"]], policy="cache_aware"
        )
        yield Deployment(pd_checkpoint, pd_logs, engines, gateways)
    finally:
        stop_all(gateways.values())
        stop_all(engines.values())
