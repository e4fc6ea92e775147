from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from helpers.checkpoints import make_checkpoint


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """``checkpoint(arch, tied=False, **overrides)``: a tiny HF checkpoint, written once per session."""
    cache: dict[tuple, Path] = {}

    def get(arch: str, tied: bool = False, **overrides) -> Path:
        key = (arch, tied, tuple(sorted(overrides.items())))
        if key not in cache:
            path = tmp_path_factory.mktemp(f"{arch}-tied" if tied else arch)
            cache[key] = make_checkpoint(path, arch, tie_word_embeddings=tied, **overrides)
        return cache[key]

    return get
