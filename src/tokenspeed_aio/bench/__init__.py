"""Benchmarks: ``python -m tokenspeed_aio bench WORKLOAD [options]``.

The workloads, metrics and peers follow /work/shared/BENCHMARKS.md: random-token
prompts with ``ignore_eos`` driven through an in-process AsyncEngine or a running
server, latency and throughput percentiles, control-plane time per round, a
bandwidth roofline measured in the same run, and HF transformers' continuous
batching on the same prompts as the peer.
"""

from __future__ import annotations


def bench_main(argv: list[str]) -> int:
    """Entry point of the ``bench`` subcommand (argv without the subcommand itself)."""
    from tokenspeed_aio.bench.cli import main

    return main(argv)


__all__ = ["bench_main"]
