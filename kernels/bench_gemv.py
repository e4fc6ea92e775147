"""Batch-1 linear layers on a GPU: cuBLAS (``F.linear``) against the Triton ``gemv`` over a
grid of tile configs, for the Llama-3-8B and Qwen3-8B projections.

    python kernels/bench_gemv.py [--silu-mul | --norm | --rope-kv] [--json OUT.json]
                                 [--write-config]

Each case replays, from a CUDA graph, one product over each of several copies of the weight
in turn (more bytes than the L2 holds, as a model's layers are), and reports microseconds
per product and the weight-read bandwidth, next to a device-to-device copy measured in the
same run. The best config of each shape that beats cuBLAS belongs in this GPU's ``gemv``
table: ``--write-config`` writes each mode's winners into its table's file for the current
device, and removes the shapes where the baseline won (``tokenspeed_kernels/tuning.py``).
Each mode's baseline runs from the tables of the modes before it (plain, ``--silu-mul``,
``--norm``, ``--rope-kv``): re-tune in that order.

``--silu-mul`` times the gate/up projections with the SwiGLU activation as the product's
epilogue (``gemv(..., silu_mul=True)``) against the plain product (its ``gemv`` table entry,
else cuBLAS) followed by the activation kernel; the best config belongs in ``gemv_silu_mul``.

``--norm`` times the projections that follow a decoder layer's norms (qkv; gate_up with its
activation) with the residual add + RMSNorm as the product's prologue
(``gemv.norm_gemv``), sweeping the tile grid with both prologues (one pass, two passes),
against the unfused pair: ``rmsnorm.fused_add_rms_norm`` then the product as the tables
run it. The best config, with its prologue, belongs in ``gemv_norm``.

``--rope-kv`` times the qkv projection of one token with RoPE and the KV-cache write as its
epilogue (``gemv_rope_kv.norm_gemv_rope_kv``), sweeping BLOCK_HALF and the rest of the grid with both
prologues, against the unfused pair: ``norm_gemv`` with its ``gemv_norm`` entry (else the
norm kernel and the product), then ``rotary.apply_rotary`` with its ``kv_store``; also the
fused kernel at its default config (``gemv_rope_kv.rope_kv_config``). The best config
belongs in ``gemv_rope_kv``.
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
from bench_kernels import copy_bandwidth, run_info
from tokenspeed_kernels import tuning
from tokenspeed_kernels.activation import silu_and_mul
from tokenspeed_kernels.gemv import configs, gemv, norm_configs, norm_gemv
from tokenspeed_kernels.gemv_rope_kv import norm_gemv_rope_kv, rope_kv_config
from tokenspeed_kernels.rmsnorm import fused_add_rms_norm
from tokenspeed_kernels.rotary import apply_rotary

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
# (name, Hq, Hkv, D, K): the qkv projection of Llama-3-8B and Qwen3-8B, [6144, 4096].
ROPE_KV_SHAPE = ("qkv", 32, 8, 128, 4096)
GRID = list(itertools.product((4, 8, 16), (512, 1024), (4, 8), (1, 3)))
# BLOCK_HALF, a program reading twice as many rows: 4 to 32, as GRID's BLOCK_N and one more.
ROPE_KV_GRID = list(itertools.product((2, 4, 8, 16), (512, 1024), (4, 8), (1, 3)))
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


def table_product(x: torch.Tensor, w: torch.Tensor, silu_mul: bool = False) -> torch.Tensor:
    """The batch-1 product (and activation) as the engine runs it from this GPU's tables
    (``model/ops/products.py``): the fused epilogue's entry, else the plain product's then
    the activation, else cuBLAS."""
    fused = configs(x.device, silu_mul=True).get(tuple(w.shape)) if silu_mul else None
    if fused:
        return gemv(x, w, config=fused, silu_mul=True)
    config = configs(x.device).get(tuple(w.shape))
    y = gemv(x, w, config=config) if config else F.linear(x, w)
    return silu_and_mul(y) if silu_mul else y


def pick(key: tuple, best: tuple, best_us: float, baseline_us: float) -> dict:
    """A result's entry for ``tuning.update``: the winner where it beat the baseline, else
    None (the key leaves the table)."""
    return {"key": list(key), "config": list(best) if best_us < baseline_us else None}


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
        "pick": pick((n, k), best, sweep[best], cublas),
    }


def bench_silu_mul(name: str, n: int, k: int) -> dict:
    weights = weight_copies(n, k)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    separate = time_per_product(lambda w: silu_and_mul(table_product(x, w)), weights)
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
        "pick": pick((n, k), best, sweep[best], separate),
    }


def norm_inputs(k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """x, residual, norm_weight and eps of a norm before a product over K = ``k``."""
    x, residual = (torch.randn(1, k, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    return x, residual, torch.randn(k, device="cuda", dtype=torch.bfloat16), 1e-5


def bench_norm(name: str, n: int, k: int, silu_mul: bool) -> dict:
    weights = weight_copies(n, k)
    x, residual, norm_weight, eps = norm_inputs(k)

    def unfused(w):
        normed, _ = fused_add_rms_norm(x, residual, norm_weight, eps)
        return table_product(normed, w, silu_mul)

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
        "pick": pick((n, k, silu_mul), best, sweep[best], separate),
    }


def bench_rope_kv(name: str, num_q_heads: int, num_kv_heads: int, head_dim: int, k: int) -> dict:
    n = (num_q_heads + 2 * num_kv_heads) * head_dim
    weights = weight_copies(n, k)
    norm_args = norm_inputs(k)
    cos_sin = torch.randn(8192, head_dim, device="cuda")
    positions = torch.tensor([4000], device="cuda")
    slots = torch.tensor([1234], device="cuda")
    cache_shape = (256, 16, num_kv_heads, head_dim)
    caches = [torch.zeros(cache_shape, device="cuda", dtype=torch.bfloat16) for _ in "kv"]
    plain = norm_configs().get((n, k, False))
    split = [num_q_heads, num_kv_heads, num_kv_heads]

    def unfused(w):
        if plain:
            y, _ = norm_gemv(*norm_args, w, config=plain)
        else:
            y = table_product(fused_add_rms_norm(*norm_args)[0], w)
        q, k_new, v_new = y.view(1, -1, head_dim).split(split, dim=1)
        apply_rotary(q, k_new, positions, cos_sin, (v_new, *caches, slots))

    def fused(w, config):
        norm_gemv_rope_kv(*norm_args, w, None, positions, cos_sin, *caches, slots, config)

    separate = time_per_product(unfused, weights)
    default = time_per_product(lambda w: fused(w, None), weights)
    sweep = {
        (*cfg, two_pass): time_per_product(lambda w, c=(*cfg, two_pass): fused(w, c), weights)
        for cfg in ROPE_KV_GRID
        for two_pass in (False, True)
    }
    best = min(sweep, key=sweep.get)
    return {
        "shape": name,
        "n": n,
        "k": k,
        "heads": [num_q_heads, num_kv_heads, head_dim],
        "unfused_us": separate,
        "unfused_norm_config": list(plain) if plain else None,
        "default_config": list(rope_kv_config(n, k)),
        "default_us": default,
        "rope_kv_best_config": list(best),
        "rope_kv_best_us": sweep[best],
        "sweep_us": {str(c): round(t, 2) for c, t in sweep.items()},
        "pick": pick((n, k), best, sweep[best], separate),
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


def write_picks(args: argparse.Namespace, rows: list[dict]) -> None:
    """Each row's pick into the current device's file of the mode's table."""
    modes = {"gemv_silu_mul": args.silu_mul, "gemv_norm": args.norm, "gemv_rope_kv": args.rope_kv}
    table = next((name for name, chosen in modes.items() if chosen), "gemv")
    picks = {tuple(r["pick"]["key"]): r["pick"]["config"] for r in rows}
    print(f"{table}: {picks} -> {tuning.update(table, picks)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the results here")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--silu-mul", action="store_true", help="the gate/up projections only")
    mode.add_argument(
        "--norm", action="store_true", help="the products with the norm as their prologue"
    )
    mode.add_argument(
        "--rope-kv", action="store_true", help="qkv with RoPE + the KV-cache write as epilogue"
    )
    parser.add_argument(
        "--write-config", action="store_true", help="write the picks into this GPU's table"
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
    elif args.rope_kv:
        r = bench_rope_kv(*ROPE_KV_SHAPE)
        rows = [r]
        print(f"{r['shape']:>14}: norm_gemv + rotary/kv {r['unfused_us']:.1f} us, fused "
              f"{r['rope_kv_best_us']:.1f} us at {tuple(r['rope_kv_best_config'])} (default "
              f"{tuple(r['default_config'])}: {r['default_us']:.1f})")  # fmt: skip
    else:
        rows = bench_plain()
    if args.json:
        result = {**run_info(copy), "shapes": rows}
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.write_config:
        write_picks(args, rows)


if __name__ == "__main__":
    main()
