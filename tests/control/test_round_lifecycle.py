"""The real round over the model-free SimDataPlane: how requests end other than by
running to their length -- client aborts in every state, planned aborts of requests
that outgrow the KV pool, refused submissions, request-id reuse, a stop (or a closed
frontend) with requests running. Every run ends leak-checked."""

from __future__ import annotations

import asyncio
import logging
import random

import pytest
from helpers.sim_engine import SimEngine, expected


def prompts(n: int, seed: int = 0, lo: int = 1, hi: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(97) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def assert_prefix_of_reference(stream, prompt, max_tokens) -> None:
    want = expected(prompt, max_tokens)
    assert stream.tokens == want[: len(stream.tokens)], stream.rid


@pytest.mark.parametrize("depth", [0, 1])
async def test_abort_in_every_state(depth):
    engine = SimEngine(depth=depth, max_num_batched_tokens=8, max_num_seqs=2)
    ps = prompts(4, seed=11, lo=20, hi=30)
    streams = [engine.generate(f"r{i}", p, max_tokens=20) for i, p in enumerate(ps)]
    await engine.round()
    r0 = engine.scheduler.requests["r0"]
    assert 0 < r0.num_computed < r0.prompt_len  # mid-prefill; at depth 1 its chunk in flight
    assert engine.scheduler.requests["r3"] in engine.scheduler.waiting
    engine.abort("r3")  # waiting
    engine.abort("r0")  # mid-prefill
    arrival = engine.generate("x", [1, 2, 3], max_tokens=4)
    engine.abort("x")  # in the round it arrives: never submitted
    await engine.round()
    assert not engine.scheduler.holds("x")
    assert (arrival.final.finish_reason, arrival.final.error_status) == ("abort", 0)
    assert arrival.tokens == []
    await engine.rounds_until(lambda: len(streams[1].tokens) >= 2)
    assert engine.scheduler.requests["r1"].sampled_on_slot  # decoding
    engine.abort("r1")
    engine.abort("nobody")  # an unknown rid: ignored, no output
    await engine.run()
    assert streams[2].tokens == expected(ps[2], 20)
    for i in (0, 1, 3):
        assert streams[i].finish_reason == "abort", i
        assert_prefix_of_reference(streams[i], ps[i], 20)
    assert streams[0].tokens == streams[3].tokens == []
    assert 2 <= len(streams[1].tokens) < 20
    engine.abort("r2")  # finished already: ignored
    await engine.shutdown()


@pytest.mark.parametrize("depth", [0, 1])
async def test_stop_ends_every_running_request_with_an_abort(depth):
    engine = SimEngine(depth=depth, max_num_batched_tokens=16)
    ps = prompts(5, seed=12, lo=10, hi=30)
    streams = [engine.generate(f"r{i}", p, max_tokens=50) for i, p in enumerate(ps)]
    for _ in range(4):
        await engine.round()
    assert any(s.tokens for s in streams)
    assert len(engine.loop.in_flight) == depth  # at depth 1 the drain commits one
    await engine.shutdown()  # a StopEngine: the loop drains, then aborts everything
    for s, p in zip(streams, ps):
        assert s.finish_reason == "abort"
        assert_prefix_of_reference(s, p, 50)


@pytest.mark.parametrize("depth", [0, 1])
async def test_a_closed_frontend_stops_the_running_loop(depth):
    """The loop as a task: it waits for messages when idle, wakes at a submission, and a
    closed transport reads as a stop that ends the running requests."""
    engine = SimEngine(depth=depth)
    task = asyncio.create_task(engine.loop.run())
    short = engine.generate("short", [1, 2, 3], max_tokens=3)
    await asyncio.wait_for(engine.until_finished(short), 5)
    assert short.tokens == expected([1, 2, 3], 3)
    await asyncio.sleep(0.05)  # the loop is idle now, waiting for messages
    assert engine.loop.idle() and not task.done()
    woken = engine.generate("woken", [4, 5], max_tokens=2)
    await asyncio.wait_for(engine.until_finished(woken), 0.5)  # well before a heartbeat
    assert woken.tokens == expected([4, 5], 2)
    long = engine.generate("long", [6, 7], max_tokens=10_000)
    await asyncio.wait_for(engine.until_finished(long, min_tokens=3), 5)
    await engine.transport.close()
    await asyncio.wait_for(task, 5)
    engine.collect()
    assert long.finish_reason == "abort"
    assert_prefix_of_reference(long, [6, 7], 10_000)
    engine.loop.check_idle()


@pytest.mark.parametrize("depth", [0, 1])
async def test_request_outgrowing_cache_is_aborted_in_plan(depth):
    engine = SimEngine(depth=depth, num_blocks=5)  # 16 tokens of KV
    grow = engine.generate("grow", list(range(10)), max_tokens=100)
    await engine.run()
    final = grow.final
    assert (final.finish_reason, final.error_status) == ("abort", 503)
    assert "KV cache holds (16)" in final.error_message
    # Up to the token after the last KV position. NOTE: the plan aborts it before the
    # round's commit, so at depth 1 the token then in flight is dropped, like any abort's.
    assert grow.tokens == expected(list(range(10)), 16 - 10 + 1 - depth)
    await engine.shutdown()


@pytest.mark.parametrize("depth", [0, 1])
@pytest.mark.parametrize("caching", [True, False])
async def test_victim_outgrowing_cache_is_aborted_not_retracted(caching, depth):
    # 3 usable blocks of 2 tokens. "big" fills all 3 with its 6-token prompt and samples
    # a 7th token; "small" (older) then needs a block for its decode. Retracted, "big"
    # could never return (7 tokens need 4 blocks), and with its prompt cached it used to
    # block the head of the waiting queue forever.
    engine = SimEngine(
        depth=depth,
        num_blocks=4,
        page_size=2,
        max_num_seqs=3,
        max_num_batched_tokens=6,
        enable_prefix_caching=caching,
    )
    small = engine.generate("small", [0, 3], max_tokens=2)
    one = engine.generate("one", [0, 3, 6, 9], max_tokens=1)
    big = engine.generate("big", [0, 3, 6, 9, 12, 15], max_tokens=2)
    await engine.run()
    aborted = [s for s in (small, one, big) if s.final.error_status == 503]
    assert aborted == [big]
    assert "grew to 7 tokens" in big.final.error_message
    assert "KV cache holds (6)" in big.final.error_message
    assert small.tokens == expected([0, 3], 2)
    assert one.tokens == expected([0, 3, 6, 9], 1)
    if depth == 0:
        assert engine.scheduler.num_retractions == 0  # aborted, not retracted
        assert big.tokens == expected([0, 3, 6, 9, 12, 15], 1)
    else:
        # With tokens in flight a victim is retracted (and "big" aborted at admission
        # once its token landed, the test below), or aborted in the plan with its
        # in-flight token dropped.
        assert_prefix_of_reference(big, [0, 3, 6, 9, 12, 15], 1)
    await engine.shutdown()


async def test_request_retracted_in_flight_then_outgrowing_cache_is_aborted_at_admission():
    # 4 usable blocks of 1 token, depth 1. "b" fills all 4 with its prompt; "a" (older)
    # needs a block, so "b" is retracted while its first token is still in flight. When
    # that token lands "b" holds 5 tokens: more than the pool. With its prompt cached,
    # admission used to wait for blocks forever; it must end with a planned abort.
    engine = SimEngine(depth=1, num_blocks=5, page_size=1, max_num_seqs=2, max_num_batched_tokens=7)
    a = engine.generate("a", [0, 3], max_tokens=6)
    b = engine.generate("b", [0, 3, 6, 9], max_tokens=5)
    await engine.run()
    assert engine.scheduler.num_retractions == 1
    assert {s.rid for s in (a, b) if s.final.error_status == 503} == {"a", "b"}  # "a" too, at 5
    assert "grew to 5 tokens" in b.final.error_message
    assert "KV cache holds (4)" in b.final.error_message
    assert b.tokens == expected([0, 3, 6, 9], 1)
    assert_prefix_of_reference(a, [0, 3], 6)
    await engine.shutdown()


@pytest.mark.parametrize("depth", [0, 1])
async def test_rejected_submission_batch_fails_its_requests_only(depth):
    engine = SimEngine(depth=depth, num_blocks=9)  # 8 usable blocks = 32 tokens
    running = engine.generate("run", [5, 6], max_tokens=20)
    await engine.round()
    big = engine.generate("big", list(range(5, 38)), max_tokens=1)  # 33 tokens: 9 blocks
    mate = engine.generate("mate", [5, 6], max_tokens=1)  # the same submission batch
    await engine.round()
    for stream in (big, mate):
        final = stream.final
        assert (final.finish_reason, final.error_status) == ("error", 400)
        assert "needs 9 KV blocks" in final.error_message and stream.tokens == []
    assert not engine.scheduler.holds("big") and not engine.scheduler.holds("mate")
    await engine.run()
    assert running.tokens == expected([5, 6], 20)
    await engine.shutdown()


async def test_rid_held_by_the_scheduler_gets_409_until_released():
    p = [30, 38, 13, 92, 50, 61, 19, 11, 8]
    stop = expected(p, 20)[7]  # first seen at index 7
    for depth in (0, 1):
        engine = SimEngine(depth=depth)
        first = engine.generate("b", p, max_tokens=20, stop_token_ids=[stop])
        await engine.rounds_until(lambda: first.finished)  # noqa: B023
        assert first.tokens == expected(p, 8)
        # At depth 1 its next forward was dispatched before the stop token was committed.
        assert engine.scheduler.holds("b") == (depth == 1)
        assert not engine.loop.output.owns("b")
        again = engine.generate("b", p, max_tokens=2)
        await engine.round()
        if depth == 1:
            refusal = again.final
            assert refusal.error_status == 409 and "still held" in refusal.error_message
            await engine.run()
            again = engine.generate("b", p, max_tokens=2)  # both owners released it
        await engine.run()
        assert again.tokens == expected(p, 2) and again.finish_reason == "length"
        await engine.shutdown()


@pytest.mark.parametrize("depth", [0, 1])
async def test_duplicate_rids_are_discarded_and_the_original_untouched(depth, caplog):
    engine = SimEngine(depth=depth)
    original = engine.generate("a", [7, 8, 9], max_tokens=30)
    assert engine.generate("a", [1], max_tokens=2) is original  # repeated in the same round
    with caplog.at_level(logging.WARNING):
        await engine.round()
        engine.generate("a", [1], max_tokens=2)  # still owned by the output processor
        await engine.round()
    await engine.run()
    assert len(engine.streams["a"]) == 1 and original.finish_reason == "length"
    assert original.tokens == expected([7, 8, 9], 30)
    assert sum("duplicate submission" in r.message for r in caplog.records) == 2
    await engine.shutdown()


async def test_constrained_request_without_a_grammar_backend_fails_with_400():
    engine = SimEngine()
    constrained = engine.generate("re", [1, 2], max_tokens=4, regex="a+")
    plain = engine.generate("plain", [1, 2], max_tokens=4)
    await engine.run()
    final = constrained.final
    assert (final.finish_reason, final.error_status) == ("error", 400)
    assert "structured output is disabled" in final.error_message
    assert plain.tokens == expected([1, 2], 4)
    await engine.shutdown()


@pytest.mark.parametrize("depth", [0, 1])
async def test_every_output_batch_carries_the_load(depth):
    engine = SimEngine(depth=depth, num_blocks=33)
    streams = [engine.generate(f"r{i}", p, max_tokens=6) for i, p in enumerate(prompts(3))]
    await engine.round()
    first = engine.batches[-1].load
    assert (first.running, first.waiting, first.total_blocks) == (3, 0, 32)
    assert first.active_blocks > 0
    await engine.run()
    assert all(s.finished for s in streams)
    last = engine.batches[-1].load
    assert (last.running, last.waiting, last.active_blocks) == (0, 0, 0)
    await engine.shutdown()
