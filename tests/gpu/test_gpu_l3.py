"""The L3 tier on a GPU (the file backend over pinned L2 pages): a second engine on the
same store answers the first one's prompts from L3 with the tokens of an engine without
it and of transformers in fp32, at depth 0 and 1, with no host sync and no JIT compile on
the serving path."""

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


async def _run(args: EngineArgs, prompts):
    async with await AsyncEngine.start(args) as engine:
        outs = await final_outputs(engine, prompts, GREEDY)
        await engine.check_idle()
        storage = engine.control_loop.scheduler.storage
        fetched = storage.stats.fetched_tokens if storage is not None else 0
    return [o.token_ids for o in outs], [o.num_cached_tokens for o in outs], fetched


@pytest.mark.parametrize("depth", [0, 1])
async def test_l3_on_gpu_matches_l3_off_and_transformers(ckpt, tmp_path, depth):
    path = ckpt("llama")
    base = EngineArgs(
        model=str(path), device="cuda", dtype="float32", max_model_len=1024, page_size=4,
        num_kv_blocks=512, in_flight_depth=depth,
    )  # fmt: skip
    prompts = [p for p in parity_prompts() if len(p) > 16]
    off, _, _ = await _run(base, prompts)
    l3 = base.replace(kvstore_storage_backend="file", kvstore_storage_dir=str(tmp_path))
    first, _, _ = await _run(l3, prompts)
    second, cached, fetched = await _run(l3, prompts)
    assert first == off and second == off
    assert cached == [(len(p) - 1) // 4 * 4 for p in prompts] and fetched == sum(cached)
    for ids, tokens in zip(prompts, second):
        assert tokens == hf_greedy(str(path), tuple(ids), 12)[0]
