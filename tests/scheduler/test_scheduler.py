"""The scheduler driven by a model-free device: tokens must equal a direct reference
under chunked prefill, prefix caching, retraction, aborts and in-flight depth 0/1."""

from __future__ import annotations

import random
from collections import deque

import pytest
from helpers.sim_device import SimDevice, reference

from tokenspeed_aio.sampling_params import SamplingParams
from tokenspeed_aio.scheduler.plan import ForwardCommitted, RequestFinished
from tokenspeed_aio.scheduler.request import Request
from tokenspeed_aio.scheduler.scheduler import Scheduler, SchedulerConfig, SubmissionRejected

EOS = 5


def make_request(rid: str, prompt: list[int], max_tokens: int, **kw) -> Request:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)
    return Request(rid, prompt, params, seed=0, max_output=max_tokens)


class Driver:
    """A minimal round: plan, dispatch, commit down to the depth, finish on max/eos."""

    def __init__(self, depth: int = 0, eos: int | None = None, **config) -> None:
        cfg = dict(
            num_blocks=64,
            page_size=4,
            max_num_seqs=8,
            max_num_batched_tokens=64,
            max_model_len=512,
            enable_prefix_caching=True,
        )
        cfg.update(config)
        self.sched = Scheduler(SchedulerConfig(**cfg))
        self.device = SimDevice(cfg["num_blocks"], cfg["page_size"], cfg["max_num_seqs"])
        self.depth = depth
        self.eos = eos
        self.inflight: deque = deque()
        self.outputs: dict[str, list[int]] = {}
        self.limits: dict[str, int] = {}
        self.finished: set[str] = set()
        self.plans = []

    def submit(self, rid: str, prompt: list[int], max_tokens: int) -> None:
        self.sched.submit([make_request(rid, prompt, max_tokens)])
        self.outputs[rid] = []
        self.limits[rid] = max_tokens

    def round(self) -> None:
        plan = self.sched.next_execution_plan()
        self.plans.append(plan)
        events = []
        for abort in plan.aborts:
            self.finished.add(abort.rid)
        if plan.needs_device():
            self.inflight.append((plan, self.device.execute(plan)))
        depth = self.depth if plan.needs_device() else 0
        while len(self.inflight) > depth:
            plan_done, result = self.inflight.popleft()
            accepted, ended = [], []
            for row, tok in zip(plan_done.sample_rows, result.tokens):
                if row.rid in self.finished:
                    accepted.append(None)
                    continue
                accepted.append(tok)
                out = self.outputs[row.rid]
                out.append(tok)
                if len(out) >= self.limits[row.rid] or tok == self.eos:
                    self.finished.add(row.rid)
                    ended.append(RequestFinished(row.rid))
            events.append(ForwardCommitted(plan_done.plan_id, accepted))
            events.extend(ended)
        self.sched.advance(events)

    def run(self, max_rounds: int = 2000) -> None:
        for _ in range(max_rounds):
            if not self.sched.has_work():
                return
            self.round()
        raise AssertionError(f"did not drain: {self.sched.requests}")


