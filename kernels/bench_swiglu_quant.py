"""The per-token quantized SwiGLU before an FP8 down projection: its two launches (the
activation with each chunk's amax, then the quantization by the row's) against the persistent
launch (``activation.py``'s module doc) over its grid, Llama-3.1-8B's MLP (d = 14,336).

    python kernels/bench_swiglu_quant.py --json OUT.json

Each row count is timed by ``triton.testing.do_bench`` over copies of the input that the L2
cannot hold together; the bandwidth counts the gate/up rows read and the e4m3 rows written
(what the persistent launch moves), against a device-to-device copy in the same run. Every
output is checked bit for bit against the two launches'.
"""

from __future__ import annotations

import argparse
import itertools
import sys

import torch
import triton
import triton.testing
from bench_kernels import copy_bandwidth, emit_report
from tokenspeed_kernels.activation import silu_and_mul_quant_chunks, silu_and_mul_quant_rows

D = 14336
ROWS = (64, 128, 256, 512, 1024, 8192)
GRID = list(itertools.product((2, 4, 8), (1024, 2048), (4, 8)))  # programs a SM, block, warps


def bench_rows(m: int, grid: list[tuple]) -> dict:
    copies = max(1, (256 << 20) // (m * 2 * D * 2))  # at least 256 MB of inputs in turn
    xs = [torch.randn(m, 2 * D, device="cuda").to(torch.bfloat16) for _ in range(copies)]
    turn = itertools.cycle(xs)
    two = silu_and_mul_quant_chunks(xs[0])

    def timed(fn) -> float:
        return triton.testing.do_bench(lambda: fn(next(turn))) * 1e3

    moved = m * D * (2 * 2 + 1)
    row = {
        "rows": m,
        "bytes": moved,
        "two_launches_us": timed(silu_and_mul_quant_chunks),
        "sweep_us": {},
    }
    for config in grid:
        q, s = silu_and_mul_quant_rows(xs[0], config)
        assert torch.equal(q.view(torch.uint8), two[0].view(torch.uint8))
        assert torch.equal(s, two[1])
        name = "x".join(str(c) for c in config)
        row["sweep_us"][name] = timed(lambda x, config=config: silu_and_mul_quant_rows(x, config))
    best = min(row["sweep_us"], key=row["sweep_us"].get)
    row.update(best=best, best_us=row["sweep_us"][best])
    row["best_tb_per_s"] = moved / (row["best_us"] * 1e6)
    row["two_launches_tb_per_s"] = moved / (row["two_launches_us"] * 1e6)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_swiglu_quant.py needs a CUDA device")
    copy = copy_bandwidth()
    results = []
    for m in args.rows:
        results.append(bench_rows(m, GRID))
        r = results[-1]
        print(f"{m} rows: two launches {r['two_launches_us']:.1f} us, persistent {r['best']} "
              f"{r['best_us']:.1f} us ({r['best_tb_per_s']:.2f} TB/s)", flush=True)  # fmt: skip
        torch.cuda.empty_cache()
    emit_report(copy, "swiglu_quant", results, args.json)


if __name__ == "__main__":
    main()
