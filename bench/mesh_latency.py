"""All-gather round latency of the collective mesh on loopback, ranks as separate processes.

Each rank process forms the mesh through a rendezvous, warms up, then times ``rounds``
all-gathers of a round-sized payload (a few ints). Latency is the time one rank spends in one
``all_gather`` call; samples of every rank are pooled.

    python bench/mesh_latency.py [--ranks 2 4] [--rounds 5000] [--out PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import platform
import socket
import statistics
import time
from pathlib import Path

from tokenspeed_aio.bench.output import OUT_HELP, default_out_path
from tokenspeed_aio.collective import Mesh, Rendezvous


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def _rank(rank: int, world: int, port: int, rounds: int, warmup: int, ints: int):
    mesh = await Mesh.connect(rank, world, Rendezvous("127.0.0.1", port), timeout=30)
    group = mesh.world
    payload = list(range(ints))
    for _ in range(warmup):
        await group.all_gather(payload)
    samples = []
    clock = time.perf_counter_ns
    for _ in range(rounds):
        start = clock()
        await group.all_gather(payload)
        samples.append(clock() - start)
    # Leave together: a rank closing early would only be a lost peer to a slower one.
    await group.all_gather(None)
    await mesh.close()
    return samples


def _rank_process(rank, world, port, rounds, warmup, ints, loop_name, results) -> None:
    if loop_name == "uvloop":
        import uvloop

        run = uvloop.run
    else:
        run = asyncio.run
    results.put((rank, run(_rank(rank, world, port, rounds, warmup, ints))))


def measure(world: int, loop_name: str, rounds: int, warmup: int, ints: int) -> dict:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    args = (world, port, rounds, warmup, ints, loop_name, results)
    procs = [ctx.Process(target=_rank_process, args=(r, *args)) for r in range(world)]
    for proc in procs:
        proc.start()
    samples = [results.get(timeout=300) for _ in procs]
    for proc in procs:
        proc.join(timeout=30)
        if proc.exitcode != 0:
            raise RuntimeError(f"a rank process exited with {proc.exitcode}")
    pooled = sorted(ns / 1000 for _, rank_samples in samples for ns in rank_samples)

    def pct(p: float) -> float:
        return pooled[min(len(pooled) - 1, int(p / 100 * len(pooled)))]

    return {
        "ranks": world,
        "loop": loop_name,
        "rounds": rounds,
        "payload_ints": ints,
        "p50_us": round(pct(50), 1),
        "p90_us": round(pct(90), 1),
        "p99_us": round(pct(99), 1),
        "mean_us": round(statistics.fmean(pooled), 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--loops", nargs="+", default=["asyncio", "uvloop"])
    parser.add_argument("--rounds", type=int, default=5000)
    parser.add_argument("--warmup", type=int, default=500)
    parser.add_argument("--payload-ints", type=int, default=4)
    parser.add_argument("--out", help=OUT_HELP)
    args = parser.parse_args()

    rows = [
        measure(world, loop, args.rounds, args.warmup, args.payload_ints)
        for world in args.ranks
        for loop in args.loops
    ]
    machine = {
        "cpus": os.cpu_count(),
        # Ranks share the CPUs with whatever else runs: the tail latencies depend on it.
        "load_average_1m": round(os.getloadavg()[0], 2),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
    print(
        f"all_gather of {args.payload_ints} ints, loopback, {machine['cpus']} CPUs, "
        f"load average {machine['load_average_1m']}\n"
    )
    print("| ranks | loop | p50 µs | p90 µs | p99 µs | mean µs |")
    print("| ---: | --- | ---: | ---: | ---: | ---: |")
    for row in rows:
        print(
            f"| {row['ranks']} | {row['loop']} | {row['p50_us']} | {row['p90_us']} "
            f"| {row['p99_us']} | {row['mean_us']} |"
        )
    path = Path(args.out) if args.out else default_out_path("mesh-latency")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"machine": machine, "results": rows}, indent=2))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
