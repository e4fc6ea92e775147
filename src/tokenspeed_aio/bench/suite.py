"""One benchmark, end to end: run a workload's levels on a target, then on the peer, and
assemble the JSON document (raw numbers, roofline, ratios) the report is made of."""

from __future__ import annotations

import datetime
import os
import sys
from dataclasses import dataclass, field
from typing import Any

from tokenspeed_aio.bench import metrics, peer_hf
from tokenspeed_aio.bench.roofline import ModelBytes, decode_floor
from tokenspeed_aio.bench.runner import RunResult, execute, warm_up
from tokenspeed_aio.bench.targets import Target
from tokenspeed_aio.bench.workloads import Run, TokenSpace, Workload

NOTES = [
    "Greedy decoding, ignore_eos: every reply has the requested length.",
    "Roofline: (weights + KV read per decode step) / measured copy bandwidth, lock-step "
    "decode of the run's lengths; prefill is not in it, so short outputs cannot reach it.",
    "gpu_idle_fraction: device time between forwards over the run's span of forwards, from "
    "the data plane's CUDA events (in-process on CUDA only; null elsewhere).",
]


@dataclass
class PeerSpec:
    """How to run the HF peer: the checkpoint, dtype and device it loads on."""

    model_dir: str
    dtype: str
    device: str
    random_init: bool  # config-only checkpoint: transformers' random init, not our weights
    max_batch_tokens: int  # our engine's per-round token budget, given to HF as its own


@dataclass
class Context:
    """What the document records about the setup, next to the runs."""

    target: dict[str, Any]
    machine: dict[str, Any]
    model_bytes: ModelBytes | None = None
    bandwidth: dict[str, Any] | None = None
    tp: int = 1
    command: list[str] = field(default_factory=lambda: list(sys.argv))


async def run_target(
    target: Target, workload: Workload, tokens: TokenSpace, warmup: bool = True
) -> list[RunResult]:
    """Every level of the workload, one after the other, on an idle target."""
    if warmup:
        await warm_up(target, tokens.sampler(seed=12345)(16))
    return [await execute(target, run) for run in workload.runs]


def run_peer(
    spec: PeerSpec, workload: Workload, levels: set[str] | None = None
) -> list[dict[str, Any]]:
    """The peer on every level it can express, or on ``levels`` (run names) only; the
    others get ``{"skipped": reason}``."""

    def reason(run: Run) -> str | None:
        if levels is not None and run.name not in levels:
            return "not among --peer-levels"
        return peer_hf.skip_reason(run)

    model = None
    if any(reason(run) is None for run in workload.runs):
        model = peer_hf.load_model(
            spec.model_dir, spec.dtype, spec.device, random_init=spec.random_init
        )
        peer_hf.warm_up(model)
    out = []
    for run in workload.runs:
        why = reason(run)
        out.append({"skipped": why} if why else peer_hf.run_peer(model, run, spec.max_batch_tokens))
    return out


def roofline_of(run: Run, ctx: Context) -> dict[str, Any] | None:
    lengths = run.uniform_lengths()
    if ctx.model_bytes is None or ctx.bandwidth is None or lengths is None or not run.concurrency:
        return None
    return decode_floor(
        ctx.model_bytes,
        concurrency=min(run.concurrency, run.num_requests),
        input_len=lengths[0],
        output_len=lengths[1],
        bandwidth=ctx.bandwidth["bytes_per_s"],
        tp=ctx.tp,
    )


def _idle_fraction(timeline: dict[str, float] | None) -> float | None:
    """Device idle time between forwards over the run's span of forwards (CUDA events)."""
    if not timeline:
        return None
    span = timeline["busy_ms"] + timeline["idle_ms"]
    return timeline["idle_ms"] / span if span else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def run_document(
    result: RunResult, ctx: Context, peer: dict[str, Any] | None, same_weights: bool
) -> dict[str, Any]:
    """One level's numbers: metrics, control plane, roofline, peer and ratios, raw requests."""
    run = result.run
    m = metrics.summarize(result)
    roof = roofline_of(run, ctx)
    doc: dict[str, Any] = {
        "name": run.name,
        "params": run.params,
        "metrics": m,
        "control_plane": metrics.control_plane(result.rounds),
        "gpu_idle_fraction": _idle_fraction(result.timeline),
        "forward_timeline": result.timeline,
        "roofline": roof,
        "achieved_over_roofline": _ratio(
            m["output_tokens_per_s"], roof and roof["expected_output_tokens_per_s"]
        ),
    }
    if any(len(s.turns) > 1 for s in run.conversations):
        doc["prefix_cache_by_turn"] = metrics.cache_by_turn(result.records)
    if peer is not None:
        peer = dict(peer)
        peer_ids = peer.pop("output_ids", None)
        doc["peer"] = peer
        doc["ours_over_peer"] = _ratio(m["output_tokens_per_s"], peer.get("output_tokens_per_s"))
        if peer_ids is not None and same_weights:
            ours = [r.output_ids for r in sorted(result.records, key=lambda r: r.conversation)]
            doc["peer_token_agreement"] = peer_hf.token_agreement(ours, peer_ids)
    doc["requests"] = [metrics.request_summary(r) for r in result.records]
    return doc


def document(
    workload: Workload,
    ctx: Context,
    results: list[RunResult],
    peers: list[dict[str, Any]] | None,
    same_weights: bool = False,
) -> dict[str, Any]:
    """The whole JSON document of one benchmark. ``same_weights``: both engines read the
    same safetensors, so their greedy tokens are compared."""
    peers = peers or [None] * len(results)
    return {
        "workload": workload.name,
        "settings": workload.settings,
        "command": ctx.command,
        "timestamp": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": ctx.machine,
        "load_average_at_end": list(os.getloadavg()),
        "target": ctx.target,
        "bandwidth": ctx.bandwidth,
        "model_bytes": vars(ctx.model_bytes) if ctx.model_bytes else None,
        "runs": [run_document(r, ctx, p, same_weights) for r, p in zip(results, peers)],
        "notes": NOTES,
    }
