from __future__ import annotations

import pytest

from tokenspeed_aio.args import EngineArgs
from tokenspeed_aio.bench.shapes import checkpoint_dir
from tokenspeed_aio.bench.workloads import TokenSpace


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """The ``tiny`` shape: config, synthetic tokenizer and random safetensors weights."""
    return checkpoint_dir("tiny", tmp_path_factory.mktemp("shapes"))


@pytest.fixture(scope="session")
def tiny_tokens(tiny_dir):
    return TokenSpace.from_model_dir(tiny_dir)


@pytest.fixture
def tiny_engine_args(tiny_dir):
    """Small enough for CPU tests; page_size 4 so short prompts still fill cacheable blocks."""
    return EngineArgs(
        model=str(tiny_dir), max_model_len=1024, page_size=4, num_kv_blocks=1024, max_num_seqs=32
    )
