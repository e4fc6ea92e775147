"""The L2 host tier and retraction images end to end, on the tiny models: greedy tokens
with the tier on (both write policies, depth 0 and 1, chunked prefill) equal
transformers' -- on runs that are made to retract (restored from images, not recomputed)
and to load prefixes back from L2, which the tests assert happened."""

from __future__ import annotations

import asyncio

import pytest
from helpers.generation import final_outputs
from helpers.prompts import parity_prompts
from helpers.reference import hf_greedy

from tokenspeed_aio.api.engine import AsyncEngine
from tokenspeed_aio.args import EngineArgs
from tokenspeed_aio.sampling_params import SamplingParams
from tokenspeed_aio.scheduler.kv_events import CPU, BlockStored

MAX_TOKENS = 12
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
# 79 usable blocks of 4 tokens: the parity prompts' growth retracts (see test_hf_parity);
# going over them again finds most of their prefixes evicted from the device, in L2.
SMALL_POOL = dict(num_kv_blocks=80, kvstore_ratio=4.0)
CONFIGS = {
    "retraction": dict(chunked_prefill_size=512),
    "chunked": dict(chunked_prefill_size=64),
}


def tier_counts(engine) -> dict[str, int]:
    loop = engine.control_loop
    stats = loop.scheduler.host_tier.stats
    ops = loop.cache_ops.stats
    return {
        "restores": stats.restores,
        "l2_hit_tokens": stats.l2_hit_tokens,
        "load_backs": ops.get("load_back").ops,
        "write_backs": ops.get("write_back").ops,
        "preemptions": loop.scheduler.num_retractions,
    }


@pytest.mark.parametrize("depth", [0, 1])
@pytest.mark.parametrize("policy", ["write_through", "write_back"])
@pytest.mark.parametrize("config", list(CONFIGS))
async def test_greedy_with_l2_matches_transformers(ckpt, start_engine, depth, policy, config):
    path = ckpt("llama")
    engine = await start_engine(
        path,
        in_flight_depth=depth,
        kvstore_write_policy=policy,
        **SMALL_POOL,
        **CONFIGS[config],
    )
    prompts = parity_prompts()
    for _ in range(2):  # the second time round loads evicted prefixes back from L2
        outs = await final_outputs(engine, prompts, GREEDY)
        for ids, out in zip(prompts, outs):
            assert out.token_ids == hf_greedy(str(path), tuple(ids), MAX_TOKENS)[0], len(ids)
    counts = tier_counts(engine)
    assert counts["restores"] > 0, counts  # retraction by restore happened ...
    assert counts["load_backs"] > 0 and counts["l2_hit_tokens"] > 0, counts  # ... and L2 hits
    assert counts["write_backs"] > 0, counts


async def test_restore_keeps_penalties_and_seeded_sampling(ckpt, start_engine):
    """A victim's slot state (penalty counts, sampling settings, its future token) survives
    retraction by restore: the tokens equal a run that never retracts. Every request has
    settings of its own, so a slot restored with another's would sample differently."""
    from helpers.generation import final_output

    path = ckpt("qwen3")
    prompts = parity_prompts(seed=3)
    params = [
        SamplingParams(
            max_tokens=16,
            temperature=0.5 + 0.1 * i,
            seed=7 + i,
            repetition_penalty=1.0 + 0.1 * (i % 4),
            frequency_penalty=0.2 * (i % 3),
            ignore_eos=True,
        )
        for i in range(len(prompts))
    ]

    async def run(engine):
        outs = await asyncio.gather(
            *(final_output(engine, p, ids) for ids, p in zip(prompts, params))
        )
        return [o.token_ids for o in outs]

    roomy = await start_engine(path, num_kv_blocks=512)
    want = await run(roomy)
    assert roomy.control_loop.scheduler.num_retractions == 0
    tight = await start_engine(path, **SMALL_POOL)
    got = await run(tight)
    assert tier_counts(tight)["restores"] > 0
    assert got == want


async def test_write_through_publishes_cpu_kv_events(ckpt, start_engine):
    engine = await start_engine(ckpt("llama"), kvstore_ratio=2.0)
    batches = []
    engine.control_loop.kv_events.subscribe(batches.append)
    await final_outputs(engine, [list(range(5, 45))], GREEDY)
    await engine.check_idle()
    stored = [e for batch in batches for e in batch if isinstance(e, BlockStored)]
    gpu = {e.block_hash for e in stored if e.medium != CPU}
    cpu = {e.block_hash for e in stored if e.medium == CPU}
    assert len(gpu) >= 10 and cpu == gpu  # every full block reached L2, same keys


