"""The L3 tests' Mooncake master: a real ``mooncake_master`` on loopback, one per test
module that asks for it."""

from __future__ import annotations

import importlib.util

import pytest

from tokenspeed_aio.bench.deployment import MooncakeMaster

NO_MOONCAKE = importlib.util.find_spec("mooncake") is None
needs_mooncake = pytest.mark.skipif(
    NO_MOONCAKE, reason="needs mooncake-transfer-engine: pip install -e '.[pd]' (and libibverbs1)"
)


@pytest.fixture(scope="module")
def master(tmp_path_factory):
    if NO_MOONCAKE:
        pytest.skip("needs mooncake-transfer-engine: pip install -e '.[pd]'")
    m = MooncakeMaster(tmp_path_factory.mktemp("mooncake") / "master.log").start()
    yield m
    m.kill()
