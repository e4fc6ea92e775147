"""The scheduler alone, vLLM-style: no device and no event loop. A test builds a
Scheduler, calls ``next_execution_plan()``, hands it a made-up commit
(``advance([ForwardCommitted(...), RequestFinished(...)])``) and asserts on what it
scheduled: rows, blocks, retractions, aborts, KV events.

The round's behaviour -- the tokens under chunked prefill, prefix hits, retraction,
aborts and in-flight depth -- is tested through the real EventLoop over the sim data
plane, in tests/control/test_round_*.py.
"""

from __future__ import annotations

import pytest

from tokenspeed_aio.sampling_params import SamplingParams
from tokenspeed_aio.scheduler.plan import ExecutionPlan, ForwardCommitted, RequestFinished
from tokenspeed_aio.scheduler.request import Request, Status
from tokenspeed_aio.scheduler.scheduler import Scheduler, SchedulerConfig, SubmissionRejected


def make_scheduler(**config) -> Scheduler:
    cfg = dict(
        num_blocks=64,
        page_size=4,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        max_model_len=512,
        enable_prefix_caching=True,
    )
    cfg.update(config)
    return Scheduler(SchedulerConfig(**cfg))


def make_request(rid: str, prompt: list[int], max_tokens: int, **kw) -> Request:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)
    return Request(rid, prompt, params, seed=0, max_output=max_tokens)


def submit(sched: Scheduler, rid: str, prompt: list[int], max_tokens: int = 16) -> Request:
    req = make_request(rid, prompt, max_tokens)
    sched.submit([req])
    return req


def commit(sched: Scheduler, plan: ExecutionPlan, *tokens: int, finished=()) -> None:
    """A made-up commit of ``plan``: ``tokens`` for its sampling rows (1 for each row not
    given one), then the requests the output processor would have ended."""
    sampled = list(tokens) + [1] * (len(plan.sample_rows) - len(tokens))
    events = [ForwardCommitted(plan.plan_id, sampled), *map(RequestFinished, finished)]
    sched.advance(events)


def shape(plan: ExecutionPlan) -> list[tuple[str, int, int, bool]]:
    return [(r.rid, r.start, r.num_tokens, r.sample) for r in plan.rows]


def test_chunked_prefill_under_the_token_budget():
    sched = make_scheduler(max_num_batched_tokens=7)
    prompt = list(range(100, 117))  # 17 tokens: 5 blocks
    a = submit(sched, "a", prompt)
    # Chunks do not wait for commits (as at depth 1): each plan continues the last.
    chunks = [sched.next_execution_plan() for _ in range(3)]
    assert [shape(p) for p in chunks] == [
        [("a", 0, 7, False)],
        [("a", 7, 7, False)],
        [("a", 14, 3, True)],
    ]
    assert [p.num_tokens for p in chunks] == [7, 7, 3]
    assert [r.token_ids for p in chunks for r in p.rows] == [
        prompt[0:7],
        prompt[7:14],
        prompt[14:17],
    ]
    # Blocks are appended as the chunks reach them; the device table is their concatenation.
    new = [(r.block_offset, r.new_block_ids) for p in chunks for r in p.rows]
    assert [(offset, len(ids)) for offset, ids in new] == [(0, 2), (2, 2), (4, 1)]
    assert [b for _, ids in new for b in ids] == a.block_ids
    assert chunks[0].rows[0].new_owner is not None and chunks[1].rows[0].new_owner is None
    for p in chunks:
        commit(sched, p, 9)
    (decode,) = sched.next_execution_plan().rows
    assert (decode.start, decode.num_tokens, decode.token_ids) == (17, 1, None)
    assert decode.new_block_ids == () and decode.output_index == 1
    assert a.token_ids == [*prompt, 9]


def test_decodes_first_and_read_future_tokens():
    sched = make_scheduler()
    submit(sched, "a", [1, 2, 3, 4, 5], max_tokens=5)
    sched.next_execution_plan()  # in flight, not committed (depth 1)
    submit(sched, "b", [6, 7], max_tokens=5)
    rows = sched.next_execution_plan().rows
    assert [r.rid for r in rows] == ["a", "b"]
    assert rows[0].token_ids is None and rows[0].num_tokens == 1  # device-side input
    assert rows[1].token_ids == [6, 7] and rows[1].new_owner is not None


