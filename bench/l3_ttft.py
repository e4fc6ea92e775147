"""TTFT of a long shared prefix served by a second engine, from the L3 storage tier against
computing it: two engines (A, B) on one store. Per repeat, A serves a fresh prefix (and so
publishes its pages); once A's PUTs completed, B serves that prefix plus a new suffix (an
L3 hit: fetched into B's L2, loaded back) and, in the same engine, another fresh prefix of
the same length plus a suffix (nothing stored: computed). The two orders alternate.

CPU (docs/performance.md), the Mooncake store (a real ``mooncake_master`` on loopback)::

    python bench/l3_ttft.py --backend mooncake --device cpu --shape tiny --prefix-len 2048 \\
        --repeats 8 --out bench/results/l3-ttft-tiny-cpu.json

H200, the file backend and dummy Llama-3.1-8B weights, both engines on the one GPU, each
with a 16 GiB L2 (the default, twice the device pool, would not fit two engines' pinned
memory); the store under /tmp takes about 1 GiB per 8k-token prefix::

    python bench/l3_ttft.py --backend file --device cuda --shape llama-8b --prefix-len 8192 \\
        --repeats 8 --gpu-memory-utilization 0.4 --l2-gb 16 --out $OUT/l3-ttft-llama-8b-h200.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from tokenspeed_aio.bench.deployment import MooncakeMaster, scrape, start_engine, wait_engine
from tokenspeed_aio.bench.output import git_commit
from tokenspeed_aio.bench.shapes import checkpoint_dir, shape_config
from tokenspeed_aio.bench.targets import ServerTarget

MODEL = "bench"


async def ttft(url: str, prompt: list[int], output_len: int) -> tuple[float, int]:
    """(TTFT in seconds, cached prompt tokens) of one streamed request."""
    target = ServerTarget(url)
    try:
        start = time.perf_counter()
        async for chunk in target.stream(prompt, output_len):
            if chunk.new_ids:
                return time.perf_counter() - start, chunk.cached_tokens
    finally:
        await target.close()
    raise RuntimeError("no token came back")


def metric(url: str, name: str) -> float:
    return scrape(url, MODEL).get(f"tokenspeed:{name}", 0.0)


def wait_published(url: str, timeout: float = 120.0) -> None:
    """Until A has no L3 operation open (its PUTs completed)."""
    deadline = time.monotonic() + timeout
    time.sleep(0.2)
    while metric(url, "l3_queue_depth") or metric(url, "l2_blocks_active"):
        if time.monotonic() > deadline:
            raise RuntimeError("A's PUTs did not complete")
        time.sleep(0.05)


def summary(values: list[float]) -> dict:
    return {
        "mean_ms": statistics.mean(values) * 1e3,
        "median_ms": statistics.median(values) * 1e3,
        "min_ms": min(values) * 1e3,
        "max_ms": max(values) * 1e3,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backend", choices=["mooncake", "file"], default="mooncake")
    p.add_argument("--device", default="cpu")
    p.add_argument("--shape", default="tiny")
    p.add_argument("--prefix-len", type=int, default=2048)
    p.add_argument("--suffix-len", type=int, default=16)
    p.add_argument("--output-len", type=int, default=4)
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--kv-blocks", type=int, default=None)
    p.add_argument("--gpu-memory-utilization", type=float, default=None)
    p.add_argument("--l2-gb", type=float, default=None, help="--kvstore-size-gb per engine")
    p.add_argument("--store-dir", default=None, help="file backend: default a fresh temp dir")
    p.add_argument("--out", type=Path, required=True)
    ns = p.parse_args()

    config = shape_config(ns.shape)
    ckpt = checkpoint_dir(ns.shape)
    logs = Path(tempfile.mkdtemp(prefix="l3-ttft-"))
    flags = dict(
        device=ns.device,
        page_size=ns.page_size,
        max_model_len=ns.prefix_len + ns.suffix_len + ns.output_len + 64,
        kvstore_storage_backend=ns.backend,
        kvstore_storage_timeout=30,
    )
    if "8b" in ns.shape:
        flags["load_format"] = "dummy"
    if ns.kv_blocks:
        flags["num_kv_blocks"] = ns.kv_blocks
    if ns.gpu_memory_utilization:
        flags["gpu_memory_utilization"] = ns.gpu_memory_utilization
    if ns.l2_gb:
        flags["kvstore_size_gb"] = ns.l2_gb
    master = None
    if ns.backend == "mooncake":
        master = MooncakeMaster(logs / "master.log").start()
        flags.update(
            kvstore_mooncake_master=master.address,
            kvstore_mooncake_metadata_server=master.metadata_server,
            kvstore_mooncake_segment_gb=2.0,
        )
    else:
        flags["kvstore_storage_dir"] = ns.store_dir or tempfile.mkdtemp(prefix="l3-store-")
    engines = [start_engine(ckpt, logs, n, model_name=MODEL, **flags) for n in "AB"]
    rng = random.Random(0)
    vocab = config["vocab_size"]

    def tokens(n: int) -> list[int]:
        return [rng.randrange(5, vocab) for _ in range(n)]

    rows = []
    try:
        for e in engines:
            wait_engine(e)
        a, b = engines
        asyncio.run(ttft(b.url, tokens(64), ns.output_len))  # warm-up
        for i in range(ns.repeats):
            shared, fresh = tokens(ns.prefix_len), tokens(ns.prefix_len)
            asyncio.run(ttft(a.url, shared + tokens(ns.suffix_len), ns.output_len))
            wait_published(a.url)
            fetched = metric(b.url, "l3_fetched_tokens_total")
            runs = [("l3", shared), ("computed", fresh)]
            for kind, prefix in runs if i % 2 == 0 else runs[::-1]:
                seconds, cached = asyncio.run(
                    ttft(b.url, prefix + tokens(ns.suffix_len), ns.output_len)
                )
                rows.append({"repeat": i, "kind": kind, "ttft_s": seconds, "cached": cached})
            rows[-1]["l3_fetched_tokens"] = metric(b.url, "l3_fetched_tokens_total") - fetched
            print(json.dumps(rows[-2:]), flush=True)
        metrics = {e.name: {k: v for k, v in scrape(e.url, MODEL).items() if "l3_" in k}
                   for e in engines}  # fmt: skip
    finally:
        for e in engines:
            e.stop()
        if master is not None:
            master.kill()
    doc = {
        "bench": "l3_ttft",
        "argv": sys.argv[1:],
        "commit": git_commit(),
        "shape": ns.shape,
        "device": ns.device,
        "backend": ns.backend,
        "prefix_len": ns.prefix_len,
        "suffix_len": ns.suffix_len,
        "ttft_l3": summary([r["ttft_s"] for r in rows if r["kind"] == "l3"]),
        "ttft_computed": summary([r["ttft_s"] for r in rows if r["kind"] == "computed"]),
        "rows": rows,
        "engine_l3_metrics": metrics,
    }
    ns.out.parent.mkdir(parents=True, exist_ok=True)
    ns.out.write_text(json.dumps(doc, indent=2))
    print(json.dumps({k: doc[k] for k in ("ttft_l3", "ttft_computed")}, indent=2))


if __name__ == "__main__":
    main()
