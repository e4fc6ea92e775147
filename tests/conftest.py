import contextlib
import os
import sys
from pathlib import Path

import pytest
import torch

# tests/helpers is importable as `helpers` from every test module.
sys.path.insert(0, str(Path(__file__).parent))
# Without CUDA the Triton kernels run under the interpreter, which must be chosen before
# triton.language is imported (its tl.sum, tl.max, ... are @triton.jit functions): importing
# transformers' Qwen3 module imports it through torch._dynamo, before tokenspeed_kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
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


@pytest.fixture(scope="module")
def mooncake_master(tmp_path_factory):
    """A real ``mooncake_master`` on loopback, one per test module that asks for it."""
    from helpers.mooncake import NO_MOONCAKE, WHY

    from tokenspeed_aio.bench.deployment import MooncakeMaster

    if NO_MOONCAKE:
        pytest.skip(WHY)
    master = MooncakeMaster(tmp_path_factory.mktemp("mooncake") / "master.log").start()
    yield master
    master.kill()


@pytest.fixture
async def start_engine():
    """Start engines for a test; each is leak-checked and shut down at teardown."""
    engines = []

    from tokenspeed_aio.api.engine import AsyncEngine
    from tokenspeed_aio.args import EngineArgs

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
