"""Fixtures of the reliability suite: one real ``serve`` subprocess per module."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.reference import checkpoint_path


@pytest.fixture(scope="session")
def reliability_checkpoint(tmp_path_factory) -> Path:
    return checkpoint_path(tmp_path_factory.mktemp("reliability-checkpoints"), "llama")
