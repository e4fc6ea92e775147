"""A load that fails once it started (the trainer died mid-broadcast) invalidates the
weights on every rank and says so; nothing runs on them again."""

from __future__ import annotations

import pytest

from rl.harness import GREEDY, GROUP, Trainer, free_port
from tokenspeed_aio.api.control import EngineControlError
from tokenspeed_aio.errors import EngineError

SMALL = dict(max_model_len=512, page_size=4, num_kv_blocks=256, max_num_seqs=8)


async def test_a_trainer_dying_mid_broadcast_invalidates_the_weights(ckpt, start_engine, tmp_path):
    source = ckpt("llama")
    engine = await start_engine(source, **SMALL)
    port = free_port()
    trainer = await Trainer.start(
        "distributed", source, tmp_path / "step", port=port, world_size=2, group=GROUP, stop_after=3
    )
    manifest = await trainer.manifest()
    await engine.init_weights_update_group("127.0.0.1", port, 1, 2, GROUP, "gloo")
    with pytest.raises(EngineControlError) as failed:
        await engine.update_weights_from_distributed(
            manifest["names"], manifest["dtypes"], manifest["shapes"], GROUP, weight_version="v2"
        )
    assert failed.value.status == 500
    assert "invalid on every rank" in failed.value.message and "restart" in failed.value.message
    assert engine.weight_version == "default"
    assert await trainer.finish() == 3
    with pytest.raises(EngineError) as refused:  # nothing runs on invalid weights
        async for _ in engine.generate(prompt_token_ids=[5, 6], sampling_params=GREEDY):
            pass
    assert refused.value.status == 503 and "invalid" in refused.value.message
