from __future__ import annotations

import contextlib
import random

import pytest

from tokenspeed_aio.api.engine import AsyncEngine
from tokenspeed_aio.args import EngineArgs


@pytest.fixture
async def start_engine():
    """Start engines for a test; each is leak-checked and shut down at teardown."""
    engines: list[AsyncEngine] = []

    async def start(model, **kw) -> AsyncEngine:
        defaults = dict(max_model_len=1024, page_size=4, num_kv_blocks=512, max_num_seqs=32)
        defaults.update(kw)
        engine = await AsyncEngine.start(EngineArgs(model=str(model), **defaults))
        engines.append(engine)
        return engine

    yield start
    try:
        for engine in engines:
            await engine.check_idle()
    finally:
        for engine in engines:
            with contextlib.suppress(Exception):
                await engine.shutdown()


def parity_prompts(vocab: int = 512, seed: int = 0) -> list[list[int]]:
    """8 prompts of 1 to ~300 tokens (token ids avoid the special tokens 0..4)."""
    rng = random.Random(seed)
    lengths = [1, 3, 17, 40, 64, 129, 200, 301]
    return [[rng.randrange(5, vocab) for _ in range(n)] for n in lengths]
