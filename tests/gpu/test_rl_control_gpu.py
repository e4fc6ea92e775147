"""The RL control operations on a GPU: a release gives the device its memory back and a
resume keeps the CUDA graphs valid (CUDA virtual memory, --enable-memory-saver); a
tensor update carries CUDA IPC handles from a trainer process."""

from __future__ import annotations

import pytest
from rl.harness import PROMPTS, Trainer, assert_matches, generate

from tokenspeed_aio.api.control import EngineControlError
from tokenspeed_aio.api.engine import AsyncEngine
from tokenspeed_aio.args import EngineArgs


@pytest.fixture(autouse=True)
def strict_data_plane(monkeypatch):
    monkeypatch.setenv("TOKENSPEED_DATA_PLANE_SYNC_DEBUG", "error")
    monkeypatch.setenv("TOKENSPEED_JIT_COMPILE_CHECK", "error")


def free_bytes() -> int:
    import torch

    from tokenspeed_aio.guards.host_sync import allow_host_sync

    with allow_host_sync():
        torch.cuda.synchronize()
        return torch.cuda.mem_get_info()[0]


async def test_release_returns_the_memory_and_resume_keeps_the_graphs(ckpt):
    path = ckpt("llama")
    args = EngineArgs(
        model=str(path), device="cuda", dtype="float32", max_model_len=1024,
        num_kv_blocks=4096, enable_memory_saver=True,
    )  # fmt: skip
    async with await AsyncEngine.start(args) as engine:
        before = await generate(engine)
        assert_matches(before, path)
        held = free_bytes()
        await engine.release_memory_occupation(["weights", "kv_cache"])
        released = free_bytes()
        kv_bytes = (
            2 * 2 * 4096 * 4 * 2 * 16 * 4
        )  # layers * (k, v) * blocks * page * heads * dim * fp32
        assert released - held >= 0.9 * kv_bytes, (held, released)
        await engine.resume_memory_occupation()
        after = await generate(engine)  # decode rounds replay the graphs captured before
        assert [o.token_ids for o in after] == [o.token_ids for o in before]
        await engine.check_idle()


async def test_release_without_the_memory_saver_is_refused(ckpt):
    args = EngineArgs(model=str(ckpt("llama")), device="cuda", max_model_len=512)
    async with await AsyncEngine.start(args) as engine:
        with pytest.raises(EngineControlError) as refused:
            await engine.release_memory_occupation(["kv_cache"])
        assert refused.value.status == 409 and "--enable-memory-saver" in refused.value.message
        await engine.resume_memory_occupation()  # nothing released: a no-op
        assert len(await generate(engine)) == len(PROMPTS)


async def test_a_tensor_update_by_cuda_ipc_handles(ckpt, tmp_path):
    source = ckpt("llama")
    args = EngineArgs(model=str(source), device="cuda", dtype="float32", max_model_len=512)
    async with await AsyncEngine.start(args) as engine:
        trainer = await Trainer.start("tensor", source, tmp_path / "step", device="cuda")
        await trainer.expect("ready")
        payload = (tmp_path / "step" / "payload.bin").read_bytes()
        result = await engine.update_weights_from_tensor([payload], weight_version="ipc")
        assert result.ok
        assert await trainer.finish() == 0
        assert_matches(await generate(engine), tmp_path / "step")