def test_a_request_is_not_scheduled_past_its_max_output():
    sched = make_scheduler()
    submit(sched, "a", [1, 2, 3], max_tokens=2)
    p0, p1 = sched.next_execution_plan(), sched.next_execution_plan()
    assert shape(p0) == [("a", 0, 3, True)] and shape(p1) == [("a", 3, 1, True)]
    assert not sched.next_execution_plan().rows  # both outputs are being sampled
    commit(sched, p0)
    assert not sched.next_execution_plan().rows
    commit(sched, p1, finished=["a"])
    sched.check_idle()


def test_max_num_seqs_bounds_the_running_set_and_slots_are_reused():
    sched = make_scheduler(max_num_seqs=2)
    for rid in "abc":
        submit(sched, rid, [1, 2, 3])
    p0 = sched.next_execution_plan()
    assert [r.rid for r in p0.rows] == ["a", "b"] and [r.rid for r in sched.waiting] == ["c"]
    slot_a = p0.rows[0].slot
    assert {r.slot for r in p0.rows} == {0, 1}
    commit(sched, p0, finished=["a"])
    p1 = sched.next_execution_plan()
    assert shape(p1) == [("b", 3, 1, True), ("c", 0, 3, True)]
    assert p1.rows[1].slot == slot_a
    commit(sched, p1, finished=["b", "c"])
    sched.check_idle()


def test_prefix_hit_reuses_blocks_and_counts_cached_tokens():
    sched = make_scheduler()
    shared = list(range(10, 30))  # 20 tokens = 5 full blocks
    a = submit(sched, "a", [*shared, 1, 2, 3], max_tokens=4)
    p = sched.next_execution_plan()
    a_blocks = list(a.block_ids)
    commit(sched, p, finished=["a"])
    assert sched.pool.num_active == 0  # freed, but its full blocks stay cached
    b = submit(sched, "b", [*shared, 7, 8], max_tokens=4)
    (row,) = sched.next_execution_plan().rows
    assert b.num_cached_tokens == 20
    assert (row.start, row.num_tokens, row.token_ids) == (20, 2, [7, 8])
    assert b.block_ids[:5] == a_blocks[:5] and row.new_block_ids == tuple(b.block_ids)
    assert row.new_owner is not None


def test_fully_cached_prompt_recomputes_last_token():
    sched = make_scheduler()
    p = list(range(40, 56))  # exactly 4 blocks
    a = submit(sched, "a", p, max_tokens=2)
    plan = sched.next_execution_plan()
    a_blocks = list(a.block_ids)
    commit(sched, plan, finished=["a"])
    b = submit(sched, "b", p, max_tokens=2)
    (row,) = sched.next_execution_plan().rows
    assert (row.start, row.num_tokens) == (12, 4)  # the last block is recomputed
    assert b.block_ids[:3] == a_blocks[:3] and b.block_ids[3] != a_blocks[3]
    assert b.num_cached_tokens == 12


def test_prompt_logprobs_skip_the_prefix_cache():
    sched = make_scheduler()
    p = list(range(40, 56))
    plan = (submit(sched, "a", p), sched.next_execution_plan())[1]
    commit(sched, plan, finished=["a"])
    sched.submit([make_request("b", p, 2, prompt_logprobs=0)])
    (row,) = sched.next_execution_plan().rows
    assert (row.start, row.num_tokens) == (0, 16) and row.prompt_logprob_targets == p[1:]


