"""The L3 tier in-process, on the file store, beyond the parity suite's cases (a fresh engine
answering from the store, in tests/engine/test_hf_parity.py and, for TP 2,
tests/multirank/test_multirank.py): a pool small enough to retract while L3 publishes and
fetches, and flush_cache deleting the deployment's namespace."""

from __future__ import annotations

from helpers.generation import final_outputs
from helpers.prompts import parity_prompts
from helpers.reference import hf_greedy

from tokenspeed_aio.sampling_params import SamplingParams

MAX_TOKENS = 8
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def l3_counts(engine) -> dict:
    loop = engine.control_loop
    st = loop.scheduler.storage.stats
    ops = loop.storage.stats
    return {
        "query_hit_tokens": st.query_hit_tokens,
        "fetched_tokens": st.fetched_tokens,
        "recomputed_tokens": st.recomputed_tokens,
        "puts": ops.ops.get("put", 0),
        "put_bytes": ops.bytes.get("put", 0),
        "get_bytes": ops.bytes.get("get", 0),
        "failures": dict(ops.failures),
        "timeouts": ops.timeouts,
        "retractions": loop.scheduler.num_retractions,
    }


async def test_small_pool_retracts_with_l3(ckpt, start_engine, tmp_path):
    """A pool that retracts (images restored from L2) while L3 publishes and fetches: the
    tokens still equal transformers', on both engines."""
    path = ckpt("llama")
    flags = dict(
        kvstore_storage_backend="file",
        kvstore_storage_dir=str(tmp_path / "l3"),
        num_kv_blocks=80,
        kvstore_ratio=4.0,
        chunked_prefill_size=512,
    )
    prompts = parity_prompts()
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)  # they grow
    want = [hf_greedy(str(path), tuple(ids), 12)[0] for ids in prompts]
    counts = []
    for attempt in range(2):
        engine = await start_engine(path, **flags)
        outs = await final_outputs(engine, prompts, params)
        assert [o.token_ids for o in outs] == want, attempt
        await engine.check_idle()
        counts.append(l3_counts(engine))
        await engine.shutdown()
    assert counts[0]["retractions"] > 0 and counts[0]["puts"] > 0, counts
    assert counts[1]["fetched_tokens"] > 0, counts


async def test_flush_cache_deletes_the_namespace(ckpt, start_engine, tmp_path):
    path = ckpt("llama")
    store = tmp_path / "l3"
    flags = dict(kvstore_storage_backend="file", kvstore_storage_dir=str(store))
    prompts = [p for p in parity_prompts() if len(p) > 16]
    engine = await start_engine(path, **flags)
    await final_outputs(engine, prompts, GREEDY)
    await engine.check_idle()
    (namespace,) = store.iterdir()
    assert any(namespace.iterdir())
    result = await engine.flush_cache()
    assert result.ok, result
    assert list(store.iterdir()) == []
    outs = await final_outputs(engine, prompts, GREEDY)  # nothing cached anywhere now
    assert [o.num_cached_tokens for o in outs] == [0] * len(prompts)
    assert l3_counts(engine)["fetched_tokens"] == 0
    await engine.check_idle()
    await engine.shutdown()
    fresh = await start_engine(path, **flags)  # ... and published again after the flush
    outs = await final_outputs(fresh, prompts, GREEDY)
    assert [o.num_cached_tokens for o in outs] == [(len(p) - 1) // 4 * 4 for p in prompts]