def prompts(n: int, seed: int = 0, lo: int = 1, hi: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(97) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


@pytest.mark.parametrize("depth", [0, 1])
@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("budget", [64, 7])
def test_tokens_match_reference(depth, caching, budget):
    d = Driver(depth=depth, enable_prefix_caching=caching, max_num_batched_tokens=budget)
    ps = prompts(10)
    for i, p in enumerate(ps):
        d.submit(f"r{i}", p, max_tokens=12)
    d.run()
    for i, p in enumerate(ps):
        assert d.outputs[f"r{i}"] == reference(p, 12), i
    d.sched.check_idle()


@pytest.mark.parametrize("depth", [0, 1])
def test_eos_finishes_and_extra_inflight_token_is_dropped(depth):
    d = Driver(depth=depth, eos=EOS)
    ps = prompts(12, seed=3)
    for i, p in enumerate(ps):
        d.submit(f"r{i}", p, max_tokens=60)
    d.run()
    for i, p in enumerate(ps):
        assert d.outputs[f"r{i}"] == reference(p, 60, eos=EOS)
    d.sched.check_idle()


@pytest.mark.parametrize("depth", [0, 1])
def test_retraction_recomputes_with_identical_output(depth):
    # 13 usable blocks of 4 tokens cannot hold 6 requests growing to ~50 tokens each.
    d = Driver(depth=depth, num_blocks=14, max_num_seqs=6)
    ps = prompts(6, seed=7, lo=5, hi=20)
    for i, p in enumerate(ps):
        d.submit(f"r{i}", p, max_tokens=30)
    d.run()
    assert sum(p.num_retracted for p in d.plans) > 0, "the pool was meant to be too small"
    for i, p in enumerate(ps):
        assert d.outputs[f"r{i}"] == reference(p, 30), i
    d.sched.check_idle()


def test_prefix_hit_reuses_blocks_and_counts_cached_tokens():
    d = Driver()
    shared = list(range(10, 30))  # 20 tokens = 5 full blocks
    d.submit("a", shared + [1, 2, 3], max_tokens=4)
    d.run()
    d.submit("b", shared + [7, 8], max_tokens=4)
    d.round()
    assert d.sched.requests["b"].num_cached_tokens == 20
    first_b_row = d.plans[-1].rows[0]
    assert first_b_row.start == 20 and first_b_row.num_tokens == 2
    d.run()
    assert d.outputs["b"] == reference(shared + [7, 8], 4)
    d.sched.check_idle()


def test_fully_cached_prompt_recomputes_last_token():
    d = Driver()
    p = list(range(40, 56))  # exactly 4 blocks
    d.submit("a", p, max_tokens=2)
    d.run()
    d.submit("b", p, max_tokens=2)
    d.round()
    row = d.plans[-1].rows[0]
    assert (row.start, row.num_tokens) == (12, 4)  # the last block is recomputed
    d.run()
    assert d.outputs["b"] == d.outputs["a"]


@pytest.mark.parametrize("depth", [0, 1])
def test_abort_in_every_state(depth):
    d = Driver(depth=depth, max_num_batched_tokens=8, max_num_seqs=2)
    ps = prompts(4, seed=11, lo=20, hi=30)
    for i, p in enumerate(ps):
        d.submit(f"r{i}", p, max_tokens=20)
    d.round()  # r0 mid-prefill, others waiting
    d.sched.advance_head(["r3"])  # waiting
    d.sched.advance_head(["r0"])  # running, chunk in flight at depth 1
    d.finished |= {"r3", "r0"}
    for _ in range(8):
        d.round()
    d.sched.advance_head(["r1"])  # decoding
    d.finished.add("r1")
    d.run()
    assert d.outputs["r2"] == reference(ps[2], 20)
    d.sched.check_idle()


def test_id_held_until_inflight_forward_commits():
    d = Driver(depth=1)
    d.submit("a", [1, 2, 3], max_tokens=50)
    for _ in range(4):
        d.round()
    d.sched.advance([RequestFinished("a")])
    d.finished.add("a")
    assert d.sched.holds("a")  # its last forward is still in flight
    d.round()  # commits it; "a" is released
    assert not d.sched.holds("a")
    d.sched.check_idle()


def test_submission_batch_rejected_whole():
    """The scheduler checks what only the rank knows (its KV capacity, the ids it holds);
    one bad request refuses the whole batch."""
    d = Driver(num_blocks=5)  # 4 usable blocks = 16 tokens
    good = make_request("ok", [1, 2, 3], 4)
    bad = make_request("long", list(range(17)), 4)
    with pytest.raises(SubmissionRejected, match="needs 5 KV blocks"):
        d.sched.submit([good, bad])
    assert not d.sched.holds("ok")
    with pytest.raises(SubmissionRejected, match="already in use"):
        d.sched.submit([make_request("x", [1], 4), make_request("x", [2], 4)])


def test_prompt_larger_than_cache_is_rejected():
    d = Driver(num_blocks=5)  # 4 usable blocks = 16 tokens
    with pytest.raises(SubmissionRejected, match="needs 5 KV blocks"):
        d.sched.submit([make_request("big", list(range(17)), 1)])


def test_request_outgrowing_cache_is_aborted_in_plan():
    d = Driver(num_blocks=5)  # 16 tokens of KV
    d.submit("grow", list(range(10)), max_tokens=100)
    d.run()
    aborts = [a for p in d.plans for a in p.aborts]
    assert [a.rid for a in aborts] == ["grow"] and "KV cache holds (16)" in aborts[0].message
    assert len(d.outputs["grow"]) == 16 - 10 + 1  # the token after the last KV position
    d.sched.check_idle()


@pytest.mark.parametrize("caching", [True, False])
def test_victim_outgrowing_cache_is_aborted_not_retracted(caching):
    # 3 usable blocks of 2 tokens. "big" fills all 3 with its 6-token prompt and samples
    # a 7th token; "small" (older) then needs a block for its decode. Retracted, "big"
    # could never return (7 tokens need 4 blocks), and with its prompt cached it used to
    # block the head of the waiting queue forever.
    d = Driver(
        num_blocks=4,
        page_size=2,
        max_num_seqs=3,
        max_num_batched_tokens=6,
        enable_prefix_caching=caching,
    )
    d.submit("small", [0, 3], max_tokens=2)
    d.submit("one", [0, 3, 6, 9], max_tokens=1)
    d.submit("big", [0, 3, 6, 9, 12, 15], max_tokens=2)
    d.run()
    aborts = [a for p in d.plans for a in p.aborts]
    assert [a.rid for a in aborts] == ["big"]
    assert "grew to 7 tokens" in aborts[0].message and "KV cache holds (6)" in aborts[0].message
    assert sum(p.num_retracted for p in d.plans) == 0  # aborted, not retracted
    assert d.outputs["small"] == reference([0, 3], 2)
    assert d.outputs["one"] == reference([0, 3, 6, 9], 1)
    assert d.outputs["big"] == reference([0, 3, 6, 9, 12, 15], 1)
    d.sched.check_idle()


def test_request_retracted_in_flight_then_outgrowing_cache_is_aborted_at_admission():
    # 4 usable blocks of 1 token, depth 1. "b" fills all 4 with its prompt; "a" (older)
    # needs a block, so "b" is retracted while its first token is still in flight. When
    # that token lands "b" holds 5 tokens: more than the pool. With its prompt cached,
    # admission used to wait for blocks forever; it must end with a planned abort.
    d = Driver(depth=1, num_blocks=5, page_size=1, max_num_seqs=2, max_num_batched_tokens=7)
    d.submit("a", [0, 3], max_tokens=6)
    d.submit("b", [0, 3, 6, 9], max_tokens=5)
    d.run()
    assert sum(p.num_retracted for p in d.plans) == 1
    aborts = {a.rid: a.message for p in d.plans for a in p.aborts}
    assert set(aborts) == {"a", "b"}  # "a" too outgrows the pool, at 5 tokens
    assert "grew to 5 tokens" in aborts["b"] and "KV cache holds (4)" in aborts["b"]
    assert d.outputs["b"] == reference([0, 3, 6, 9], 1)
    assert d.outputs["a"] == reference([0, 3], 6)[: len(d.outputs["a"])]
    d.sched.check_idle()


def test_max_num_seqs_and_token_budget_respected():
    d = Driver(max_num_seqs=3, max_num_batched_tokens=10)
    for i, p in enumerate(prompts(8, seed=5)):
        d.submit(f"r{i}", p, max_tokens=5)
    while d.sched.has_work():
        d.round()
        plan = d.plans[-1]
        assert len(plan.rows) <= 3
        assert plan.num_tokens <= 10
        assert len(d.sched.running) <= 3
    d.sched.check_idle()


def test_decodes_first_and_read_future_tokens():
    d = Driver(depth=1)
    d.submit("a", [1, 2, 3, 4, 5], max_tokens=5)
    d.round()
    d.submit("b", [6, 7], max_tokens=5)
    d.round()
    rows = d.plans[-1].rows
    assert [r.rid for r in rows] == ["a", "b"]
    assert rows[0].token_ids is None and rows[0].num_tokens == 1  # device-side input
    assert rows[1].token_ids == [6, 7] and rows[1].new_owner is not None


def test_rows_carry_each_field_by_name():
    # The scheduler builds rows positionally (once per running request per round): a field
    # reordered in ScheduledRow must show up here, not as a silently swapped value.
    d = Driver(depth=1)
    d.sched.submit([make_request("a", [11, 12, 13, 14, 15, 16], 3, prompt_logprobs=1)])
    (first,) = d.sched.next_execution_plan().rows
    assert (first.rid, first.start, first.num_tokens) == ("a", 0, 6)
    assert first.token_ids == [11, 12, 13, 14, 15, 16]
    assert len(first.new_block_ids) == 2 and first.block_offset == 0
    assert first.sample and first.output_index == 0 and first.grammar is None
    assert first.new_owner is not None and first.new_owner.prompt_token_ids[:2] == [11, 12]
    assert first.prompt_logprob_targets == [12, 13, 14, 15, 16] and first.prompt_logprobs == 1
    (second,) = d.sched.next_execution_plan().rows  # a decode, its input still in flight
    assert (second.slot, second.start, second.num_tokens) == (first.slot, 6, 1)
    assert second.token_ids is None and second.new_owner is None
    assert second.new_block_ids == () and second.block_offset == 2
    assert second.output_index == 1 and second.prompt_logprob_targets is None
    assert second.sample and second.prompt_logprobs == 1 and second.grammar is None
