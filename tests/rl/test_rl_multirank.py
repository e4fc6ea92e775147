"""The RL step across ranks: TP 2 and attention DP 2, one step each way the weights travel
(a gloo broadcast, a checkpoint on disk, torch multiprocessing tensors). The same-round gate
keeps the ranks in step (every rank enters the trainer's collectives in the same round),
and a refusal on one rank loads nothing anywhere."""

from __future__ import annotations

import asyncio

import pytest

from rl.harness import GREEDY, assert_matches, generate, rl_step
from tokenspeed_aio import AsyncEngine, EngineArgs
from tokenspeed_aio.api.control import EngineControlError

SMALL = dict(max_model_len=512, page_size=4, num_kv_blocks=256, max_num_seqs=16)


async def test_rl_step_tp2_and_a_refusal_on_one_rank(ckpt, tmp_path):
    source = ckpt("llama")
    async with await AsyncEngine.start(EngineArgs(model=str(source), tp=2, **SMALL)) as engine:
        step1, step2, step3 = (tmp_path / f"step-{i}" for i in (1, 2, 3))
        await rl_step(engine, source, step1, "distributed", num_ranks=2, version="step-1")
        await rl_step(engine, step1, step2, "disk", num_ranks=2, version="step-2")
        await rl_step(engine, step2, step3, "tensor", num_ranks=2, version="step-3")
        # TP rank 1's payload is unreadable: its staging refuses, so no rank loads.
        good = (step1 / "model.safetensors").read_bytes()
        with pytest.raises(EngineControlError) as refused:
            await engine.update_weights_from_tensor(
                [good, b"not a safetensors file"], "safetensors", weight_version="bad"
            )
        assert refused.value.status == 400
        assert "rank 1" in refused.value.message and "safetensors" in refused.value.message
        assert engine.weight_version == "step-3"
        assert_matches(await generate(engine), step3)  # both ranks kept step 3's weights
        await engine.check_idle()


async def test_rl_step_dp2_and_a_flush_refused_on_one_replica(ckpt, tmp_path):
    source = ckpt("llama")
    async with await AsyncEngine.start(EngineArgs(model=str(source), dp=2, **SMALL)) as engine:
        step1, step2 = tmp_path / "step-1", tmp_path / "step-2"
        await rl_step(engine, source, step1, "distributed", num_ranks=2, version="v1")
        await rl_step(engine, step1, step2, "tensor", num_ranks=2, version="v2")
        await rl_step(engine, step2, tmp_path / "step-3", "disk", num_ranks=2, version="v3")
        await engine.wait_idle()
        cached = {r: load.resident_blocks for r, (load, _) in engine.frontend.loads.items()}
        assert all(cached.values()), cached  # both replicas hold cached prefixes
        # A request that holds KV blocks on one replica: that replica refuses the flush,
        # so the other one must not flush either.
        long = GREEDY.__class__(max_tokens=400, temperature=0.0, ignore_eos=True)
        stream = engine.generate(prompt_token_ids=[7, 8, 9], sampling_params=long)
        first = await anext(stream)
        assert not first.finished
        with pytest.raises(EngineControlError) as refused:
            await engine.flush_cache()
        assert refused.value.status == 409 and "hold KV blocks" in refused.value.message
        await stream.aclose()  # aborts it
        await engine.wait_idle()
        await asyncio.sleep(0.05)
        after = {r: load.resident_blocks for r, (load, _) in engine.frontend.loads.items()}
        assert all(after[r] >= cached[r] for r in cached), (cached, after)  # nothing flushed
        await engine.flush_cache()  # idle now: every replica flushes
        for _ in range(100):
            loads = [load for load, _ in engine.frontend.loads.values()]
            if all(load.resident_blocks == 0 for load in loads):
                break
            await asyncio.sleep(0.02)
        assert all(load.resident_blocks == 0 for load, _ in engine.frontend.loads.values())
        await engine.check_idle()
