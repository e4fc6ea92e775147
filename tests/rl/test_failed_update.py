"""A trainer that dies mid-broadcast fails the update before any rank loads a tensor:
the update is refused (502, naming the tensor it stopped at), the weights in use stay
as they were and the engine serves on with them."""

from __future__ import annotations

import pytest

from rl.harness import GROUP, Trainer, assert_matches, generate
from tokenspeed_aio.api.control import EngineControlError
from tokenspeed_aio.bench.ports import free_port

SMALL = dict(max_model_len=512, page_size=4, num_kv_blocks=256, max_num_seqs=8)


async def test_a_trainer_dying_mid_broadcast_keeps_the_old_weights(ckpt, start_engine, tmp_path):
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
    assert failed.value.status == 502
    message = failed.value.message
    assert "broadcast failed at tensor 4 of" in message and "unchanged" in message, message
    assert engine.weight_version == "default"
    assert await trainer.finish() == 3
    assert_matches(await generate(engine), source)  # the old weights, untouched
    await engine.destroy_weights_update_group(GROUP)
