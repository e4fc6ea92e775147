"""The L2 host tier on a GPU (pinned host pages, write and load streams, per-layer fences):
greedy tokens with the tier on -- retracting by restore and loading prefixes back --
equal the tier off and transformers in fp32, with no host sync and no JIT compile on the
serving path."""

from __future__ import annotations

import pytest
from helpers.generation import final_outputs
from helpers.prompts import parity_prompts
from helpers.reference import hf_greedy

from tokenspeed_aio.api.engine import AsyncEngine
from tokenspeed_aio.args import EngineArgs
from tokenspeed_aio.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(autouse=True)
def strict_data_plane(monkeypatch):
    monkeypatch.setenv("TOKENSPEED_DATA_PLANE_SYNC_DEBUG", "error")
    monkeypatch.setenv("TOKENSPEED_JIT_COMPILE_CHECK", "error")


async def _tokens(args: EngineArgs, prompts, passes: int = 2):
    async with await AsyncEngine.start(args) as engine:
        out = []
        for _ in range(passes):
            out.append([o.token_ids for o in await final_outputs(engine, prompts, GREEDY)])
        await engine.check_idle()
        loop = engine.control_loop
        tier = loop.scheduler.host_tier
        counts = None
        if tier is not None:
            counts = (tier.stats.restores, loop.cache_ops.stats.get("load_back").ops)
    return out, counts


@pytest.mark.parametrize("depth", [0, 1])
@pytest.mark.parametrize("policy", ["write_through", "write_back"])
async def test_l2_on_gpu_matches_l2_off_and_transformers(ckpt, depth, policy):
    path = ckpt("llama")
    base = EngineArgs(
        model=str(path),
        device="cuda",
        dtype="float32",
        max_model_len=1024,
        page_size=4,
        num_kv_blocks=80,
        chunked_prefill_size=512,
        in_flight_depth=depth,
    )
    prompts = parity_prompts()
    off, _ = await _tokens(base, prompts)
    on, (restores, loads) = await _tokens(
        base.replace(kvstore_ratio=4.0, kvstore_write_policy=policy), prompts
    )
    assert restores > 0 and loads > 0, (restores, loads)
    assert on == off
    for ids, got in zip(prompts, on[0]):  # transformers in fp32 (on the CPU)
        assert got == hf_greedy(str(path), tuple(ids), 12)[0], f"prompt of {len(ids)} tokens"
