"""Throughput and latency of a run, and its control plane's time per round.

Conventions (those of vLLM's ``bench serve``): TTFT is from sending the request to
its first token; ITL is the gap between consecutive streamed outputs, split evenly
over the tokens an output carried; TPOT is a request's mean ITL,
``(e2e - ttft) / (tokens - 1)``; e2e ends at the last token. Throughputs divide by
the run's duration (first request sent to last token received).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from tokenspeed_aio.bench.runner import RequestRecord, RunResult
from tokenspeed_aio.control.round_stats import RoundSample


def percentiles(values: Sequence[float], scale: float = 1.0) -> dict[str, float | None]:
    """mean, p50, p90, p99 (linear interpolation) of ``values × scale``; None when empty."""
    if not len(values):
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    arr = np.asarray(values, dtype=np.float64) * scale
    p50, p90, p99 = np.percentile(arr, [50, 90, 99])
    return {"mean": float(arr.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99)}


def inter_token_latencies(record: RequestRecord) -> list[float]:
    gaps = []
    for prev, now, tokens in zip(
        record.chunk_times, record.chunk_times[1:], record.chunk_tokens[1:]
    ):
        gaps += [(now - prev) / tokens] * tokens
    return gaps


def request_summary(record: RequestRecord) -> dict[str, Any]:
    """One request's raw numbers, as the JSON keeps them."""
    out = {
        "conversation": record.conversation,
        "turn": record.turn,
        "prompt_tokens": record.prompt_len,
        "requested_output_tokens": record.output_len,
        "output_tokens": len(record.output_ids),
        "cached_tokens": record.cached_tokens,
        "error": record.error,
    }
    if record.chunk_times:
        ttft = record.chunk_times[0] - record.start
        e2e = record.chunk_times[-1] - record.start
        n = len(record.output_ids)
        out |= {
            "start_s": record.start,
            "ttft_s": ttft,
            "e2e_s": e2e,
            "tpot_s": (e2e - ttft) / (n - 1) if n > 1 else None,
            "num_chunks": len(record.chunk_times),
        }
    return out


def summarize(result: RunResult) -> dict[str, Any]:
    """The run's headline metrics (times in ms)."""
    ok = [r for r in result.records if r.ok]
    per_request = [request_summary(r) for r in ok]
    output_tokens = sum(len(r.output_ids) for r in ok)
    prompt_tokens = sum(r.prompt_len for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    itl = [gap for r in ok for gap in inter_token_latencies(r)]
    duration = result.duration
    return {
        "num_requests": len(result.records),
        "completed": len(ok),
        "failed": len(result.records) - len(ok),
        "duration_s": duration,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "requested_output_tokens": sum(r.output_len for r in result.records),
        "request_throughput": len(ok) / duration if duration else None,
        "output_tokens_per_s": output_tokens / duration if duration else None,
        "total_tokens_per_s": (prompt_tokens + output_tokens) / duration if duration else None,
        "ttft_ms": percentiles([q["ttft_s"] for q in per_request], 1e3),
        "tpot_ms": percentiles([q["tpot_s"] for q in per_request if q["tpot_s"] is not None], 1e3),
        "itl_ms": percentiles(itl, 1e3),
        "e2e_ms": percentiles([q["e2e_s"] for q in per_request], 1e3),
        "cached_tokens": cached,
        "prefix_cache_hit_fraction": cached / prompt_tokens if prompt_tokens else None,
    }


def cache_by_turn(records: Iterable[RequestRecord]) -> list[dict[str, Any]]:
    """Prefix-cache hits per turn index (agentic conversations): the fraction of prompt tokens
    served from the cache, and the most that could be (all but the turn's new tokens)."""
    by_turn: dict[int, list[RequestRecord]] = {}
    for r in records:
        if r.ok:
            by_turn.setdefault(r.turn, []).append(r)
    rows = []
    prev_len: dict[int, int] = {}
    for turn in sorted(by_turn):
        rs = by_turn[turn]
        prompt = sum(r.prompt_len for r in rs)
        reusable = sum(prev_len.get(r.conversation, 0) for r in rs)
        for r in rs:
            prev_len[r.conversation] = r.prompt_len + len(r.output_ids)
        rows.append(
            {
                "turn": turn,
                "requests": len(rs),
                "prompt_tokens": prompt,
                "cached_fraction": sum(r.cached_tokens for r in rs) / prompt,
                "reusable_fraction": reusable / prompt,
            }
        )
    return rows


def _bucket(running: int) -> int:
    """Power-of-two bucket floor: 0, 1, 2, 4, ..., 256 (256 holds 256..511)."""
    return 0 if running <= 0 else 1 << (running.bit_length() - 1)


def _cpu_stats(samples: Sequence[RoundSample]) -> dict[str, Any]:
    return {
        "rounds": len(samples),
        "running_mean": float(np.mean([s.running for s in samples])) if samples else None,
        "batch_tokens_mean": float(np.mean([s.batch_tokens for s in samples])) if samples else None,
        **{f"cpu_ms_{k}": v for k, v in percentiles([s.cpu_seconds for s in samples], 1e3).items()},
        **{
            f"wall_ms_{k}": v
            for k, v in percentiles([s.wall_seconds for s in samples], 1e3).items()
        },
    }


def control_plane(samples: Sequence[RoundSample] | None) -> dict[str, Any] | None:
    """Control-plane time per round with device work (the loop thread's CPU time, and its
    wall time, which adds GIL waits), overall and by running requests.

    ``decode`` rounds are those whose batch is no larger than the running set (no prompt
    chunk in it): the steady state the overhead workload is about. Each sample's
    running count is taken at the end of its round.
    """
    if samples is None:
        return None
    decode = [s for s in samples if 0 < s.batch_tokens <= s.running]
    buckets: dict[int, list[RoundSample]] = {}
    for s in decode:
        buckets.setdefault(_bucket(s.running), []).append(s)
    return {
        "all_rounds": _cpu_stats(samples),
        "decode_rounds": _cpu_stats(decode),
        "decode_by_running": [
            {"running_from": b, "running_to": 2 * b - 1 if b else 0, **_cpu_stats(buckets[b])}
            for b in sorted(buckets)
        ],
        "raw": [[s.cpu_seconds, s.running, s.batch_tokens, s.wall_seconds] for s in samples],
    }
