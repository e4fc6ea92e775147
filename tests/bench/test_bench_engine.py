"""Every workload, scaled down, through an in-process engine on the tiny shape: the JSON
has sane numbers and the markdown renders. Also the command line, end to end."""

from __future__ import annotations

import json
import math

import pytest

from tokenspeed_aio.bench import bench_main, report, suite, workloads
from tokenspeed_aio.bench.roofline import ModelBytes
from tokenspeed_aio.bench.targets import EngineTarget
from tokenspeed_aio.model.config import ModelConfig

TINY = {
    "fixed-1k": dict(input_len=16, output_len=8, concurrency=[1, 4], num_requests=4),
    "chat-mix": dict(
        num_requests=10,
        rates=[40.0, math.inf],
        input_median=20,
        output_median=8,
        max_input=64,
        max_output=16,
    ),
    "latency": dict(input_len=8, output_len=8, batch=4, num_requests=8),
    "agentic-prefix": dict(conversations=3, turns=3, turn_tokens=12, reply_tokens=6),
    "overhead": dict(input_len=8, output_len=8, concurrency=[2, 16]),
}


async def bench_document(args, tokens, workload: workloads.Workload) -> dict:
    target = await EngineTarget.start(args)
    try:
        results = await suite.run_target(target, workload, tokens)
    finally:
        await target.close()
    ctx = suite.Context(
        target={"kind": "engine", "shape": "tiny", "model_dir": args.model},
        machine=report.machine_info(),
        model_bytes=ModelBytes.of(ModelConfig.from_pretrained(args.model), "float32"),
        bandwidth={"bytes_per_s": 1e10, "method": "assumed for the test"},
    )
    return suite.document(workload, ctx, results, None)


def ordered(stats: dict) -> bool:
    return stats["p50"] <= stats["p90"] <= stats["p99"]


@pytest.mark.parametrize("name", list(TINY))
async def test_workload_runs_in_process_with_sane_numbers(name, tiny_engine_args, tiny_tokens):
    workload = workloads.WORKLOADS[name](tiny_tokens, **TINY[name])
    doc = await bench_document(tiny_engine_args, tiny_tokens, workload)
    json.dumps(doc)  # the whole document is plain JSON
    assert [r["name"] for r in doc["runs"]] == [r.name for r in workload.runs]
    for run, spec in zip(doc["runs"], workload.runs):
        m = run["metrics"]
        assert m["failed"] == 0 and m["completed"] == spec.num_requests
        # ignore_eos: every reply is exactly as long as asked
        assert m["output_tokens"] == m["requested_output_tokens"]
        assert all(q["output_tokens"] == q["requested_output_tokens"] for q in run["requests"])
        for key in ("ttft_ms", "itl_ms", "e2e_ms", "tpot_ms"):
            assert ordered(m[key]), key
        assert 0 < m["ttft_ms"]["p50"] <= m["e2e_ms"]["p50"]
        assert m["output_tokens_per_s"] > 0 and m["total_tokens_per_s"] > m["output_tokens_per_s"]
        cp = run["control_plane"]
        assert cp["all_rounds"]["rounds"] > 0 and cp["decode_rounds"]["rounds"] > 0
        assert ordered({k[7:]: v for k, v in cp["all_rounds"].items() if k.startswith("cpu_ms")})
        assert ordered({k[8:]: v for k, v in cp["all_rounds"].items() if k.startswith("wall_ms")})
        assert run["gpu_idle_fraction"] is None
        if spec.uniform_lengths() and spec.concurrency:
            assert run["roofline"]["expected_output_tokens_per_s"] > 0
            assert run["achieved_over_roofline"] > 0
        else:
            assert run["roofline"] is None
    text = report.render_markdown(doc)
    assert all(f"| {r.name} |" in text for r in workload.runs)
    assert "Control-plane time per decode round" in text and "wall ms p50" in text


async def test_agentic_turns_hit_the_prefix_cache(tiny_engine_args, tiny_tokens):
    workload = workloads.agentic_prefix(
        tiny_tokens, conversations=2, turns=3, turn_tokens=16, reply_tokens=8
    )
    doc = await bench_document(tiny_engine_args, tiny_tokens, workload)
    turns = doc["runs"][0]["prefix_cache_by_turn"]
    assert [t["turn"] for t in turns] == [0, 1, 2]
    assert turns[0]["cached_fraction"] == 0
    for t in turns[1:]:
        # Full blocks of the earlier conversation come from the cache, never more than it.
        assert 0.3 < t["cached_fraction"] <= t["reusable_fraction"]
    assert doc["runs"][0]["metrics"]["prefix_cache_hit_fraction"] > 0
    assert "Prefix cache by turn" in report.render_markdown(doc)


def test_command_line_writes_json_and_prints_markdown(tiny_dir, tmp_path, capsys):
    out = tmp_path / "latency.json"
    argv = ["latency", "--shape", "tiny", "--shape-dir", str(tiny_dir.parent)]
    argv += ["--input-len", "8", "--output-len", "4", "--batch", "2", "--num-requests", "4"]
    argv += ["--max-model-len", "256", "--num-kv-blocks", "256", "--page-size", "4"]
    argv += ["--no-roofline", "--loop", "asyncio", "--out", str(out)]
    assert bench_main(argv) == 0
    doc = json.loads(out.read_text())
    assert doc["command"] and doc["machine"]["git_commit"] is not None
    assert doc["target"]["engine_args"]["model"] == str(tiny_dir)
    assert doc["target"]["weights"] == "checkpoint"
    assert doc["runs"][0]["metrics"]["output_tokens"] == 16
    printed = capsys.readouterr().out
    assert "| c=2 |" in printed and str(out) in printed


def test_command_line_refuses_a_flag_of_another_workload(capsys):
    with pytest.raises(SystemExit):
        bench_main(["latency", "--rates", "1,2"])
    assert "--rates does not apply to latency" in capsys.readouterr().err
