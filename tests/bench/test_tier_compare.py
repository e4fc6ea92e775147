"""The multi-turn long-context workload with the L2 tier off and on in one command: both
settings run the same prompts; with the device pool below the working set, the tier-on
run's later turns come from L2 and the report compares the two."""

from __future__ import annotations

import json

from tokenspeed_aio.bench import bench_main
from tokenspeed_aio.bench.long_context import long_context_chat


def test_long_context_workload_resends_each_conversation(tiny_tokens):
    w = long_context_chat(
        tiny_tokens, conversations=3, turns=4, context_tokens=100, turn_tokens=10, reply_tokens=5
    )
    (run,) = w.runs
    assert len(run.conversations) == 3 and run.concurrency is None
    first, *later = run.conversations[0].turns
    assert len(first.new_ids) == 100 and [len(t.new_ids) for t in later] == [10, 10, 10]
    assert w.settings["working_set_tokens"] == 3 * (100 + 3 * 10 + 4 * 5)


def test_kvstore_compare_runs_the_tier_off_and_on(tiny_dir, tmp_path, capsys):
    out = tmp_path / "compare.json"
    argv = ["long-context-chat", "--shape", "tiny", "--shape-dir", str(tiny_dir.parent)]
    argv += ["--conversations", "4", "--turns", "2", "--context-tokens", "96"]
    argv += ["--turn-tokens", "8", "--reply-tokens", "4", "--page-size", "4"]
    # A working set of 4 x 112 tokens (112 blocks of 4) on a 40-block device pool.
    argv += ["--num-kv-blocks", "40", "--max-model-len", "256", "--no-roofline"]
    argv += ["--kvstore-compare", "0,4", "--loop", "asyncio", "--out", str(out)]
    assert bench_main(argv) == 0
    doc = json.loads(out.read_text())
    off, on = doc["kvstore_compare"]
    assert (off["kvstore_ratio"], on["kvstore_ratio"]) == (0.0, 4.0)
    assert off["document"]["target"]["engine_args"]["kvstore_ratio"] == 0.0
    tier_off = off["document"]["runs"][0]["host_tier"]["summary"]
    tier_on = on["document"]["runs"][0]["host_tier"]["summary"]
    assert tier_off["l2_hit_fraction"] == 0 and tier_on["l2_hit_fraction"] > 0.3
    assert tier_on["load_back_gb"] > 0
    printed = capsys.readouterr().out
    assert "## L2 host tier: off and on" in printed and str(out) in printed
