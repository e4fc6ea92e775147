"""The real round with the L2 host tier (EventLoop, its cache_ops subsystem and the
scheduler's host tier over the model-free SimDataPlane with host pages): greedy tokens
equal the reference while write-backs, load-backs and retraction images run -- both
write policies, depth 0 and 1, chunked prefill, acknowledgments landing late -- and
the loop's own leak check passes after every run (no device block, host block, snapshot
page or open cache op left)."""

from __future__ import annotations

import random

import pytest
from helpers.sim_engine import SimEngine, at_depths, expected
from helpers.sim_host import SimHostDevice

from tokenspeed_aio.control.cache_ops import CacheOpError
from tokenspeed_aio.scheduler.cache_ops import WRITE_BACK, WRITE_POLICIES, WRITE_THROUGH
from tokenspeed_aio.scheduler.scheduler import HostTierConfig


def prompts(n: int, seed: int = 0, lo: int = 1, hi: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(97) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def tier(policy: str = WRITE_THROUGH, blocks: int = 64, pages: int = 16, states: int = 8):
    return HostTierConfig(blocks, pages, states, policy)


def tier_stats(engine: SimEngine):
    return engine.scheduler.host_tier.stats


@pytest.mark.parametrize("policy", WRITE_POLICIES)
@pytest.mark.parametrize("budget", [64, 7])
@pytest.mark.parametrize("ack_delay", [0, 2])
async def test_retraction_restores_without_recompute(policy, budget, ack_delay):
    """15 usable blocks of 4 tokens cannot hold 6 requests growing to ~50 tokens: victims
    are imaged and restored, and every token equals the reference."""
    ps = prompts(6, seed=7, lo=5, hi=20)

    async def scenario(engine: SimEngine) -> None:
        for i, p in enumerate(ps):
            engine.generate(f"r{i}", p, max_tokens=30)
        await engine.run()
        for i, p in enumerate(ps):
            assert engine.stream(f"r{i}").tokens == expected(p, 30), i
        stats = tier_stats(engine)
        assert stats.images > 0 and stats.restores == stats.images
        assert engine.device.executed["snapshot"] == engine.device.executed["restore"]
        assert engine.scheduler.num_retractions >= stats.images

    tokens = await at_depths(
        scenario,
        host=tier(policy),
        ack_delay=ack_delay,
        num_blocks=16,
        max_num_seqs=6,
        max_num_batched_tokens=budget,
    )
    assert tokens[0] == tokens[1]


async def test_a_restored_request_computes_no_position_twice():
    computed: dict[str, int] = {}

    def check(plan) -> None:
        for row in plan.rows:
            assert row.start == computed.get(row.rid, 0), (row.rid, row.start)
            computed[row.rid] = row.end

    engine = SimEngine(host=tier(), on_execute=check, num_blocks=12, max_num_seqs=6)
    ps = prompts(5, seed=9, lo=8, hi=16)
    for i, p in enumerate(ps):
        engine.generate(f"r{i}", p, max_tokens=20)
    await engine.run()
    assert tier_stats(engine).restores > 0
    for i, p in enumerate(ps):
        assert engine.stream(f"r{i}").tokens == expected(p, 20)
    await engine.shutdown()


@pytest.mark.parametrize("policy", WRITE_POLICIES)
async def test_a_prefix_evicted_from_the_device_is_loaded_back_from_l2(policy):
    """Other traffic evicts a shared prefix from a small device pool; the next request with
    it hits L2: its first fresh blocks are loaded, not computed, in the same round."""
    shared = list(range(10, 34))  # 24 tokens = 6 full blocks

    async def scenario(engine: SimEngine) -> None:
        a = engine.generate("a", shared + [1, 2], max_tokens=3)
        await engine.run()
        for i, p in enumerate(prompts(4, seed=5, lo=20, hi=30)):  # they evict a's blocks
            engine.generate(f"x{i}", p, max_tokens=3)
        await engine.run()
        before = len(engine.data_plane.plans)
        b = engine.generate("b", shared + [7, 8, 9], max_tokens=4)
        await engine.run()
        plan = next(p for p in engine.data_plane.plans[before:] if p.rows)
        assert plan.cache is not None and plan.cache.loads, "b's prefix was not loaded back"
        assert plan.rows[0].start == b.outputs[0].num_cached_tokens >= 20
        assert tier_stats(engine).l2_hit_tokens >= 20
        assert a.tokens == expected(shared + [1, 2], 3)
        assert b.tokens == expected(shared + [7, 8, 9], 4)

    tokens = await at_depths(scenario, host=tier(policy), ack_delay=1, num_blocks=12)
    assert tokens[0] == tokens[1]


async def test_no_image_fits_and_the_victim_recomputes():
    ps = prompts(6, seed=7, lo=5, hi=20)
    engine = SimEngine(host=tier(pages=0, states=0), num_blocks=16, max_num_seqs=6)
    for i, p in enumerate(ps):
        engine.generate(f"r{i}", p, max_tokens=30)
    await engine.run()
    assert engine.scheduler.num_retractions > 0 and tier_stats(engine).images == 0
    for i, p in enumerate(ps):
        assert engine.stream(f"r{i}").tokens == expected(p, 30)
    await engine.shutdown()


@pytest.mark.parametrize("policy", WRITE_POLICIES)
@pytest.mark.parametrize("depth", [0, 1])
async def test_random_cancellations_leak_nothing(policy, depth):
    """1,000 requests sharing prefixes under a small device pool, about a third cancelled
    at random moments (waiting, prefilling, decoding, imaged, being restored), cache ops
    landing up to two rounds late. The shutdown's leak check then finds no device block,
    host block, snapshot page or open cache op held, and every stream ended once."""
    rng = random.Random(depth * 2 + (policy == WRITE_BACK))
    engine = SimEngine(
        depth=depth,
        host=tier(policy, blocks=48, pages=8, states=4),
        ack_delay=2,
        num_blocks=24,
        max_num_batched_tokens=32,
    )
    bases = [[rng.randrange(97) for _ in range(24)] for _ in range(4)]
    live: list[str] = []
    for i in range(1000):
        prompt = bases[rng.randrange(4)][: rng.randint(4, 24)] + [rng.randrange(97)]
        engine.generate(f"r{i}", prompt, max_tokens=rng.randint(1, 12))
        live.append(f"r{i}")
        for _ in range(rng.randint(0, 2)):
            await engine.round()
        if rng.random() < 0.35:
            engine.abort(live.pop(rng.randrange(len(live))))
        live = [rid for rid in live if not engine.stream(rid).finished]
    await engine.run()
    stats = tier_stats(engine)
    assert stats.images > 0 and stats.restores > 0 and stats.l2_hit_tokens > 0
    aborted = sum(engine.stream(f"r{i}").finish_reason == "abort" for i in range(1000))
    assert aborted > 100
    await engine.shutdown()  # check_idle: scheduler, both tiers, cache ops, outputs
    assert engine.loop.cache_ops.open == 0


class RepeatingDevice(SimHostDevice):
    """Acknowledges its third landed op twice."""

    def poll(self) -> list[int]:
        acks = super().poll()
        self.landed = getattr(self, "landed", 0) + len(acks)
        if acks and self.landed >= 3 and not getattr(self, "repeated", False):
            self.repeated = True
            acks.append(acks[-1])
        return acks


async def test_a_repeated_acknowledgment_stops_the_round():
    engine = SimEngine(host=tier(), num_blocks=16, max_num_seqs=6)
    engine.data_plane.device = engine.device = RepeatingDevice(16, 4, 6, 64, 16, 8)
    for i, p in enumerate(prompts(6, seed=7, lo=5, hi=20)):
        engine.generate(f"r{i}", p, max_tokens=30)
    with pytest.raises(CacheOpError, match="acknowledged twice"):
        await engine.run()
