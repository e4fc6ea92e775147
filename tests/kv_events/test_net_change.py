"""KV events are drained once per round and the batch is the round's net change
(Principle 5): a block stored and evicted, or evicted and stored again, between two drains
publishes nothing for it, and a round publishes at most one batch."""

from __future__ import annotations

from helpers.generation import final_outputs
from scheduler.test_scheduler import Driver

from tokenspeed_aio.sampling_params import SamplingParams
from tokenspeed_aio.scheduler.block_pool import BlockPool
from tokenspeed_aio.scheduler.kv_events import BlockRemoved, BlockStored
from tokenspeed_aio.scheduler.prefix_cache import chain_hash


def test_a_block_stored_and_evicted_before_the_drain_publishes_nothing():
    pool = BlockPool(num_blocks=3, page_size=4, enable_prefix_caching=True)
    kept = pool.allocate(1)
    pool.cache(kept[0], chain_hash(None, (9, 9, 9, 9)), None, (9, 9, 9, 9))
    assert [type(e) for e in pool.events.drain()] == [BlockStored]
    (block,) = pool.allocate(1)
    tokens = (1, 2, 3, 4)
    key = chain_hash(None, tokens)
    pool.cache(block, key, None, tokens)  # stored ...
    pool.free([block])
    pool.allocate(1)  # ... and evicted: the only free block left is the cached one
    assert key not in pool.cached_hashes()
    assert pool.events.drain() == []


def test_a_block_evicted_and_stored_again_in_one_round_publishes_nothing():
    d = Driver(num_blocks=2, page_size=4)  # one usable block
    d.submit("a", [1, 2, 3, 4], max_tokens=1)
    d.run()
    (stored,) = d.sched.drain_kv_events()
    assert isinstance(stored, BlockStored) and stored.token_ids == (1, 2, 3, 4)
    # The same prompt again: a prompt's last token is always recomputed, so it takes no
    # prefix hit and its one block evicts the cached copy -- and caches it again as its
    # prefill is dispatched, in the same round.
    d.submit("b", [1, 2, 3, 4], max_tokens=1)
    d.round()
    assert d.sched.cached_block_hashes() == {stored.block_hash}
    assert d.sched.drain_kv_events() == []
    d.run()
    assert d.sched.drain_kv_events() == []


async def test_a_round_publishes_at_most_one_batch(ckpt, start_engine):
    engine = await start_engine(ckpt("llama"), page_size=4, num_kv_blocks=24)
    loop = engine.control_loop
    rounds: list[int] = []
    batches: list[list] = []

    def subscriber(events: list) -> None:
        rounds.append(loop.stats.rounds)  # the round publishing (stats.end comes after)
        batches.append(events)

    loop.kv_events.subscribe(subscriber)
    prompts = [[5 + i] * 4 + list(range(30 + 10 * i, 50 + 10 * i)) for i in range(6)]
    await final_outputs(engine, prompts, SamplingParams(max_tokens=6, temperature=0.0))
    assert len(rounds) == len(set(rounds)), rounds  # never two batches in one round
    assert max(len(b) for b in batches) >= 5  # a prefill's blocks arrive as one batch
    assert any(isinstance(e, BlockRemoved) for b in batches for e in b)  # evictions too
    assert all(batches)  # and a round without a change publishes nothing