@pytest.mark.parametrize("caching", [True, False])
def test_retraction_gives_the_newest_residents_blocks_back_and_readmits_it(caching):
    # 4 usable blocks of 2 tokens: "a" and "b" hold 2 each; "a" growing past 4 tokens
    # needs a third, so "b" (the newest) is retracted to the waiting queue's head.
    sched = make_scheduler(num_blocks=5, page_size=2, enable_prefix_caching=caching)
    a = submit(sched, "a", [1, 2, 3])
    b = submit(sched, "b", [4, 5, 6])
    p0 = sched.next_execution_plan()
    commit(sched, p0, 7, 8)
    p1 = sched.next_execution_plan()
    assert shape(p1) == [("a", 3, 1, True), ("b", 3, 1, True)] and p1.num_retracted == 0
    commit(sched, p1, 9, 10)
    submit(sched, "c", [11])  # waiting: no admission in a round that retracted
    p2 = sched.next_execution_plan()
    assert p2.num_retracted == 1 and sched.num_retractions == 1
    assert shape(p2) == [("a", 4, 1, True)] and len(a.block_ids) == 3
    assert b.status is Status.WAITING and list(sched.waiting) == [b, sched.requests["c"]]
    assert (b.block_ids, b.slot, b.num_computed) == ([], -1, 0)
    assert b.token_ids == [4, 5, 6, 8, 10]  # its committed outputs are kept
    commit(sched, p2, finished=["a"])
    p3 = sched.next_execution_plan()
    row = p3.rows[0]
    assert row.rid == "b" and row.new_owner.output_token_ids == [8, 10]
    assert row.output_index == 2
    # Its full blocks stayed cached when it was retracted; "a" took the tail one (freed
    # blocks are evicted tail first), so it recomputes from its second block.
    start = 2 if caching else 0
    assert (row.start, row.num_tokens) == (start, 5 - start)
    assert row.token_ids == b.token_ids[start:]
    commit(sched, p3, finished=["b", "c"])
    sched.check_idle()


def test_abort_in_every_state():
    sched = make_scheduler(max_num_batched_tokens=8, max_num_seqs=2)
    reqs = [submit(sched, f"r{i}", list(range(i, i + 20)), 20) for i in range(4)]
    p0 = sched.next_execution_plan()  # r0 mid-prefill, the others waiting
    assert shape(p0) == [("r0", 0, 8, False)]
    sched.advance_head(["r3"])  # waiting
    assert not sched.holds("r3") and reqs[3] not in sched.waiting
    sched.advance_head(["r0"])  # running, its chunk still in flight
    assert reqs[0] not in sched.running and sched.pool.num_active == 0
    assert sched.holds("r0")  # until the forward that reads it is committed
    p1 = sched.next_execution_plan()  # r1 takes the freed blocks and slot at once
    assert shape(p1) == [("r1", 0, 8, False)]
    commit(sched, p0)
    assert not sched.holds("r0")
    commit(sched, p1)
    plans = [sched.next_execution_plan() for _ in range(2)]
    assert shape(plans[-1])[0] == ("r1", 16, 4, True)
    for p in plans:
        commit(sched, p)
    assert reqs[1].sampled_on_slot  # decoding
    sched.advance_head(["r1", "r1", "unknown"])  # decoding; repeats and unknowns ignored
    assert not sched.holds("r1") and reqs[1].block_ids == []
    rest = sched.next_execution_plan()
    assert [r.rid for r in rest.rows] == ["r2"]
    commit(sched, rest, finished=["r2"])
    sched.check_idle()


def test_id_held_until_inflight_forward_commits():
    sched = make_scheduler()
    submit(sched, "a", [1, 2, 3], max_tokens=50)
    p0 = sched.next_execution_plan()
    commit(sched, p0)
    p1 = sched.next_execution_plan()  # in flight (depth 1)
    sched.advance([RequestFinished("a")])
    assert sched.holds("a")  # its last forward is still in flight
    assert sched.pool.num_active == 0 and not sched.running  # but its blocks are free
    commit(sched, p1)  # its token is dropped by the output processor: any value will do
    assert not sched.holds("a")
    sched.check_idle()


def test_submission_batch_rejected_whole():
    """The scheduler checks what only the rank knows (its KV capacity, the ids it holds);
    one bad request refuses the whole batch."""
    sched = make_scheduler(num_blocks=5)  # 4 usable blocks = 16 tokens
    good = make_request("ok", [1, 2, 3], 4)
    bad = make_request("long", list(range(17)), 4)
    with pytest.raises(SubmissionRejected, match="needs 5 KV blocks"):
        sched.submit([good, bad])
    assert not sched.holds("ok")
    with pytest.raises(SubmissionRejected, match="already in use"):
        sched.submit([make_request("x", [1], 4), make_request("x", [2], 4)])
    submit(sched, "held", [1])
    with pytest.raises(SubmissionRejected, match="'held' is already in use"):
        sched.submit([make_request("held", [2], 4)])


