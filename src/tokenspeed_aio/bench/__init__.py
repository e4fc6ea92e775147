"""Benchmarks: ``python -m tokenspeed_aio bench WORKLOAD [options]``.

Random-token prompts with ``ignore_eos`` (so every reply has the workload's length),
driven through an in-process AsyncEngine or a running server (``--server URL``). Each
run records throughput, TTFT/TPOT/ITL percentiles, the control plane's CPU time per
round by running-request count, the GPU's idle fraction between forwards, and a
decode roofline, ``(weight bytes + KV bytes read) / bandwidth``, with the bandwidth
measured by a device-to-device copy in the same run. ``--peer hf`` runs HF
transformers' continuous batching (``generate_batch``) on the same model and prompts
in the same process, reported as a ratio. The workloads and how the results are
reported: docs/performance.md. Results go to ``--out`` or the directory of
``tokenspeed_aio.bench.output``.
"""

from __future__ import annotations


def bench_main(argv: list[str]) -> int:
    """Entry point of the ``bench`` subcommand (argv without the subcommand itself)."""
    from tokenspeed_aio.bench.cli import main

    return main(argv)


__all__ = ["bench_main"]
