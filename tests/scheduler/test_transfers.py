"""The scheduler's side of prefill/decode disaggregation, without a model: a decode
engine holds landing pages with no forward until the KV lands, a prefill engine hands a
finished prompt off only once its last chunk's result landed, and either keeps its
pages until the transfer retired -- whatever failed or was aborted before."""

from __future__ import annotations

import pytest

from tokenspeed_aio.sampling_params import SamplingParams
from tokenspeed_aio.scheduler.plan import (
    ForwardCommitted,
    RequestFinished,
    TransferFailed,
    TransferLanded,
    TransferRetired,
)
from tokenspeed_aio.scheduler.request import Request, Status
from tokenspeed_aio.scheduler.scheduler import Scheduler, SchedulerConfig
from tokenspeed_aio.wire.messages import Bootstrap

PAGE = 4


def scheduler(role: str, **kw) -> Scheduler:
    cfg = dict(
        num_blocks=32, page_size=PAGE, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256
    )
    cfg.update(kw)
    return Scheduler(SchedulerConfig(role=role, **cfg))


def request(rid: str, prompt: list[int], role: str, room: int = 7, max_tokens: int = 8) -> Request:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=1)
    max_output = 1 if role == "prefill" else max_tokens  # what ingress gives a prefill half
    return Request(
        rid, prompt, params, seed=0, max_output=max_output, bootstrap=Bootstrap("h", 1, room)
    )


def commit(sched: Scheduler, plan, tokens: list[int]) -> None:
    sched.advance([ForwardCommitted(plan.plan_id, tokens, [f"lp{t}" for t in tokens])])


def test_decode_engine_holds_landing_pages_without_a_forward_until_the_kv_lands():
    sched = scheduler("decode")
    req = request("r", list(range(10)), "decode")
    sched.submit([req])
    plan = sched.next_execution_plan()
    assert plan.rows == [] and plan.needs_device()  # a remote stream alone goes out
    (entry,) = plan.remote_prefill
    assert entry.room == 7 and entry.num_tokens == 10 and len(entry.block_ids) == 3
    assert req.status is Status.TRANSFERRING and len(req.block_ids) == 3  # 10 + 1 tokens
    for _ in range(3):
        later = sched.next_execution_plan()
        assert not later.needs_device()  # nothing is planned for it meanwhile
    sched.advance([TransferLanded("r", 42)])
    plan = sched.next_execution_plan()
    (row,) = plan.rows
    assert (row.start, row.num_tokens, row.token_ids, row.sample) == (10, 1, [42], True)
    assert row.new_owner is not None and row.new_owner.output_token_ids == [42]
    assert row.new_block_ids == tuple(req.block_ids)  # the slot's table gets every page
    commit(sched, plan, [43])
    assert req.token_ids[10:] == [42, 43] and req.room is None  # a plain request from here
    sched.advance([RequestFinished("r")])
    sched.check_idle()


def test_decode_admission_waits_for_landing_pages_in_arrival_order():
    sched = scheduler("decode", num_blocks=6)  # 5 usable pages
    first, second = request("a", list(range(12)), "decode"), request("b", [1] * 6, "decode", 8)
    sched.submit([first, second])
    plan = sched.next_execution_plan()
    assert [e.rid for e in plan.remote_prefill] == ["a"]  # b waits: a took 4 of 5 pages
    sched.advance([TransferFailed("a"), TransferRetired("a")])
    assert [e.rid for e in sched.next_execution_plan().remote_prefill] == ["b"]
    sched.advance([TransferFailed("b"), TransferRetired("b")])
    sched.check_idle()


@pytest.mark.parametrize("stage", ["waiting", "transferring", "landed"])
def test_a_failed_or_aborted_transfer_keeps_its_pages_until_it_retired(stage):
    sched = scheduler("decode")
    req = request("r", list(range(6)), "decode")
    sched.submit([req])
    if stage != "waiting":
        sched.next_execution_plan()
    if stage == "landed":
        sched.advance([TransferLanded("r", 1)])
    held = list(req.block_ids)
    sched.advance_head(["r"])  # a client abort
    if stage == "landed":  # landed: an ordinary request, it ends at once
        assert req.status is Status.FINISHED
        sched.check_idle()
        return
    assert req.status is Status.TRANSFERRING and req.block_ids == held
    sched.advance([TransferFailed("r")])  # repeated or late: harmless
    assert sched.pool.num_active == len(held)
    assert not sched.next_execution_plan().needs_device()
    sched.advance([TransferRetired("r")])
    sched.check_idle()


def test_a_landing_after_the_client_left_is_released():
    sched = scheduler("decode")
    sched.submit([request("r", [1, 2, 3], "decode")])
    sched.next_execution_plan()
    sched.advance_head(["r"])
    sched.advance([TransferLanded("r", 9), RequestFinished("r")])  # what the output answers
    sched.check_idle()


@pytest.mark.parametrize("depth", [0, 1])
def test_prefill_engine_hands_a_prompt_off_after_its_last_chunk_landed(depth):
    sched = scheduler("prefill", max_num_batched_tokens=8)  # a 14-token prompt: 2 chunks
    req = request("r", list(range(14)), "prefill")
    sched.submit([req])
    first = sched.next_execution_plan()
    commit(sched, first, [])
    last = sched.next_execution_plan()
    assert last.rows[0].sample and not last.remote_decode
    if depth:  # the next round plans before the commit: no decode, no hand-off yet
        early = sched.next_execution_plan()
        assert early.rows == [] and early.remote_decode == []
    commit(sched, last, [77])
    assert req.status is Status.TRANSFERRING and req.slot == -1  # its slot is free again
    plan = sched.next_execution_plan()
    (out,) = plan.remote_decode
    assert (out.rid, out.room, out.first_token, out.first_logprobs) == ("r", 7, 77, "lp77")
    assert out.block_ids == tuple(req.block_ids[:4]) and out.num_tokens == 14
    assert plan.rows == [] and plan.needs_device()
    assert sched.pool.num_active == 4  # the source pages stay held while they are sent
    sched.advance([TransferRetired("r")])
    sched.check_idle()


def test_prefill_engine_keeps_sources_until_retired_when_the_send_fails():
    sched = scheduler("prefill")
    req = request("r", list(range(5)), "prefill")
    sched.submit([req])
    commit(sched, sched.next_execution_plan(), [3])
    sched.advance([TransferFailed("r")])
    assert sched.next_execution_plan().remote_decode == []  # a failed room is not sent
    assert sched.pool.num_active == 2
    sched.advance([TransferRetired("r")])
    sched.check_idle()


def test_plain_requests_on_a_prefill_engine_run_whole():
    sched = scheduler("prefill")
    req = Request("p", [1, 2, 3], SamplingParams(max_tokens=2), seed=0, max_output=2)
    sched.submit([req])
    commit(sched, sched.next_execution_plan(), [4])
    plan = sched.next_execution_plan()
    assert plan.rows[0].token_ids is None and not plan.remote_decode  # it decodes here
    commit(sched, plan, [5])
    sched.advance([RequestFinished("p")])
    sched.check_idle()
