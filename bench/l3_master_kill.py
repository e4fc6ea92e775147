"""Serving through a Mooncake master's death and restart: one engine with the L3 tier on a
real ``mooncake_master``; one client sends greedy requests back to back (each a fresh
prompt, so each would query the store) through three phases: the master up, the master
SIGKILLed, the master started again on the same ports. Per phase: request latency and how
many requests ran; per request its end relative to the kill. The phase with the master up
is the baseline of the same run: with the store gone the engine should serve at the same
(recompute) speed, and after the restart publish to the store again.

CPU box (docs/reliability.md)::

    python bench/l3_master_kill.py --out bench/results/l3-master-kill-cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from tokenspeed_aio.bench.deployment import MooncakeMaster, scrape, start_engine, wait_engine
from tokenspeed_aio.bench.output import git_commit
from tokenspeed_aio.bench.shapes import checkpoint_dir

MODEL = "bench"
PUTS_OK = 'tokenspeed:l3_ops_total{kind="put",outcome="ok"}'


def l3_metrics(url: str) -> dict[str, float]:
    return {k: v for k, v in scrape(url, MODEL).items() if "l3_" in k and "bucket" not in k}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="tiny")
    p.add_argument("--prompt-len", type=int, default=40)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--phase-seconds", type=float, default=10.0)
    p.add_argument("--storage-timeout", type=float, default=2.0)
    p.add_argument("--out", type=Path, required=True)
    ns = p.parse_args()

    logs = Path(tempfile.mkdtemp(prefix="l3-master-kill-"))
    master = MooncakeMaster(logs / "master.log").start()
    flags = dict(
        page_size=4, max_model_len=512, num_kv_blocks=256, kv_cache_memory_gb=0.25,
        kvstore_storage_backend="mooncake", kvstore_storage_timeout=ns.storage_timeout,
        kvstore_mooncake_master=master.address,
        kvstore_mooncake_metadata_server=master.metadata_server,
        kvstore_mooncake_segment_gb=0.0625,
    )  # fmt: skip
    engine = start_engine(checkpoint_dir(ns.shape), logs, "A", model_name=MODEL, **flags)
    rng = random.Random(0)
    rows: list[dict] = []
    marks: dict[str, float] = {}
    metrics: dict[str, dict[str, float]] = {}

    def one(client: httpx.Client, phase: str) -> None:
        ids = [rng.randrange(5, 500) for _ in range(ns.prompt_len)]
        sp = {"max_new_tokens": ns.output_len, "temperature": 0, "ignore_eos": True}
        start = time.monotonic()
        r = client.post("/generate", json={"input_ids": ids, "sampling_params": sp})
        r.raise_for_status()
        end = time.monotonic()
        rows.append({"phase": phase, "start": start, "end": end, "latency_s": end - start})

    def phase(client: httpx.Client, name: str) -> None:
        deadline = time.monotonic() + ns.phase_seconds
        while time.monotonic() < deadline:
            one(client, name)
        metrics[name] = l3_metrics(engine.url)

    load = [os.getloadavg()[0]]
    try:
        wait_engine(engine)
        with httpx.Client(base_url=engine.url, timeout=120) as client:
            one(client, "warm-up")
            phase(client, "master up")
            master.kill()
            marks["killed"] = time.monotonic()
            phase(client, "master killed")
            master.start()
            marks["restarted"] = time.monotonic()
            phase(client, "master restarted")
            deadline = time.monotonic() + 60  # its client reconnects: PUTs land again
            while metrics["master restarted"].get(PUTS_OK, 0) <= metrics["master killed"].get(
                PUTS_OK, 0
            ):
                if time.monotonic() > deadline:
                    break
                one(client, "master restarted")
                metrics["master restarted"] = l3_metrics(engine.url)
        load.append(os.getloadavg()[0])
    finally:
        engine.stop()
        master.kill()

    def summary(name: str) -> dict:
        lat = [r["latency_s"] for r in rows if r["phase"] == name]
        return {
            "requests": len(lat),
            "mean_s": statistics.mean(lat),
            "median_s": statistics.median(lat),
            "max_s": max(lat),
        }

    killed = marks["killed"]
    dead = [r for r in rows if r["phase"] == "master killed"]
    doc = {
        "bench": "l3_master_kill",
        "argv": sys.argv[1:],
        "commit": git_commit(),
        "load_average_1m": load,
        "storage_timeout_s": ns.storage_timeout,
        "phases": {
            name: summary(name) for name in ("master up", "master killed", "master restarted")
        },
        "first_request_after_kill_ended_s": min(r["end"] for r in dead) - killed,
        "puts_ok_after_restart": metrics["master restarted"].get(PUTS_OK, 0)
        - metrics["master killed"].get(PUTS_OK, 0),
        "engine_l3_metrics": metrics,
        "rows": [
            {**r, "start": r["start"] - killed, "end": r["end"] - killed}
            for r in rows
            if r["phase"] != "warm-up"
        ],
    }
    ns.out.parent.mkdir(parents=True, exist_ok=True)
    ns.out.write_text(json.dumps(doc, indent=2))
    print(
        json.dumps(
            {k: doc[k] for k in ("load_average_1m", "phases", "puts_ok_after_restart")}, indent=2
        )
    )


if __name__ == "__main__":
    main()
