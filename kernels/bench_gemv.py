"""Batch-1 linear layers on a GPU: cuBLAS (``F.linear``) against the Triton ``gemv`` over a
grid of tile configs, for the Llama-3-8B and Qwen3-8B projections.

    python kernels/bench_gemv.py [--json OUT.json]

Each case replays, from a CUDA graph, one product over each of several copies of the weight
in turn (more bytes than the L2 holds, as a model's layers are), and reports microseconds
per product and the weight-read bandwidth, next to a device-to-device copy measured in the
same run. The best config of each shape that beats cuBLAS belongs in ``gemv.CONFIGS``.

``--silu-mul`` times the gate/up projections with the SwiGLU activation as the product's
epilogue (``gemv(..., silu_mul=True)``) against the plain product (its ``CONFIGS`` entry)
followed by the activation kernel; the best config belongs in ``gemv.SILU_MUL_CONFIGS``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

import torch
import torch.nn.functional as F
import triton
import triton.testing
from bench_kernels import copy_bandwidth
from tokenspeed_kernels.activation import silu_and_mul
from tokenspeed_kernels.gemv import CONFIGS, gemv

# (name, N, K): qkv, o, gate_up, down, lm_head of Llama-3-8B, then Qwen3-8B's that differ.
SHAPES = (
    ("qkv", 6144, 4096),
    ("o_proj", 4096, 4096),
    ("gate_up", 28672, 4096),
    ("down", 4096, 14336),
    ("lm_head", 128256, 4096),
    ("qwen3 gate_up", 24576, 4096),
    ("qwen3 down", 4096, 12288),
    ("qwen3 lm_head", 151936, 4096),
)
GATE_UP_SHAPES = (("gate_up", 28672, 4096), ("qwen3 gate_up", 24576, 4096))
GRID = list(itertools.product((4, 8, 16), (512, 1024), (4, 8), (1, 3)))
L2_DEFEAT_BYTES = 512 * 2**20


def time_per_product(fn_for, weights) -> float:
    """Microseconds per product, the products cycling over ``weights``."""

    def all_of_them():
        for w in weights:
            fn_for(w)

    all_of_them()  # compile and warm outside the timing
    return triton.testing.do_bench_cudagraph(all_of_them) * 1e3 / len(weights)


def bench_shape(name: str, n: int, k: int) -> dict:
    copies = max(2, -(-L2_DEFEAT_BYTES // (n * k * 2)))
    weights = [
        torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(copies)
    ]
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    cublas = time_per_product(lambda w: F.linear(x, w), weights)
    sweep = {cfg: time_per_product(lambda w, c=cfg: gemv(x, w, config=c), weights) for cfg in GRID}
    best = min(sweep, key=sweep.get)
    bytes_read = n * k * 2
    return {
        "shape": name,
        "n": n,
        "k": k,
        "cublas_us": cublas,
        "cublas_tb_per_s": bytes_read / cublas / 1e6,
        "gemv_best_config": list(best),
        "gemv_best_us": sweep[best],
        "gemv_tb_per_s": bytes_read / sweep[best] / 1e6,
        "sweep_us": {str(c): round(t, 2) for c, t in sweep.items()},
    }


def bench_silu_mul(name: str, n: int, k: int) -> dict:
    copies = max(2, -(-L2_DEFEAT_BYTES // (n * k * 2)))
    weights = [
        torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(copies)
    ]
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    plain = CONFIGS[(n, k)]
    separate = time_per_product(lambda w: silu_and_mul(gemv(x, w, config=plain)), weights)
    sweep = {
        cfg: time_per_product(lambda w, c=cfg: gemv(x, w, config=c, silu_mul=True), weights)
        for cfg in GRID
    }
    best = min(sweep, key=sweep.get)
    return {
        "shape": name,
        "n": n,
        "k": k,
        "separate_us": separate,
        "silu_mul_best_config": list(best),
        "silu_mul_best_us": sweep[best],
        "sweep_us": {str(c): round(t, 2) for c, t in sweep.items()},
    }


def bench_plain() -> list[dict]:
    print(f"{'shape':>14} {'cuBLAS us':>10} {'TB/s':>5} {'gemv us':>8} {'TB/s':>5}  best config")
    rows = []
    for name, n, k in SHAPES:
        r = bench_shape(name, n, k)
        rows.append(r)
        print(
            f"{name:>14} {r['cublas_us']:>10.1f} {r['cublas_tb_per_s']:>5.2f}"
            f" {r['gemv_best_us']:>8.1f} {r['gemv_tb_per_s']:>5.2f}  {tuple(r['gemv_best_config'])}"
        )
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--silu-mul", action="store_true", help="the gate/up projections only")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_gemv.py needs a CUDA device")
    copy = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: D2D copy {copy / 1e12:.2f} TB/s")
    if args.silu_mul:
        rows = [bench_silu_mul(*shape) for shape in GATE_UP_SHAPES]
        for r in rows:
            print(f"{r['shape']:>14}: product + activation {r['separate_us']:.1f} us, fused "
                  f"{r['silu_mul_best_us']:.1f} us at {tuple(r['silu_mul_best_config'])}")  # fmt: skip
    else:
        rows = bench_plain()
    if args.json:
        result = {
            "device": torch.cuda.get_device_name(),
            "copy_tb_per_s": copy / 1e12,
            "torch": torch.__version__,
            "triton": triton.__version__,
            "shapes": rows,
        }
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
