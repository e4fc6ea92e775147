"""The real round with the L3 tier (EventLoop, its storage agreement, the scheduler's
storage tier) over the model-free SimDataPlane with a shared sim store: a second engine
answers the first one's prompts from the store with the reference's tokens, with ops
landing late and failing at random, at depth 0 and 1; random aborts, many while
preparing, leak nothing; two ranks whose executors answer differently agree, a store down
on one rank prepares and publishes nothing on either, and a rank's invalid report stops
both in the same round."""

from __future__ import annotations

import asyncio
import random

import pytest
from helpers.fake_group import FakeGroup
from helpers.sim_engine import SimEngine, expected
from helpers.sim_store import SimStore

from tokenspeed_aio.collective.errors import CollectiveError
from tokenspeed_aio.control.storage import StorageResult
from tokenspeed_aio.scheduler.request import Status
from tokenspeed_aio.scheduler.scheduler import HostTierConfig

HOST = HostTierConfig(64, 16, 8)


def shared_prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    stems = [[rng.randrange(97) for _ in range(rng.randint(8, 30))] for _ in range(3)]
    return [
        rng.choice(stems) + [rng.randrange(97) for _ in range(rng.randint(1, 9))] for _ in range(n)
    ]


@pytest.mark.parametrize("depth", [0, 1])
@pytest.mark.parametrize(("delay", "fail"), [(0, 0.0), (3, 0.0), (2, 0.3)])
async def test_a_second_engine_answers_from_the_store(depth, delay, fail):
    store = SimStore()
    ps = shared_prompts(10, seed=depth + 7 * delay)
    kw = dict(host=HOST, store=store, storage_delay=delay, storage_fail=fail)
    first = SimEngine(depth=depth, seed=1, **kw)
    for i, p in enumerate(ps[:5]):
        first.generate(f"a{i}", p, max_tokens=8)
    await first.run()
    await first.shutdown()
    assert store.objects
    second = SimEngine(depth=depth, seed=2, **kw)
    for i, p in enumerate(ps):
        second.generate(f"b{i}", p, max_tokens=8)
    await second.run()
    for i, p in enumerate(ps):
        assert second.stream(f"b{i}").tokens == expected(p, 8), i
    stats = second.scheduler.storage.stats
    if not fail:
        assert stats.fetched_tokens > 0, stats
        assert sum(second.stream(f"b{i}").outputs[0].num_cached_tokens for i in range(5)) > 0
    await second.shutdown()  # the leak check: no block, host block or storage op left


async def test_random_aborts_while_preparing_leak_nothing():
    store = SimStore()
    rng = random.Random(5)
    warm = SimEngine(depth=1, host=HOST, store=store, seed=3)
    ps = shared_prompts(60, seed=11)
    for i, p in enumerate(ps[:6]):
        warm.generate(f"w{i}", p, max_tokens=4)
    await warm.run()
    await warm.shutdown()
    engine = SimEngine(depth=1, host=HOST, store=store, storage_delay=4, seed=4)
    live = {}
    for i, p in enumerate(ps):
        live[f"r{i}"] = engine.generate(f"r{i}", p, max_tokens=6)
        if rng.random() < 0.5:
            await engine.round()
        preparing = [r for r in engine.scheduler.storage.preparing if rng.random() < 0.5]
        for rid in preparing + [r for r in live if rng.random() < 0.05]:
            engine.abort(rid)
    await engine.run()
    stats = engine.scheduler.storage.stats
    assert stats.ended_preparing >= 5, stats
    for i, p in enumerate(ps):
        stream = engine.stream(f"r{i}")
        if stream.finish_reason != "abort":
            assert stream.tokens == expected(p, 6), i
    await engine.shutdown()


def ranks(**kw) -> tuple[FakeGroup, SimEngine, SimEngine]:
    group = FakeGroup(2)
    owner = SimEngine(group=group.member(0), seed=1, **kw)
    member = SimEngine(group=group.member(1), is_owner=False, seed=2, **kw)
    return group, owner, member


async def test_two_ranks_agree_on_every_storage_op():
    store = SimStore()
    warm = SimEngine(depth=1, host=HOST, store=store, seed=9)
    ps = shared_prompts(12, seed=3)
    for i, p in enumerate(ps[:4]):
        warm.generate(f"w{i}", p, max_tokens=4)
    await warm.run()
    await warm.shutdown()
    # each rank's executor answers late and fails at random, differently
    group, owner, member = ranks(depth=1, host=HOST, store=store, storage_delay=3, storage_fail=0.2)
    for i, p in enumerate(ps):
        owner.generate(f"r{i}", p, max_tokens=6)
    while owner.busy() or not member.loop.idle():
        await asyncio.gather(owner.round(), member.round())
    for i, p in enumerate(ps):
        assert owner.stream(f"r{i}").tokens == expected(p, 6), i
    assert owner.scheduler.storage.stats == member.scheduler.storage.stats
    assert [len(p.rows) for p in owner.data_plane.plans] == [
        len(p.rows) for p in member.data_plane.plans
    ]
    assert group.member(0).calls == group.member(1).calls


@pytest.mark.parametrize("down", [0, 1])
async def test_a_store_down_on_one_rank_is_used_by_neither(down):
    store = SimStore()
    _, owner, member = ranks(depth=1, host=HOST, store=store)
    ps = shared_prompts(8, seed=5)

    async def serve(prefix: str, prompts: list[list[int]]) -> None:
        for i, p in enumerate(prompts):
            owner.generate(f"{prefix}{i}", p, max_tokens=4)
        while owner.busy() or not member.loop.idle():
            await asyncio.gather(owner.round(), member.round())
        for i, p in enumerate(prompts):
            assert owner.stream(f"{prefix}{i}").tokens == expected(p, 4), i

    (owner, member)[down].storage.up = False
    await serve("d", ps[:4])  # every request recomputes: no QUERY, no PUT on either rank
    for engine in (owner, member):
        assert engine.storage.executed == {}, engine.storage.executed
        stats = engine.scheduler.storage.stats
        assert stats.unprepared > 0 and stats.queries == 0 and stats.dropped_puts > 0, stats
    assert owner.scheduler.storage.stats == member.scheduler.storage.stats
    (owner, member)[down].storage.up = True
    await serve("u", ps[4:])  # back up on both: prepared and published again
    for engine in (owner, member):
        assert engine.storage.executed.get("query", 0) > 0 and engine.storage.executed["put"] > 0
    assert owner.scheduler.storage.stats == member.scheduler.storage.stats


@pytest.mark.parametrize("bad", [0, 1])
async def test_an_invalid_report_stops_every_rank_in_the_same_round(bad):
    _, owner, member = ranks(depth=0, host=HOST, store=SimStore(), storage_delay=50)
    owner.generate("a", list(range(1, 30)), max_tokens=4)
    await asyncio.gather(owner.round(), member.round())
    assert owner.scheduler.requests["a"].status is Status.PREPARING
    (owner, member)[bad].storage.extra.append(StorageResult(999, True))  # never dispatched
    results = await asyncio.wait_for(
        asyncio.gather(owner.loop.run(), member.loop.run(), return_exceptions=True), 5
    )
    for err in results:
        assert isinstance(err, CollectiveError), err
        assert err.rank == bad and "storage op 999 was reported but is not open" in err.message
    assert owner.loop.stats.rounds == member.loop.stats.rounds
