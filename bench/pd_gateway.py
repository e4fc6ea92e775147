"""Prefill/decode disaggregation through the SGLang Model Gateway, against the aggregated
engine through the same gateway, and the KV transfer's throughput.

1. The transfer alone: a Llama-8B-shaped page layout (32 layers, K and V) written from
   one process's pool into another's with Mooncake (TCP unless --protocol says
   otherwise), as the prefill peer writes a prompt: GB/s per prompt length.
2. fixed-1k through the gateway: a prefill and a decode engine (``--pd-disaggregation``)
   then the aggregated engine alone (regular mode); TTFT, TPOT, throughput of both, and
   the transfers' GB/s and count from the engines' own metrics.

CPU (docs/performance.md's CPU/TCP numbers; ``--interleave`` keeps all three engines up
and alternates single requests between the two gateways, so a shared machine's load
falls on both alike)::

    python bench/pd_gateway.py --device cpu --shape tiny --input-len 512 --output-len 16 \\
        --num-requests 40 --interleave --out bench/results/pd-gateway-tiny-cpu

H200, prefill and decode sharing the one GPU (each a fixed half of the KV memory), in
one device call (< 6 minutes)::

    # on this machine, once: the wheels (cp312, with their dependencies) and the .debs
    pip download -d wheels --python-version 3.12 --only-binary=:all: \\
        --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \\
        --platform manylinux_2_17_x86_64 mooncake-transfer-engine-cuda13 sglang-router
    (cd wheels && apt-get download libibverbs1 ibverbs-providers libnl-3-200 \\
        libnl-route-3-200)
    # in the device call
    pip install --no-index --find-links wheels mooncake-transfer-engine-cuda13 sglang-router
    for deb in wheels/*.deb; do dpkg -x "$deb" /tmp/ibverbs; done
    export LD_LIBRARY_PATH=/tmp/ibverbs/usr/lib/x86_64-linux-gnu:$LD_LIBRARY_PATH
    python bench/pd_gateway.py --device cuda --shape llama-8b --concurrency 64 \\
        --num-requests 128 --kv-blocks 16384 --out $OUT/pd-gateway-h200

The two-GPU variant is the same command with ``--decode-device-index 1``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tokenspeed_aio.bench.deployment import scrape, start_engine, start_gateway, wait_engine
from tokenspeed_aio.bench.shapes import checkpoint_dir

MODEL = "pd-bench"
PROMPT_LENS = (128, 1024, 4096)


# -- 1. the transfer alone -------------------------------------------------------------
def _target(queue, done, device: str, pages: int, layers: int, page_bytes: int) -> None:
    import torch

    from tokenspeed_aio.pd.transfer_engine import MooncakeEngine

    engine = MooncakeEngine("127.0.0.1")
    pool = torch.zeros(2 * layers, pages, page_bytes, dtype=torch.uint8, device=device)
    engine.register(pool.data_ptr(), pool.numel())
    queue.put((engine.session, pool.data_ptr()))
    done.wait()


def transfer_throughput(device: str, protocol: str) -> list[dict]:
    """GB/s of one prompt's KV at the Llama-3.1-8B page layout (bf16, 8 KV heads of 128,
    16-token pages: 32 KiB per page per layer, K and V)."""
    import os

    import torch

    from tokenspeed_aio.pd.layout import write_plan
    from tokenspeed_aio.pd.messages import KvLayout
    from tokenspeed_aio.pd.transfer_engine import MooncakeEngine

    os.environ["TOKENSPEED_PD_PROTOCOL"] = protocol
    layers, page_tokens, page_bytes = 32, 16, 16 * 8 * 128 * 2
    pages = max(PROMPT_LENS) // page_tokens * 2
    ctx = mp.get_context("spawn")
    queue, done = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=_target, args=(queue, done, device, pages, layers, page_bytes))
    proc.start()
    session, base = queue.get(timeout=120)
    engine = MooncakeEngine("127.0.0.1")
    pool = torch.ones(2 * layers, pages, page_bytes, dtype=torch.uint8, device=device)
    engine.register(pool.data_ptr(), pool.numel())

    def layout(start: int) -> KvLayout:
        region = pages * page_bytes
        return KvLayout(
            layers,
            page_tokens,
            page_bytes,
            pages,
            1,
            [start + 2 * i * region for i in range(layers)],
            [start + (2 * i + 1) * region for i in range(layers)],
        )

    src, dst = layout(pool.data_ptr()), layout(base)
    rows = []
    try:
        for tokens in PROMPT_LENS:
            n = tokens // page_tokens
            # landing pages scattered, as a decode pool hands them out (every other page)
            plan = write_plan(src, dst, list(range(n)), list(range(0, 2 * n, 2)))
            engine.write(session, *plan)  # the first write opens the session
            times = []
            for _ in range(5):
                start = time.perf_counter()
                rc = engine.write(session, *plan)
                times.append(time.perf_counter() - start)
                assert rc == 0, rc
            best, num_bytes = min(times), sum(plan[2])
            rows.append(
                {
                    "prompt_tokens": tokens,
                    "bytes": num_bytes,
                    "writes": len(plan[2]),
                    "best_ms": best * 1e3,
                    "gb_per_s": num_bytes / best / 1e9,
                }
            )
    finally:
        done.set()
        proc.join(timeout=30)
    return rows


# -- 2. fixed-1k through the gateway -----------------------------------------------------
def bench_through(gateway: str, ckpt: Path, ns, out: Path) -> dict:
    cmd = [
        sys.executable, "-m", "tokenspeed_aio", "bench", "fixed-1k", "--server", gateway,
        "--model", str(ckpt), "--concurrency", str(ns.concurrency),
        "--input-len", str(ns.input_len), "--output-len", str(ns.output_len),
        "--num-requests", str(ns.num_requests), "--no-roofline", "--out", str(out),
    ]  # fmt: skip
    subprocess.run(cmd, check=True)
    return json.loads(out.read_text())["runs"][0]["metrics"]


def engine_flags(ns) -> dict:
    flags = dict(
        device=ns.device,
        max_model_len=ns.input_len + ns.output_len + 64,
        max_num_seqs=max(ns.concurrency, 8),
        num_kv_blocks=ns.kv_blocks,
    )
    if ns.shape not in ("tiny", "overhead"):
        flags["load_format"] = "dummy"
    if ns.device == "cpu":
        flags["kv_cache_memory_gb"] = 1.0
    return flags


def pd_vs_aggregated(ns, logs: Path) -> dict:
    ckpt = checkpoint_dir(ns.shape)
    flags = engine_flags(ns)
    env = {"TOKENSPEED_PD_PROTOCOL": ns.protocol}
    started = []
    try:  # prefill then decode: each measures the memory the other left it
        prefill = start_engine(
            ckpt, logs, "prefill", model_name=MODEL, role="prefill", env=env, **flags
        )
        started.append(prefill)
        wait_engine(prefill)
        decode_env = dict(env)
        if ns.decode_device_index is not None:
            decode_env["CUDA_VISIBLE_DEVICES"] = str(ns.decode_device_index)
        decode = start_engine(
            ckpt, logs, "decode", model_name=MODEL, role="decode", env=decode_env, **flags
        )
        started.append(decode)
        wait_engine(decode)
        gateway = start_gateway(logs, "gateway-pd", prefill=[prefill], decode=[decode])
        started.append(gateway)
        pd = bench_through(gateway.url, ckpt, ns, ns.out / "fixed-1k-pd.json")
        transfers = {
            role: scrape(e.url, MODEL) for role, e in (("prefill", prefill), ("decode", decode))
        }
    finally:
        for proc in reversed(started):
            proc.stop()
    started = []
    try:
        aggregated_flags = dict(flags, num_kv_blocks=2 * ns.kv_blocks)  # the whole budget
        engine = start_engine(ckpt, logs, "aggregated", model_name=MODEL, **aggregated_flags)
        started.append(engine)
        wait_engine(engine)
        gateway = start_gateway(logs, "gateway-regular", regular=[engine], policy="cache_aware")
        started.append(gateway)
        aggregated = bench_through(gateway.url, ckpt, ns, ns.out / "fixed-1k-aggregated.json")
    finally:
        for proc in reversed(started):
            proc.stop()

    def pick(metrics: dict, role: str) -> dict:
        label = f'role="{role}"'
        return {
            "transfers_ok": metrics.get(
                f'tokenspeed:pd_transfers_total{{outcome="ok",{label}}}', 0
            ),
            "bytes": metrics.get(f"tokenspeed:pd_transfer_bytes_total{{{label}}}", 0),
            "gb_per_s": metrics.get(f"tokenspeed:pd_transfer_throughput_gbps{{{label}}}", 0),
            "mean_ms": 1e3
            * metrics.get(f"tokenspeed:pd_transfer_seconds_sum{{{label}}}", 0)
            / max(metrics.get(f"tokenspeed:pd_transfer_seconds_count{{{label}}}", 0), 1),
        }

    return {
        "pd": pd,
        "aggregated": aggregated,
        "transfers": {role: pick(m, role) for role, m in transfers.items()},
    }


async def _ttft(url: str, prompt: list[int], output_len: int) -> tuple[float, float]:
    """(TTFT, mean time per output token after the first), seconds, of one request."""
    from tokenspeed_aio.bench.targets import ServerTarget

    target = ServerTarget(url)
    try:
        start = time.perf_counter()
        times = [time.perf_counter() async for c in target.stream(prompt, output_len) if c.new_ids]
    finally:
        await target.close()
    tpot = (times[-1] - times[0]) / max(output_len - 1, 1)
    return times[0] - start, tpot


def interleaved(ns, logs: Path) -> dict:
    """PD and aggregated side by side, single requests alternating between the gateways."""
    import random

    ckpt = checkpoint_dir(ns.shape)
    flags = engine_flags(ns)
    env = {"TOKENSPEED_PD_PROTOCOL": ns.protocol}
    started = []
    try:
        prefill = start_engine(
            ckpt, logs, "prefill", model_name=MODEL, role="prefill", env=env, **flags
        )
        decode = start_engine(
            ckpt, logs, "decode", model_name=MODEL, role="decode", env=env, **flags
        )
        plain = start_engine(ckpt, logs, "aggregated", model_name=MODEL, **flags)
        started += [prefill, decode, plain]
        for engine in started:
            wait_engine(engine)
        pd = start_gateway(logs, "gateway-pd", prefill=[prefill], decode=[decode])
        regular = start_gateway(logs, "gateway-regular", regular=[plain], policy="cache_aware")
        started += [pd, regular]
        vocab = json.loads((ckpt / "config.json").read_text())["vocab_size"]
        rng = random.Random(0)
        samples: dict[str, list[tuple[float, float]]] = {"pd": [], "aggregated": []}
        for i in range(ns.num_requests + 2):
            prompt = [rng.randrange(1, vocab) for _ in range(ns.input_len)]
            order = [("pd", pd.url), ("aggregated", regular.url)]
            for name, url in order if i % 2 else order[::-1]:
                sample = asyncio.run(_ttft(url, prompt, ns.output_len))
                if i >= 2:  # the first two are warm-up
                    samples[name].append(sample)
        transfers = scrape(prefill.url, MODEL)
    finally:
        for proc in reversed(started):
            proc.stop()
    result = {}
    for name, rows in samples.items():
        ttft = sorted(t for t, _ in rows)
        result[name] = {
            "ttft_ms_p50": 1e3 * statistics.median(ttft),
            "ttft_ms_p90": 1e3 * ttft[int(0.9 * (len(ttft) - 1))],
            "tpot_ms_p50": 1e3 * statistics.median(tp for _, tp in rows),
            "requests": len(rows),
        }
    result["added_ttft_ms_p50"] = result["pd"]["ttft_ms_p50"] - result["aggregated"]["ttft_ms_p50"]
    label = 'role="prefill"'
    result["prefill_transfers"] = {
        "count": transfers.get(f'tokenspeed:pd_transfers_total{{outcome="ok",{label}}}', 0),
        "gb_per_s": transfers.get(f"tokenspeed:pd_transfer_throughput_gbps{{{label}}}", 0),
        "mean_ms": 1e3
        * transfers.get(f"tokenspeed:pd_transfer_seconds_sum{{{label}}}", 0)
        / max(transfers.get(f"tokenspeed:pd_transfer_seconds_count{{{label}}}", 0), 1),
    }
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--shape", default="tiny")
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=1024)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--num-requests", type=int, default=128)
    parser.add_argument("--kv-blocks", type=int, default=4096, help="each engine's KV pages")
    parser.add_argument("--protocol", default="tcp", help="Mooncake protocol (tcp, rdma, ...)")
    parser.add_argument("--decode-device-index", type=int, help="the decode engine's GPU")
    parser.add_argument("--skip-transfer", action="store_true")
    parser.add_argument(
        "--interleave", action="store_true", help="CPU: single requests, alternating gateways"
    )
    parser.add_argument("--out", type=Path, required=True, help="directory for the raw JSON")
    ns = parser.parse_args()
    ns.out.mkdir(parents=True, exist_ok=True)
    logs = Path(tempfile.mkdtemp(prefix="pd-bench-logs-"))
    summary: dict = {"args": {k: str(v) for k, v in vars(ns).items()}}
    if not ns.skip_transfer:
        summary["transfer"] = transfer_throughput(ns.device, ns.protocol)
    if ns.interleave:
        summary["interleaved"] = interleaved(ns, logs)
    else:
        summary.update(pd_vs_aggregated(ns, logs))
    (ns.out / "summary.json").write_text(json.dumps(summary, indent=1))

    print("\n## KV transfer alone (Llama-3.1-8B page layout)\n")
    print("| prompt tokens | MiB | writes | best ms | GB/s |\n|---|---|---|---|---|")
    for row in summary.get("transfer", []):
        print(
            f"| {row['prompt_tokens']} | {row['bytes'] / 2**20:.1f} | {row['writes']} | "
            f"{row['best_ms']:.2f} | {row['gb_per_s']:.2f} |"
        )
    if ns.interleave:
        r = summary["interleaved"]
        print(f"\n## single requests through the gateways ({ns.shape}, {ns.input_len} in)\n")
        print("| | TTFT p50 ms | TTFT p90 ms | TPOT p50 ms | requests |\n|---|---|---|---|---|")
        for name in ("pd", "aggregated"):
            m = r[name]
            print(
                f"| {name} | {m['ttft_ms_p50']:.1f} | {m['ttft_ms_p90']:.1f} | "
                f"{m['tpot_ms_p50']:.2f} | {m['requests']} |"
            )
        t = r["prefill_transfers"]
        print(
            f"\nadded TTFT p50: {r['added_ttft_ms_p50']:.1f} ms; prefill transfers: "
            f"{t['count']:.0f}, {t['gb_per_s']:.3f} GB/s, mean {t['mean_ms']:.2f} ms"
        )
        print(f"\nraw results: {ns.out}; engine logs: {logs}")
        return 0
    print(f"\n## fixed-1k through the gateway ({ns.shape}, {ns.device}, c={ns.concurrency})\n")
    print("| | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | out tok/s | failed |")
    print("|---|---|---|---|---|---|")
    for name in ("pd", "aggregated"):
        m = summary[name]
        print(
            f"| {name} | {m['ttft_ms']['p50']:.1f} | {m['ttft_ms']['p99']:.1f} | "
            f"{m['tpot_ms']['p50']:.2f} | {m['output_tokens_per_s']:.0f} | {m['failed']} |"
        )
    for role, t in summary["transfers"].items():
        print(
            f"\n{role}: {t['transfers_ok']:.0f} transfers, {t['bytes'] / 2**20:.1f} MiB, "
            f"{t['gb_per_s']:.2f} GB/s, mean {t['mean_ms']:.1f} ms"
        )
    print(f"\nraw results: {ns.out}; engine logs: {logs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
