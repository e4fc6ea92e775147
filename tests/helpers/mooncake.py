"""Whether Mooncake's store is installed, for the tests that start a real ``mooncake_master``."""

from __future__ import annotations

import importlib.util

import pytest

NO_MOONCAKE = importlib.util.find_spec("mooncake") is None
WHY = "needs mooncake-transfer-engine: pip install -e '.[pd]' (and libibverbs1)"
needs_mooncake = pytest.mark.skipif(NO_MOONCAKE, reason=WHY)