async def test_random_cancellations_leak_no_block_or_op(ckpt, start_engine):
    """Requests cancelled at random moments while the tier retracts, restores, loads and
    writes back: afterwards the device and host pools are empty and no cache op is open
    (start_engine's teardown runs check_idle, which checks all three)."""
    import random

    engine = await start_engine(ckpt("llama"), in_flight_depth=1, **SMALL_POOL)
    rng = random.Random(0)
    prompts = parity_prompts() + parity_prompts(seed=4)

    async def one(ids):
        params = SamplingParams(max_tokens=rng.randint(1, 20), temperature=0.0, ignore_eos=True)
        task = asyncio.ensure_future(final_outputs(engine, [ids], params))
        await asyncio.sleep(rng.random() * 0.3)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    await asyncio.gather(*(one(ids) for ids in prompts * 3))
    await engine.check_idle()
    assert engine.control_loop.cache_ops.open == 0


async def test_host_pool_larger_than_memory_fails_at_startup(ckpt):
    with pytest.raises(ValueError, match=r"kvstore: the host KV pools need .* GiB"):
        await AsyncEngine.start(
            EngineArgs(model=str(ckpt("llama")), page_size=4, kvstore_size_gb=100_000.0)
        )


@pytest.mark.parametrize(
    ("mode", "message"), [("duplicate", "acknowledged twice"), ("drop", "lost")]
)
async def test_broken_acknowledgment_stops_the_engine(ckpt, monkeypatch, mode, message):
    """A repeated or lost ACK injected on the data-plane side is a CacheOpError that stops
    the rank: every request fails at once, nothing hangs."""
    from tokenspeed_aio.errors import EngineDeadError

    monkeypatch.setenv("TOKENSPEED_INJECT_CACHE_ACK", f"{mode},after=2")
    engine = await AsyncEngine.start(
        EngineArgs(model=str(ckpt("llama")), page_size=4, num_kv_blocks=80, kvstore_ratio=2.0)
    )
    try:
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(final_outputs(engine, parity_prompts(), GREEDY), 60)
        reason = await asyncio.wait_for(engine.stopped(), 10)
        assert "CacheOpError" in reason and message in reason, reason
    finally:
        await engine.shutdown()


async def test_constrained_requests_resume_their_grammar_after_restore(
    ckpt, start_engine, monkeypatch
):
    """A constrained victim's grammar matcher lives on its request in the control plane and
    survives retraction by restore as it is: its reply validates and equals the reply of a
    run that never retracts."""
    import json

    import jsonschema
    from helpers.generation import final_output
    from helpers.schemas import SCHEMAS

    from tokenspeed_aio.scheduler.host_tier import HostTier

    imaged = []
    try_image = HostTier.try_image

    def recording(self, plan, req):
        ok = try_image(self, plan, req)
        if ok and req.grammar is not None:
            imaged.append(req.rid)
        return ok

    monkeypatch.setattr(HostTier, "try_image", recording)
    path = ckpt("llama")
    schemas = SCHEMAS[:4]
    long_prompts = parity_prompts()

    async def run(engine):
        unconstrained = [final_output(engine, GREEDY, ids) for ids in long_prompts]
        constrained = [
            final_output(
                engine,
                SamplingParams(max_tokens=200, temperature=0.0, json_schema=json.dumps(s)),
                prompt="Reply:",
            )
            for s in schemas
        ]
        outs = await asyncio.gather(*unconstrained, *constrained)
        return outs[len(long_prompts) :]

    want = await run(await start_engine(path, num_kv_blocks=512))
    imaged.clear()
    tight = await start_engine(path, **SMALL_POOL)
    got = await run(tight)
    assert [o.text for o in got] == [o.text for o in want]
    for schema, out in zip(schemas, got):
        jsonschema.validate(json.loads(out.text), schema)
    assert tier_counts(tight)["restores"] > 0
    assert imaged, "no constrained request was imaged"


async def test_metrics_expose_the_tier_and_preemptions(ckpt, start_engine):
    import re

    from tokenspeed_aio.server.metrics import ServerMetrics

    engine = await start_engine(ckpt("llama"), **SMALL_POOL)
    for _ in range(2):
        await final_outputs(engine, parity_prompts(), GREEDY)
    await engine.check_idle()
    await asyncio.sleep(1.2)  # the idle heartbeat carries the last counts
    text, _ = ServerMetrics(engine.frontend, "m").render([], http_requests=0, http_sequences=0)
    values = {
        m[1]: float(m[2])
        for m in re.finditer(r"^(tokenspeed:\w+)\{[^}]*\} (\S+)$", text.decode(), re.M)
    }
    counts = tier_counts(engine)
    assert values["tokenspeed:num_preemptions_total"] == counts["preemptions"] > 0
    assert values["tokenspeed:l2_hit_tokens_total"] == counts["l2_hit_tokens"] > 0
    assert values["tokenspeed:retraction_restores_total"] == counts["restores"] > 0
    assert values["tokenspeed:l2_load_back_bytes_total"] > 0
    assert values["tokenspeed:l2_write_back_seconds_total"] > 0
    assert values["tokenspeed:l2_blocks_total"] == 4 * 79
    assert values["tokenspeed:l2_blocks_active"] == 0
