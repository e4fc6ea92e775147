"""Where a one-row FP8 product's activation is quantized: in every program of the product
(``gemv``'s prologue: the amax, after the norm where one precedes it, and each program
quantizing all of x as it reads it) against once, by a launch before it (``rms_norm_quant``
where a norm precedes the product, else ``fp8_quant.quantize_rows``) whose e4m3 output the
product reads as it is (``fp8.QuantizedRows``).

    python kernels/bench_fp8_one_row.py [--json OUT.json]

Llama-3.1-8B's four projections with per-channel scales and per-token activations, each
variant at the best of ``bench_fp8_gemm.GEMV_GRID``; timing as ``bench_gemv.py`` (CUDA graph,
enough weight copies to defeat the L2, programmatic dependent launches as the engine runs
them), the quantizing launch inside the timed chain.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from bench_fp8_gemm import GEMV_GRID, fp8_copies, timed
from bench_kernels import copy_bandwidth, run_info
from tokenspeed_kernels.fp8 import QuantizedRows
from tokenspeed_kernels.fp8_quant import quantize_rows
from tokenspeed_kernels.gemv import gemv, norm_gemv
from tokenspeed_kernels.rmsnorm import rms_norm_quant

# (name, N, K, normed, silu_mul): how the engine runs each one-row product
SHAPES = [("qkv", 6144, 4096, True, False), ("o_proj", 4096, 4096, False, False),
          ("gate_up", 28672, 4096, True, True), ("down", 4096, 14336, False, False)]  # fmt: skip
EPS = 1e-6


def variants(k: int, normed: bool, silu_mul: bool):
    """(in each program, once before) as functions of (weight, tiles)."""
    x, r = (torch.randn(1, k, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    g = torch.rand(k, device="cuda", dtype=torch.bfloat16) + 0.5

    def in_programs(w, tiles):
        if normed:
            return norm_gemv(x, r, g, EPS, w, None, (*tiles, True), silu_mul)[0]
        return gemv(x, w, None, tiles, silu_mul)

    def once_before(w, tiles):
        if normed:
            xq, sx, _ = rms_norm_quant(x, r, g, EPS)
        else:
            xq, sx = quantize_rows(x)
        return gemv(QuantizedRows(xq, sx, x.dtype), w, None, tiles, silu_mul)

    return in_programs, once_before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_fp8_one_row.py needs a CUDA device")
    copy = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: D2D copy {copy / 1e12:.2f} TB/s")
    rows = []
    for name, n, k, normed, silu_mul in SHAPES:
        weights = fp8_copies(n, k, False)
        in_programs, once_before = variants(k, normed, silu_mul)
        row = {"shape": name, "n": n, "k": k, "normed": normed, "silu_mul": silu_mul}
        for label, fn in (("in_programs", in_programs), ("once_before", once_before)):
            sweep = {c: timed(lambda w, c=c, fn=fn: fn(w, c), weights) for c in GEMV_GRID}
            found = {c: t for c, t in sweep.items() if t is not None}
            best = min(found, key=found.get)
            same = torch.equal(in_programs(weights[0], best), once_before(weights[0], best))
            row[label] = {"best_config": list(best), "us": found[best],
                          "sweep_us": {str(c): t for c, t in sweep.items()}}  # fmt: skip
            row["same_bits_at_" + label + "_tiles"] = same
        a, b = row["in_programs"]["us"], row["once_before"]["us"]
        print(f"{name:>8}: in every program {a:.1f} us, once before {b:.1f} us "
              f"({(b - a) / a * 100:+.1f} %)")  # fmt: skip
        rows.append(row)
        del weights
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**run_info(copy), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
