"""The real round (EventLoop over the model-free SimDataPlane): greedy tokens equal the
reference under chunked prefill, prefix caching, retraction, EOS, stop ids and length
limits, and are the same at in-flight depth 0 and 1. Every run ends with the loop's
own drain and leak check (no request, block, slot or forward left)."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from helpers.sim_engine import SimEngine, at_depths, expected

EOS = 5


def prompts(n: int, seed: int = 0, lo: int = 1, hi: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(97) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def assert_same_at_both_depths(tokens: dict[int, dict[str, list[int]]]) -> None:
    assert tokens[0] == tokens[1]


@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("budget", [64, 7])
async def test_tokens_match_reference(caching, budget):
    ps = prompts(10)

    async def scenario(engine: SimEngine) -> None:
        for i, p in enumerate(ps):
            engine.generate(f"r{i}", p, max_tokens=12)
        await engine.run()
        if budget < max(map(len, ps)):
            assert any(not row.sample for plan in engine.data_plane.plans for row in plan.rows)
        for i, p in enumerate(ps):
            stream = engine.stream(f"r{i}")
            assert stream.tokens == expected(p, 12), i
            assert stream.finish_reason == "length"

    tokens = await at_depths(scenario, enable_prefix_caching=caching, max_num_batched_tokens=budget)
    assert_same_at_both_depths(tokens)


async def test_requests_arriving_over_many_rounds_match_reference():
    """Continuous batching: arrivals while others prefill (in chunks) and decode."""
    ps = prompts(16, seed=2, hi=30)

    async def scenario(engine: SimEngine) -> None:
        for i, p in enumerate(ps):
            engine.generate(f"r{i}", p, max_tokens=3 + i % 7)
            await engine.round()
        await engine.run()
        for i, p in enumerate(ps):
            assert engine.stream(f"r{i}").tokens == expected(p, 3 + i % 7), i

    assert_same_at_both_depths(await at_depths(scenario, max_num_batched_tokens=9, max_num_seqs=4))


async def test_eos_finishes_and_the_in_flight_token_after_it_is_dropped():
    ps = prompts(12, seed=3)
    dropped = {}

    async def scenario(engine: SimEngine) -> None:
        for i, p in enumerate(ps):
            engine.generate(f"r{i}", p, max_tokens=60)
        await engine.run()
        for i, p in enumerate(ps):
            stream = engine.stream(f"r{i}")
            assert stream.tokens == expected(p, 60, [EOS]), i
        stopped = [f"r{i}" for i, p in enumerate(ps) if len(expected(p, 60, [EOS])) < 60]
        assert stopped, "no prompt reaches EOS: the test would check nothing"
        for rid in stopped:
            final = engine.stream(rid).final
            assert (final.finish_reason, final.stop_reason) == ("stop", EOS)
        # Sampling rows dispatched for a request after its EOS: their tokens never reach it.
        sampled = Counter(r.rid for plan in engine.data_plane.plans for r in plan.rows if r.sample)
        dropped[engine.loop.depth] = sum(
            n - len(engine.stream(rid).tokens) for rid, n in sampled.items()
        )

    assert_same_at_both_depths(await at_depths(scenario, eos_token_ids=[EOS]))
    assert dropped[0] == 0 and dropped[1] > 0


async def test_eos_stop_token_ids_and_min_tokens():
    p = [30, 38, 13, 92, 50, 61, 19, 11, 8]
    ref = expected(p, 20)
    # ref: 31 69 16 67 50 66 67 24 57 74 59 6 4 90 45 4 53 83 2 50
    eos, stop, twice = 16, 24, 4
    assert ref.index(eos) == 2 and ref.index(stop) == 7 and ref.count(eos) == 1
    assert [i for i, t in enumerate(ref) if t == twice] == [12, 15]

    async def scenario(engine: SimEngine) -> None:
        s_eos = engine.generate("eos", p, 20)
        s_ignored = engine.generate("eos-ignored", p, 20, ignore_eos=True)
        s_held = engine.generate("eos-held", p, 20, min_tokens=5)  # EOS never comes back
        s_stop = engine.generate("stop", p, 20, stop_token_ids=[stop], ignore_eos=True)
        s_min = engine.generate(
            "min", p, 20, stop_token_ids=[twice], min_tokens=14, ignore_eos=True
        )
        await engine.run()
        assert s_eos.tokens == ref[:3] and s_eos.final.stop_reason == eos
        assert s_ignored.tokens == ref and s_ignored.finish_reason == "length"
        assert s_held.tokens == ref and s_held.finish_reason == "length"
        assert s_stop.tokens == ref[:8] and s_stop.final.stop_reason == stop
        assert s_min.tokens == ref[:16] and s_min.final.stop_reason == twice
        assert {s.finish_reason for s in (s_eos, s_stop, s_min)} == {"stop"}

    assert_same_at_both_depths(await at_depths(scenario, eos_token_ids=[eos]))


async def test_max_tokens_is_capped_by_the_context_length():
    ps = prompts(3, seed=6, lo=10, hi=20)

    async def scenario(engine: SimEngine) -> None:
        unbounded = engine.generate("none", ps[0], max_tokens=None)
        capped = engine.generate("capped", ps[1], max_tokens=1000)
        short = engine.generate("short", ps[2], max_tokens=3)
        await engine.run()
        assert unbounded.tokens == expected(ps[0], 40 - len(ps[0]))
        assert capped.tokens == expected(ps[1], 40 - len(ps[1]))
        assert short.tokens == expected(ps[2], 3)
        assert {s.finish_reason for s in (unbounded, capped, short)} == {"length"}

    assert_same_at_both_depths(await at_depths(scenario, max_model_len=40))


async def test_retraction_recomputes_with_identical_output():
    # 13 usable blocks of 4 tokens cannot hold 6 requests growing to ~50 tokens each.
    ps = prompts(6, seed=7, lo=5, hi=20)

    async def scenario(engine: SimEngine) -> None:
        for i, p in enumerate(ps):
            engine.generate(f"r{i}", p, max_tokens=30)
        await engine.run()
        assert engine.scheduler.num_retractions > 0, "the pool was meant to be too small"
        for i, p in enumerate(ps):
            assert engine.stream(f"r{i}").tokens == expected(p, 30), i

    for caching in (True, False):
        tokens = await at_depths(
            scenario, num_blocks=14, max_num_seqs=6, enable_prefix_caching=caching
        )
        assert_same_at_both_depths(tokens)


async def test_prefix_hit_reuses_blocks_and_counts_cached_tokens():
    shared = list(range(10, 30))  # 20 tokens = 5 full blocks

    async def scenario(engine: SimEngine) -> None:
        a = engine.generate("a", shared + [1, 2, 3], max_tokens=4)
        await engine.run()
        before = len(engine.data_plane.plans)
        b = engine.generate("b", shared + [7, 8], max_tokens=4)
        await engine.run()
        first_b_row = engine.data_plane.plans[before].rows[0]
        assert (first_b_row.start, first_b_row.num_tokens) == (20, 2)
        assert a.outputs[0].num_cached_tokens == 0 and b.outputs[0].num_cached_tokens == 20
        assert a.tokens == expected(shared + [1, 2, 3], 4)
        assert b.tokens == expected(shared + [7, 8], 4)

    assert_same_at_both_depths(await at_depths(scenario))


async def test_a_block_is_hit_only_under_the_prefix_it_was_cached_with():
    """A block's key chains its parent's: the same four tokens after another prefix (or
    at another position) are a miss. The sim's KV depends on the whole prefix, so such a
    hit would also read back wrong."""
    x, y, w, z = [10, 11, 12, 13], [20, 21, 22, 23], [30, 31, 32, 33], [40, 41, 42, 43]

    async def scenario(engine: SimEngine) -> None:
        a = engine.generate("a", [*x, *y, *w, 1], max_tokens=3)
        await engine.run()
        b = engine.generate("b", [*x, *w, 2], max_tokens=3)  # w after x, not after x y
        c = engine.generate("c", [*z, *y, 3], max_tokens=3)  # y after z
        d = engine.generate("d", [*x, *y, 4], max_tokens=3)
        await engine.run()
        cached = [s.outputs[0].num_cached_tokens for s in (a, b, c, d)]
        assert cached == [0, 4, 0, 8]
        for s, p in zip((a, b, c, d), ([*x, *y, *w, 1], [*x, *w, 2], [*z, *y, 3], [*x, *y, 4])):
            assert s.tokens == expected(p, 3), s.rid

    assert_same_at_both_depths(await at_depths(scenario))


async def test_shared_prompts_in_flight_together_match_reference():
    """Requests sharing prefixes, arriving while the first ones still prefill in chunks:
    the later ones hit blocks whose forwards were dispatched but may not have run."""
    base = prompts(1, seed=8, lo=30, hi=30)[0]
    ps = [base[:cut] + tail for cut, tail in [(30, []), (24, [1]), (17, [2, 3]), (30, [4])]]

    async def scenario(engine: SimEngine) -> None:
        for i, p in enumerate(ps):
            engine.generate(f"r{i}", p, max_tokens=8)
            await engine.round()
        await engine.run()
        for i, p in enumerate(ps):
            assert engine.stream(f"r{i}").tokens == expected(p, 8), i
        assert sum(engine.stream(f"r{i}").outputs[0].num_cached_tokens for i in range(4)) > 0

    assert_same_at_both_depths(await at_depths(scenario, max_num_batched_tokens=12))


async def test_fully_cached_prompt_recomputes_last_token():
    p = list(range(40, 56))  # exactly 4 blocks

    async def scenario(engine: SimEngine) -> None:
        a = engine.generate("a", p, max_tokens=2)
        await engine.run()
        before = len(engine.data_plane.plans)
        b = engine.generate("b", p, max_tokens=2)
        await engine.run()
        row = engine.data_plane.plans[before].rows[0]
        assert (row.start, row.num_tokens) == (12, 4)  # the last block is recomputed
        assert b.tokens == a.tokens == expected(p, 2)

    assert_same_at_both_depths(await at_depths(scenario))


async def test_max_num_seqs_and_token_budget_respected():
    ps = prompts(8, seed=5)

    async def scenario(engine: SimEngine) -> None:
        for i, p in enumerate(ps):
            engine.generate(f"r{i}", p, max_tokens=5)
        while engine.busy():
            await engine.round()
            assert len(engine.scheduler.running) <= 3
        for plan in engine.data_plane.plans:
            assert len(plan.rows) <= 3
            assert plan.num_tokens == sum(r.num_tokens for r in plan.rows) <= 10
        for i, p in enumerate(ps):
            assert engine.stream(f"r{i}").tokens == expected(p, 5), i

    assert_same_at_both_depths(await at_depths(scenario, max_num_seqs=3, max_num_batched_tokens=10))


async def test_kv_events_are_published_once_per_round():
    async def scenario(engine: SimEngine) -> None:
        batches: list[list] = []
        engine.loop.kv_events.subscribe(batches.append)
        engine.generate("a", list(range(10, 30)), max_tokens=2)  # 5 full prompt blocks
        rounds = 0
        while engine.busy():
            await engine.round()
            rounds += 1
        stored = [e.token_ids for batch in batches for e in batch]
        assert stored[:5] == [tuple(range(10 + 4 * i, 14 + 4 * i)) for i in range(5)]
        assert len(batches) <= rounds and all(batches)
        assert engine.scheduler.drain_kv_events() == []  # the round drained them

    await at_depths(scenario)
