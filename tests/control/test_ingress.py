"""Ingress: a round's messages become requests, aborts, refusals and a stop, by the
design's request-identity rules. It checks only what the rank alone knows (the
frontend validated the request itself)."""

from __future__ import annotations

import logging

from tokenspeed_aio.control.ingress import Ingress
from tokenspeed_aio.sampling_params import SamplingParams
from tokenspeed_aio.wire.messages import AbortRequest, GenerateRequest, StopEngine, Wake


def gen(rid: str, prompt: list[int] | None = None, **params) -> GenerateRequest:
    return GenerateRequest(rid, prompt or [1, 2, 3], SamplingParams(**params), 7)


def admit(messages, owned=(), held=(), max_model_len=100):
    return Ingress(max_model_len=max_model_len).admit(
        messages, owned=set(owned).__contains__, held=set(held).__contains__
    )


def test_requests_are_admitted_in_arrival_order_with_their_settings():
    adm = admit([gen("b", [4, 5], max_tokens=3), gen("a", [6], max_tokens=2)])
    assert [r.rid for r in adm.requests] == ["b", "a"]
    b = adm.requests[0]
    assert (b.token_ids, b.prompt_len, b.seed, b.max_output) == ([4, 5], 2, 7, 3)
    assert not (adm.constrained or adm.aborted or adm.refusals or adm.stop)


def test_max_output_is_capped_by_the_context_length():
    adm = admit(
        [gen("none", [1] * 10, max_tokens=None), gen("big", [1] * 10, max_tokens=500)],
        max_model_len=30,
    )
    assert [r.max_output for r in adm.requests] == [20, 20]


def test_a_rid_repeated_in_a_round_is_discarded_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING):
        adm = admit([gen("a", [1], max_tokens=5), gen("a", [2], max_tokens=9)])
    (req,) = adm.requests
    assert req.token_ids == [1] and req.max_output == 5  # the original, untouched
    assert adm.refusals == []  # a final output would end the original's stream
    assert ["duplicate submission" in r.message for r in caplog.records] == [True]


def test_a_rid_still_owned_is_discarded_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING):
        adm = admit([gen("a"), gen("b")], owned={"a"}, held={"a"})
    assert [r.rid for r in adm.requests] == ["b"]
    assert adm.refusals == []
    assert sum("duplicate submission of request 'a'" in r.message for r in caplog.records) == 1


def test_a_rid_the_scheduler_still_holds_gets_409():
    adm = admit([gen("a"), gen("b")], held={"a"})
    assert [r.rid for r in adm.requests] == ["b"]
    (refusal,) = adm.refusals
    assert (refusal.rid, refusal.finished, refusal.finish_reason) == ("a", True, "error")
    assert refusal.error_status == 409 and "still held" in refusal.error_message


def test_abort_in_the_arrival_round_refuses_with_abort_and_submits_nothing():
    adm = admit([gen("a"), gen("b"), AbortRequest("a")])
    assert [r.rid for r in adm.requests] == ["b"]
    (refusal,) = adm.refusals
    assert (refusal.rid, refusal.finish_reason, refusal.error_status) == ("a", "abort", 0)
    assert refusal.token_ids == [] and adm.aborted == []


def test_abort_of_an_owned_rid_reaches_the_head_and_an_unknown_one_is_ignored():
    adm = admit([AbortRequest("running"), AbortRequest("unknown")], owned={"running"})
    assert adm.aborted == ["running"]
    assert adm.refusals == [] and adm.requests == []


def test_abort_before_its_request_arrives_does_not_cancel_it():
    adm = admit([AbortRequest("a"), gen("a")])
    assert [r.rid for r in adm.requests] == ["a"] and adm.refusals == []


def test_stop_engine_sets_stop_and_the_round_still_admits():
    adm = admit([gen("a"), StopEngine(), Wake()])
    assert adm.stop and [r.rid for r in adm.requests] == ["a"]
    assert not admit([Wake()]).stop


def test_constrained_requests_go_to_the_grammar_queue():
    adm = admit([gen("plain"), gen("re", regex="a+"), gen("js", json_object=True), gen("p2")])
    assert [r.rid for r in adm.requests] == ["plain", "p2"]
    assert [r.rid for r in adm.constrained] == ["re", "js"]
    assert all(r.grammar is None for r in adm.constrained)  # attached once compiled