def test_prompt_larger_than_cache_is_rejected():
    sched = make_scheduler(num_blocks=5)  # 4 usable blocks = 16 tokens
    with pytest.raises(SubmissionRejected, match="needs 5 KV blocks"):
        sched.submit([make_request("big", list(range(17)), 1)])
    submit(sched, "fits", list(range(16)), 1)  # exactly the pool


def test_request_outgrowing_cache_is_aborted_in_plan():
    sched = make_scheduler(num_blocks=5)  # 16 tokens of KV
    grow = submit(sched, "grow", list(range(10)), max_tokens=100)
    sampled = 0
    for _ in range(20):
        plan = sched.next_execution_plan()
        if plan.aborts:
            break
        sampled += len(plan.sample_rows)
        commit(sched, plan)
    (abort,) = plan.aborts
    assert abort.rid == "grow" and "KV cache holds (16)" in abort.message
    assert "grew to 17 tokens" in abort.message and plan.rows == []
    assert sampled == 16 - 10 + 1  # the token after the last KV position
    assert grow.status is Status.FINISHED and not sched.holds("grow")
    sched.check_idle()


def test_rows_carry_each_field_by_name():
    # The scheduler builds rows positionally (once per running request per round): a field
    # reordered in ScheduledRow must show up here, not as a silently swapped value.
    sched = make_scheduler()
    sched.submit([make_request("a", [11, 12, 13, 14, 15, 16], 3, prompt_logprobs=1)])
    (first,) = sched.next_execution_plan().rows
    assert (first.rid, first.start, first.num_tokens) == ("a", 0, 6)
    assert first.token_ids == [11, 12, 13, 14, 15, 16]
    assert len(first.new_block_ids) == 2 and first.block_offset == 0
    assert first.sample and first.output_index == 0 and first.grammar is None
    assert first.new_owner is not None and first.new_owner.prompt_token_ids[:2] == [11, 12]
    assert first.prompt_logprob_targets == [12, 13, 14, 15, 16] and first.prompt_logprobs == 1
    (second,) = sched.next_execution_plan().rows  # a decode, its input still in flight
    assert (second.slot, second.start, second.num_tokens) == (first.slot, 6, 1)
    assert second.token_ids is None and second.new_owner is None
    assert second.new_block_ids == () and second.block_offset == 2
    assert second.output_index == 1 and second.prompt_logprob_targets is None
    assert second.sample and second.prompt_logprobs == 1 and second.grammar is None


def test_fair_admission_takes_requests_in_turns():
    """One client request of 40 sequences, then two of one sequence each: the small ones
    are admitted in the next free slots, not behind the 40; the big one's sequences keep
    their order; a group that waits again later starts at the queue's current round."""
    sched = make_scheduler(max_num_seqs=2, num_blocks=256)
    big = [make_request(f"big-{i}", [1, 2, 3], 4) for i in range(40)]
    for req in big:
        req.group = "big"
    sched.submit(big)
    p0 = sched.next_execution_plan()
    assert [r.rid for r in p0.rows] == ["big-0", "big-1"]
    sched.submit([make_request("small-a", [4, 5], 4)])
    sched.submit([make_request("small-b", [6, 7], 4)])
    order = [r.rid for r in sched.waiting]
    assert order[:4] == ["big-2", "small-a", "small-b", "big-3"], order
    assert [r for r in order if r.startswith("big")] == [f"big-{i}" for i in range(2, 40)]
    commit(sched, p0, finished=["big-0", "big-1"])
    p1 = sched.next_execution_plan()
    assert [r.rid for r in p1.rows] == ["big-2", "small-a"]
    late = make_request("big-late", [1], 4)
    late.group = "big"
    sched.submit([late])
    assert [r.rid for r in sched.waiting][-1] == "big-late"  # behind its own group's 37
