import os
import sys
from pathlib import Path

import pytest

# tests/helpers is importable as `helpers` from every test module.
sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


@pytest.fixture(scope="session")
def ckpt(tmp_path_factory):
    """ckpt(arch, **overrides) -> path of a tiny random checkpoint (cached per session)."""
    from helpers.reference import checkpoint_path

    root = tmp_path_factory.mktemp("checkpoints")

    def make(arch: str = "llama", **kw):
        return checkpoint_path(root, arch, **kw)

    return make
