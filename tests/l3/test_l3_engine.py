"""The L3 tier in one engine process at a time (in-process engines): a second engine on
the same file store answers the first one's prompts with L3 hits and the same greedy
tokens as transformers; a store that stops answering only makes requests recompute."""

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
    }


async def test_file_store_serves_a_restarted_engine(ckpt, start_engine, tmp_path):
    path = ckpt("llama")
    flags = dict(kvstore_storage_backend="file", kvstore_storage_dir=str(tmp_path / "l3"))
    prompts = [p for p in parity_prompts() if len(p) > 16]
    want = [hf_greedy(str(path), tuple(ids), MAX_TOKENS)[0] for ids in prompts]
    first = await start_engine(path, **flags)
    outs = await final_outputs(first, prompts, GREEDY)
    assert [o.token_ids for o in outs] == want
    await first.check_idle()
    counts = l3_counts(first)
    assert counts["puts"] > 0 and counts["put_bytes"] > 0, counts
    await first.shutdown()

    second = await start_engine(path, **flags)
    outs = await final_outputs(second, prompts, GREEDY)
    assert [o.token_ids for o in outs] == want
    counts = l3_counts(second)
    full = sum((len(p) - 1) // 4 * 4 for p in prompts)
    assert counts["fetched_tokens"] == full, counts  # every hash-complete page came from L3
    assert [o.num_cached_tokens for o in outs] == [(len(p) - 1) // 4 * 4 for p in prompts]
