"""Batch-1 linear layers on a GPU: cuBLAS (``F.linear``) against the Triton ``gemv`` over a
grid of tile configs, for the Llama-3-8B and Qwen3-8B projections.

    python kernels/bench_gemv.py [--silu-mul | --norm] [--json OUT.json]

Each case replays, from a CUDA graph, one product over each of several copies of the weight
in turn (more bytes than the L2 holds, as a model's layers are), and reports microseconds
per product and the weight-read bandwidth, next to a device-to-device copy measured in the
same run. The best config of each shape that beats cuBLAS belongs in ``gemv.CONFIGS``.

``--silu-mul`` times the gate/up projections with the SwiGLU activation as the product's
epilogue (``gemv(..., silu_mul=True)``) against the plain product (its ``CONFIGS`` entry)
followed by the activation kernel; the best config belongs in ``gemv.SILU_MUL_CONFIGS``.

``--norm`` times the projections that follow a decoder layer's norms (qkv; gate_up with its
activation) with the residual add + RMSNorm as the product's prologue
(``gemv.norm_gemv``), sweeping the tile grid with both prologues (one pass, two passes),
against the unfused pair: ``rmsnorm.fused_add_rms_norm`` then ``gemv`` with its measured
config. The best config, with its prologue, belongs in ``gemv.NORM_CONFIGS``.
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
from tokenspeed_kernels.gemv import CONFIGS, SILU_MUL_CONFIGS, gemv, norm_gemv
from tokenspeed_kernels.rmsnorm import fused_add_rms_norm

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
# (name, N, K, silu_mul): the products after the input and post-attention norms.
NORM_SHAPES = (("qkv", 6144, 4096, False), *((*shape, True) for shape in GATE_UP_SHAPES))
GRID = list(itertools.product((4, 8, 16), (512, 1024), (4, 8), (1, 3)))
L2_DEFEAT_BYTES = 512 * 2**20


def time_per_product(fn_for, weights) -> float:
    """Microseconds per product, the products cycling over ``weights``."""

    def all_of_them():
        for w in weights:
            fn_for(w)

    all_of_them()  # compile and warm outside the timing
    return triton.testing.do_bench_cudagraph(all_of_them) * 1e3 / len(weights)


def weight_copies(n: int, k: int) -> list[torch.Tensor]:
    """Enough copies of an [n, k] bf16 weight that cycling over them defeats the L2."""
    copies = max(2, -(-L2_DEFEAT_BYTES // (n * k * 2)))
    return [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(copies)]


def bench_shape(name: str, n: int, k: int) -> dict:
    weights = weight_copies(n, k)
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
    weights = weight_copies(n, k)
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


def bench_norm(name: str, n: int, k: int, silu_mul: bool) -> dict:
    weights = weight_copies(n, k)
    x, residual = (torch.randn(1, k, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    norm_weight = torch.randn(k, device="cuda", dtype=torch.bfloat16)
    eps = 1e-5
    plain = (SILU_MUL_CONFIGS if silu_mul else CONFIGS)[(n, k)]

    def unfused(w):
        normed, _ = fused_add_rms_norm(x, residual, norm_weight, eps)
        return gemv(normed, w, config=plain, silu_mul=silu_mul)

    def fused(w, config):
        return norm_gemv(x, residual, norm_weight, eps, w, config=config, silu_mul=silu_mul)

    separate = time_per_product(unfused, weights)
    sweep = {
        (*cfg, two_pass): time_per_product(lambda w, c=(*cfg, two_pass): fused(w, c), weights)
        for cfg in GRID
        for two_pass in (False, True)
    }
    best = min(sweep, key=sweep.get)
    best_of = {
        prologue: min((c for c in sweep if c[-1] == two_pass), key=sweep.get)
        for prologue, two_pass in (("one_pass", False), ("two_pass", True))
    }
    return {
        "shape": name,
        "n": n,
        "k": k,
        "silu_mul": silu_mul,
        "unfused_us": separate,
        "norm_best_config": list(best),
        "norm_best_us": sweep[best],
        **{f"{p}_best_config": list(c) for p, c in best_of.items()},
        **{f"{p}_best_us": sweep[c] for p, c in best_of.items()},
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
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--silu-mul", action="store_true", help="the gate/up projections only")
    mode.add_argument(
        "--norm", action="store_true", help="the products with the norm as their prologue"
    )
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
    elif args.norm:
        rows = []
        for shape in NORM_SHAPES:
            r = bench_norm(*shape)
            rows.append(r)
            print(f"{r['shape']:>14}: norm + product {r['unfused_us']:.1f} us, fused "
                  f"{r['norm_best_us']:.1f} us at {tuple(r['norm_best_config'])} (one pass "
                  f"{r['one_pass_best_us']:.1f}, two passes {r['two_pass_best_us']:.1f})")  # fmt: skip
            torch.cuda.empty_cache()
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
