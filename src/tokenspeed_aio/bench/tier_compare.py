"""One workload with the L2 host tier off and on, in one invocation
(``bench WORKLOAD --kvstore-compare 0,RATIO``): the engine is started once per setting of
``--kvstore-ratio`` on the same prompts, and the report puts the settings side by side --
the L2 hit rate, TTFT p50/p99, throughput, preemptions and restores, and the bytes and
latency of the tier's copies (from the replicas' load reports, deltas over each run).
"""

from __future__ import annotations

import asyncio
from typing import Any

from tokenspeed_aio.args import EngineArgs
from tokenspeed_aio.bench import report, suite
from tokenspeed_aio.bench.report import _num, _pair, _table
from tokenspeed_aio.bench.targets import EngineTarget
from tokenspeed_aio.bench.workloads import TokenSpace, Workload

_COUNTS = ("l2_hit_tokens", "images", "restores", "load_backs", "load_back_bytes")
_COUNTS += ("load_back_seconds", "write_backs", "write_back_bytes", "write_back_seconds")


def _totals(target: EngineTarget) -> dict[str, float]:
    """The replicas' counts since start, from their latest load reports."""
    loads = [load for load, _ in target.engine.frontend.loads.values()]
    out = {"preemptions": float(sum(x.num_preemptions for x in loads))}
    for name in _COUNTS:
        out[name] = float(sum(getattr(x.cache, name) for x in loads if x.cache is not None))
    return out


async def _measure(args: EngineArgs, workload: Workload, tokens: TokenSpace, warmup: bool):
    target = await EngineTarget.start(args)
    try:
        if warmup:
            await suite.run_target(target, Workload(workload.name, [], {}), tokens)
        results, tiers = [], []
        for run in workload.runs:
            before = _totals(target)
            results += await suite.run_target(
                target, Workload(workload.name, [run], {}), tokens, warmup=False
            )
            await asyncio.sleep(1.5)  # a load report after the run's last output (heartbeat)
            after = _totals(target)
            tiers.append({k: after[k] - before[k] for k in after})
        return results, tiers
    finally:
        await target.close()


def tier_summary(run_doc: dict[str, Any], tier: dict[str, float]) -> dict[str, Any]:
    m = run_doc["metrics"]
    prompt = m["prompt_tokens"] or 0
    loads = tier["load_backs"]
    return {
        "l2_hit_fraction": tier["l2_hit_tokens"] / prompt if prompt else None,
        "prefix_cache_hit_fraction": m["prefix_cache_hit_fraction"],
        "ttft_ms": m["ttft_ms"],
        "output_tokens_per_s": m["output_tokens_per_s"],
        "total_tokens_per_s": m["total_tokens_per_s"],
        "load_back_gb": tier["load_back_bytes"] / 1e9,
        "load_back_ms_mean": 1e3 * tier["load_back_seconds"] / loads if loads else None,
        "write_back_gb": tier["write_back_bytes"] / 1e9,
        **{k: tier[k] for k in ("preemptions", "images", "restores")},
    }


def run(
    ratios: list[float],
    args: EngineArgs,
    workload: Workload,
    tokens: TokenSpace,
    ctx: suite.Context,
    loop_runner,
    warmup: bool = True,
) -> dict[str, Any]:
    """Every setting's document, and the summary the report compares them by."""
    settings = []
    for ratio in ratios:
        engine_args = args.replace(kvstore_ratio=ratio, kvstore_size_gb=None)
        ctx.target = {**ctx.target, "engine_args": vars(engine_args)}
        results, tiers = loop_runner(_measure(engine_args, workload, tokens, warmup))
        doc = suite.document(workload, ctx, results, None)
        summaries = [tier_summary(r, t) for r, t in zip(doc["runs"], tiers)]
        for run_doc, tier, summary in zip(doc["runs"], tiers, summaries):
            run_doc["host_tier"] = {"counts": tier, "summary": summary}
        settings.append({"kvstore_ratio": ratio, "document": doc})
    return {
        "workload": workload.name,
        "settings": workload.settings,
        "command": ctx.command,
        "machine": ctx.machine,
        "kvstore_compare": settings,
    }


def render_markdown(doc: dict[str, Any]) -> str:
    parts = [report.render_markdown(s["document"]) for s in doc["kvstore_compare"]]
    header = ["kvstore ratio", "run", "L2 hit", "cache hit", "TTFT ms p50/p99", "out tok/s"]
    header += ["total tok/s", "preempt", "restores", "load-back GB", "load-back ms", "TTFT p50 ×"]
    rows = []
    base: dict[str, float] = {}
    for setting in doc["kvstore_compare"]:
        for run_doc in setting["document"]["runs"]:
            s = run_doc["host_tier"]["summary"]
            p50 = s["ttft_ms"]["p50"]
            base.setdefault(run_doc["name"], p50)
            rows.append(
                [
                    _num(setting["kvstore_ratio"], 2),
                    run_doc["name"],
                    _num(s["l2_hit_fraction"], 3),
                    _num(s["prefix_cache_hit_fraction"], 3),
                    _pair(s["ttft_ms"]),
                    _num(s["output_tokens_per_s"]),
                    _num(s["total_tokens_per_s"]),
                    _num(int(s["preemptions"])),
                    _num(int(s["restores"])),
                    _num(s["load_back_gb"], 3),
                    _num(s["load_back_ms_mean"], 2),
                    _num(p50 / base[run_doc["name"]] if p50 and base[run_doc["name"]] else None, 3),
                ]
            )
    parts.append(
        "\n".join(
            [
                "## L2 host tier: off and on",
                "",
                *_table(header, rows),
                "",
                "- TTFT p50 ×: against the first setting of the same run (the tier off when "
                "it is 0).",
            ]
        )
        + "\n"
    )
    return "\n".join(parts)
