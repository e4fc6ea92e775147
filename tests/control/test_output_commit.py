"""The output processor's commit, driven by made-up plans and results (no model): which
tokens reach the client and the scheduler, and when a request ends."""

from __future__ import annotations

from tokenspeed_aio.control.output import OutputProcessor
from tokenspeed_aio.sampling_params import SamplingParams
from tokenspeed_aio.scheduler.plan import (
    ExecutionPlan,
    ForwardCommitted,
    ForwardResult,
    RequestFinished,
    ScheduledRow,
    TokenLogprobs,
)
from tokenspeed_aio.scheduler.request import Request

EOS = 2


def request(rid: str, max_output: int = 8, **params) -> Request:
    sp = SamplingParams(temperature=0.0, max_tokens=max_output, **params)
    return Request(rid, [1, 1, 1], sp, seed=0, max_output=max_output)


def row(rid: str, sample: bool = True, grammar: object | None = None) -> ScheduledRow:
    return ScheduledRow(rid, 0, 3, 1, None, (), 1, sample, 0, None, None, 0, grammar)


def plan(plan_id: int, *rows: ScheduledRow) -> ExecutionPlan:
    return ExecutionPlan(plan_id, rows=list(rows))


def lp(x: float) -> TokenLogprobs:
    return TokenLogprobs(x, [])


class Matcher:
    """A grammar matcher that accepts the tokens it was given and terminates after them."""

    def __init__(self, accepted: list[int]) -> None:
        self.accepted = accepted
        self.seen: list[int] = []

    def accept_token(self, token: int) -> bool:
        if token not in self.accepted:
            return False
        self.seen.append(token)
        return True

    def is_terminated(self) -> bool:
        return self.seen == self.accepted


def processor(*reqs: Request) -> OutputProcessor:
    out = OutputProcessor(eos_token_ids=[EOS])
    out.register(list(reqs))
    return out


def test_tokens_align_with_sampling_rows_and_skip_chunks():
    a, b, c = request("a"), request("b"), request("c")
    out = processor(a, b, c)
    p = plan(0, row("a"), row("b", sample=False), row("c"))
    events = out.commit(p, ForwardResult(0, [7, 9], None))
    assert events == [ForwardCommitted(0, [7, 9])]
    outputs = {o.rid: o for o in out.take()}
    assert outputs["a"].token_ids == [7] and outputs["c"].token_ids == [9]
    assert "b" not in outputs
    assert outputs["a"].num_prompt_tokens == 3  # the first output carries the prompt facts


def test_a_request_ended_in_flight_drops_its_token():
    a, b = request("a"), request("b")
    out = processor(a, b)
    assert out.abort(["a"]) == ["a"]
    out.take()
    events = out.commit(plan(0, row("a"), row("b")), ForwardResult(0, [7, 9], None))
    assert events == [ForwardCommitted(0, [None, 9])]
    assert [(o.rid, o.token_ids) for o in out.take()] == [("b", [9])]


def test_stop_token_waits_for_min_tokens_then_stops():
    a = request("a", stop_token_ids=[5], min_tokens=2)
    out = processor(a)
    assert out.commit(plan(0, row("a")), ForwardResult(0, [5], None)) == [ForwardCommitted(0, [5])]
    events = out.commit(plan(1, row("a")), ForwardResult(1, [5], None))
    assert events == [ForwardCommitted(1, [5]), RequestFinished("a")]
    (final,) = out.take()
    assert final.token_ids == [5, 5] and final.finish_reason == "stop"
    assert final.stop_reason == 5


def test_eos_stops_unless_ignored_and_max_output_ends_with_length():
    a, b = request("a"), request("b", max_output=2, ignore_eos=True)
    out = processor(a, b)
    events = out.commit(plan(0, row("a"), row("b")), ForwardResult(0, [EOS, EOS], None))
    assert events == [ForwardCommitted(0, [EOS, EOS]), RequestFinished("a")]
    events = out.commit(plan(1, row("b")), ForwardResult(1, [EOS], None))
    assert events == [ForwardCommitted(1, [EOS]), RequestFinished("b")]
    outputs = {o.rid: o for o in out.take()}
    assert outputs["a"].finish_reason == "stop" and outputs["a"].stop_reason == EOS
    assert outputs["b"].finish_reason == "length" and outputs["b"].stop_reason is None
    assert outputs["b"].token_ids == [EOS, EOS]  # two commits, one output this round


def test_logprobs_reach_only_the_requests_that_asked():
    a, b = request("a", logprobs=0), request("b")
    out = processor(a, b)
    out.commit(plan(0, row("a"), row("b")), ForwardResult(0, [7, 9], [lp(-1.0), lp(-2.0)]))
    outputs = {o.rid: o for o in out.take()}
    assert outputs["a"].logprobs == [lp(-1.0)]
    assert outputs["b"].logprobs is None


def test_grammar_termination_and_rejection():
    a, b = request("a"), request("b")
    a.grammar, b.grammar = Matcher([7]), Matcher([7])
    out = processor(a, b)
    p = plan(0, row("a", grammar=a.grammar), row("b", grammar=b.grammar))
    events = out.commit(p, ForwardResult(0, [7, 8], None))
    assert events == [ForwardCommitted(0, [7, 8]), RequestFinished("a"), RequestFinished("b")]
    outputs = {o.rid: o for o in out.take()}
    assert outputs["a"].finish_reason == "stop" and outputs["a"].stop_reason is None
    assert outputs["b"].finish_reason == "error" and outputs["b"].error_status == 500
    out.check_idle()
