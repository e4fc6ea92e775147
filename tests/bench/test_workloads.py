"""Workloads are deterministic data of the shape docs/performance.md describes."""

from __future__ import annotations

import math

import numpy as np

from tokenspeed_aio.bench import workloads
from tokenspeed_aio.bench.workloads import TokenSpace, fixed_requests


def test_token_space_of_a_shape_excludes_the_special_token(tiny_tokens):
    assert tiny_tokens.vocab_size == 512
    assert tiny_tokens.special_ids == frozenset({0})
    ids = tiny_tokens.sampler(0)(5000)
    assert min(ids) >= 1 and max(ids) < 512


def test_fixed_levels_follow_the_request_count_rule():
    assert [fixed_requests(c) for c in (1, 4, 16, 64, 256)] == [4, 16, 64, 256, 1024]
    w = workloads.fixed(
        TokenSpace(100, frozenset({0, 1})), input_len=7, output_len=3, concurrency=[1, 2]
    )
    assert [r.name for r in w.runs] == ["c=1", "c=2"]
    assert [r.num_requests for r in w.runs] == [4, 8]
    for run in w.runs:
        assert run.uniform_lengths() == (7, 3)
        for s in run.conversations:
            assert not {0, 1} & set(s.turns[0].new_ids)


def test_workloads_are_reproducible_from_their_seed():
    space = TokenSpace(1000)
    a = workloads.chat_mix(space, num_requests=20, rates=[2.0], seed=3)
    b = workloads.chat_mix(space, num_requests=20, rates=[2.0], seed=3)
    c = workloads.chat_mix(space, num_requests=20, rates=[2.0], seed=4)
    assert a.runs[0].conversations == b.runs[0].conversations
    assert a.runs[0].conversations != c.runs[0].conversations


def test_chat_mix_lengths_are_lognormal_and_clipped_with_poisson_arrivals():
    w = workloads.chat_mix(TokenSpace(1000), num_requests=500, rates=[4.0, math.inf])
    timed, burst = w.runs
    assert [r.name for r in w.runs] == ["rate=4", "rate=inf"]
    inputs = [len(s.turns[0].new_ids) for s in timed.conversations]
    outputs = [s.turns[0].output_len for s in timed.conversations]
    assert 150 < np.median(inputs) < 260 and 140 < np.median(outputs) < 230
    assert min(inputs) >= 4 and max(inputs) <= 4096 and max(outputs) <= 2048
    arrivals = [s.arrival for s in timed.conversations]
    assert arrivals == sorted(arrivals) and arrivals[0] == 0.0
    assert 400 / 4 < arrivals[-1] < 600 / 4  # 500 requests at 4 req/s: about 125 s
    assert all(s.arrival == 0.0 for s in burst.conversations)
    assert [s.turns for s in burst.conversations] == [s.turns for s in timed.conversations]
    assert timed.uniform_lengths() is None


def test_agentic_conversations_have_turns_of_new_tokens_and_replies():
    w = workloads.agentic_prefix(
        TokenSpace(1000), conversations=3, turns=4, turn_tokens=20, reply_tokens=5
    )
    (run,) = w.runs
    assert run.num_requests == 12 and run.concurrency is None
    assert all(
        len(t.new_ids) == 20 and t.output_len == 5 for s in run.conversations for t in s.turns
    )


def test_latency_and_overhead_are_closed_loops_of_identical_requests():
    lat = workloads.latency(TokenSpace(1000), num_requests=16)
    assert lat.runs[0].concurrency == 8 and lat.runs[0].uniform_lengths() == (32, 128)
    ovh = workloads.overhead(TokenSpace(1000), concurrency=[4, 256], output_len=64)
    assert [(r.num_requests, r.concurrency) for r in ovh.runs] == [(4, 4), (256, 256)]
    assert workloads.overhead(TokenSpace(1000)).runs[0].name == "c=256"


def test_parse_list_reads_integers_and_infinity():
    assert workloads.parse_list("1, 4,16") == [1, 4, 16]
    assert workloads.parse_list("1,inf", float) == [1.0, math.inf]
