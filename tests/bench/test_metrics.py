"""Metric definitions on hand-made request records."""

from __future__ import annotations

import pytest

from tokenspeed_aio.bench import metrics
from tokenspeed_aio.bench.runner import RequestRecord, RunResult
from tokenspeed_aio.bench.workloads import Conversation, Run, Turn
from tokenspeed_aio.control.round_stats import RoundSample


def record(start, times, tokens, prompt=10, cached=0) -> RequestRecord:
    r = RequestRecord(0, 0, prompt, sum(tokens), start=start, cached_tokens=cached)
    r.chunk_times, r.chunk_tokens = list(times), list(tokens)
    r.output_ids = list(range(sum(tokens)))
    return r


def test_ttft_tpot_itl_follow_the_serving_conventions():
    # First token at +0.1 s; then one output of 2 tokens after 0.2 s and one of 1 after 0.1 s.
    r = record(1.0, [1.1, 1.3, 1.4], [1, 2, 1])
    assert metrics.inter_token_latencies(r) == pytest.approx([0.1, 0.1, 0.1])
    s = metrics.request_summary(r)
    assert s["ttft_s"] == pytest.approx(0.1)
    assert s["e2e_s"] == pytest.approx(0.4)
    assert s["tpot_s"] == pytest.approx(0.1)  # (0.4 - 0.1) / (4 - 1)


def test_run_summary_counts_tokens_throughput_and_cache_hits():
    run = Run("c=2", [Conversation([Turn([1] * 10, 4)])] * 2, 2)
    ok = record(0.0, [0.5, 1.0], [2, 2], cached=4)
    failed = RequestRecord(1, 0, 10, 4, error="boom")
    m = metrics.summarize(RunResult(run, [ok, failed], 2.0, None))
    assert (m["completed"], m["failed"]) == (1, 1)
    assert m["output_tokens"] == 4 and m["requested_output_tokens"] == 8
    assert m["output_tokens_per_s"] == pytest.approx(2.0)
    assert m["total_tokens_per_s"] == pytest.approx(7.0)
    assert m["prefix_cache_hit_fraction"] == pytest.approx(0.4)


def test_percentiles_are_ordered_and_empty_is_none():
    p = metrics.percentiles(list(range(101)), scale=2.0)
    assert p["p50"] == 100 and p["p90"] == 180 and p["p99"] == 198
    assert metrics.percentiles([])["p99"] is None


def test_control_plane_buckets_decode_rounds_by_running_requests():
    samples = [RoundSample(0.010, 3, 300, 0.011)]  # a prefill round: not a decode round
    samples += [RoundSample(0.001 * (i + 1), 256, 256, 0.002 * (i + 1)) for i in range(10)]
    samples += [RoundSample(0.0005, 5, 5, 0.0005), RoundSample(0.0007, 7, 6, 0.0008)]
    cp = metrics.control_plane(samples)
    assert cp["all_rounds"]["rounds"] == 13 and cp["decode_rounds"]["rounds"] == 12
    buckets = {b["running_from"]: b for b in cp["decode_by_running"]}
    assert set(buckets) == {4, 256}
    assert buckets[4]["running_to"] == 7 and buckets[4]["rounds"] == 2
    assert buckets[256]["cpu_ms_p50"] == pytest.approx(5.5)
    assert buckets[256]["wall_ms_p50"] == pytest.approx(11.0)
    assert len(cp["raw"]) == 13
    assert metrics.control_plane(None) is None


def test_cache_by_turn_compares_hits_with_what_was_reusable():
    first = record(0, [1], [5], prompt=20, cached=0)
    second = record(2, [3], [5], prompt=45, cached=24)
    second.turn = 1
    rows = metrics.cache_by_turn([first, second])
    assert rows[0]["cached_fraction"] == 0 and rows[0]["reusable_fraction"] == 0
    assert rows[1]["cached_fraction"] == pytest.approx(24 / 45)
    assert rows[1]["reusable_fraction"] == pytest.approx(25 / 45)  # 20 prompt + 5 reply
