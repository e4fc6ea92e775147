"""FP8 (e4m3) linear layers on a GPU: the Triton kernels' tiles against ``torch._scaled_mm``,
per shape, scheme and row bucket; ``--write-config`` writes the picks into this GPU's
``fp8_gemv`` and ``fp8_gemm`` tables (``tokenspeed_kernels/tuning.py``).

    python kernels/bench_fp8_gemm.py [--models llama qwen3] [--buckets [64 256 512]]
                                     [--json OUT.json] [--write-config] [--budget-s 240]
                                     [--gemm-only]

Models and the schemes their acceptance runs use: ``llama`` (Llama-3.1-8B's projections,
per-channel scales, per-token activations) and ``qwen3`` (Qwen3-8B's, 128x128 block scales,
per-group activations). Timing as ``bench_gemv.py``: one product replayed from a CUDA graph
over enough e4m3 copies of the weight to defeat the L2, microseconds per product and the
weight-read bandwidth next to a device-to-device copy of the same run. The activations
arrive quantized (the quantization kernel is the same for both implementations).

- One row (``fp8_gemv``, key (N, K, block, silu_mul)): ``gemv`` on the e4m3 weight over
  ``GEMV_GRID``, plain and, for gate_up, with the SwiGLU epilogue; ``torch._scaled_mm`` at
  one row is timed beside it for the record (the engine's one-row products always take the
  Triton kernel, which also runs the norm prologue and the RoPE/KV epilogue). The
  projections the engine runs after a norm (``NORMED``: qkv, whose entry the RoPE/KV launch
  takes, and gate_up) are timed with the residual-add norm prologue (``norm_gemv``, two
  passes), whose reads of x every program repeats: a tile of fewer rows pays it more often.
- More rows (``fp8_gemm``, key (N, K, block, m_bucket)): the Triton kernel over
  ``GEMM_GRID`` (and ``WIDE_K_GRID`` for per-row scales; BLOCK_M = the bucket up to 64, else
  64 and 128) against ``torch._scaled_mm``
  (per-row scales only); the faster is written, with its tiles.

Every winner is checked against ``fp8.linear`` (the torch definition) before it is kept.
``--budget-s`` stops the sweep when spent (what was measured is still written).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import triton
from bench_gemv import L2_DEFEAT_BYTES, time_per_product
from bench_kernels import copy_bandwidth, run_info
from tokenspeed_kernels import fp8, tuning
from tokenspeed_kernels.fp8 import Fp8Weight
from tokenspeed_kernels.fp8_gemm import fp8_gemm, m_bucket
from tokenspeed_kernels.fp8_quant import quantize_rows
from tokenspeed_kernels.gemv import gemv, norm_gemv
from tokenspeed_kernels.rmsnorm import fused_add_rms_norm
from triton.runtime.errors import OutOfResources

MODELS = {
    "llama": ("channel", [("qkv", 6144, 4096), ("o_proj", 4096, 4096),
                          ("gate_up", 28672, 4096), ("down", 4096, 14336)]),
    "qwen3": ("block", [("qkv", 6144, 4096), ("o_proj", 4096, 4096),
                        ("gate_up", 24576, 4096), ("down", 4096, 12288)]),
}  # fmt: skip
NORMED = ("qkv", "gate_up")  # the projections after a decoder layer's norms
# The 16-bit product's grid, and tiles of twice the K: an e4m3 tile of a given shape holds
# half the bytes, so the same bytes in flight take twice the elements. The last two give the
# SwiGLU's paired rows one row a thread: with several, the compiler may pair rows sharing an
# x value into its packed fp16 products, a byte permute each (docs/performance.md).
GEMV_GRID = [
    (8, 512, 4, 3), (8, 1024, 8, 3), (16, 512, 4, 1), (16, 512, 8, 3),
    (4, 1024, 8, 1), (8, 1024, 4, 1), (16, 1024, 8, 1), (4, 512, 4, 3),
    (8, 2048, 8, 3), (8, 2048, 8, 1), (16, 2048, 16, 1), (4, 2048, 4, 3), (4, 4096, 8, 1),
    (4, 2048, 8, 3), (8, 2048, 16, 1),
]  # fmt: skip
# (BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages); BLOCK_M from the bucket. Block scales
# take BLOCK_K 128; per-row ones also the wider K, which holds a 16-bit tile's bytes.
GEMM_GRID = [
    (64, 128, 1, 4, 3),
    (64, 128, 2, 4, 3),
    (64, 128, 4, 4, 3),
    (128, 128, 1, 4, 3),
    (128, 128, 2, 4, 3),
    (64, 128, 1, 4, 4),
    (128, 128, 1, 4, 4),
    (64, 128, 2, 4, 4),
]
WIDE_K_GRID = [(64, 256, 1, 4, 3), (64, 256, 2, 4, 3), (64, 256, 4, 4, 3), (64, 256, 2, 4, 4),
               (128, 256, 1, 4, 3), (128, 256, 2, 4, 3), (128, 256, 1, 8, 3),
               (64, 512, 2, 4, 3), (64, 512, 4, 4, 2), (32, 512, 2, 4, 3)]  # fmt: skip


class Budget:
    def __init__(self, seconds: float) -> None:
        self.end = time.perf_counter() + seconds

    def spent(self) -> bool:
        return time.perf_counter() > self.end


def fp8_copies(n: int, k: int, block: bool) -> list[Fp8Weight]:
    copies = max(2, -(-L2_DEFEAT_BYTES // (n * k)))
    out = []
    for _ in range(copies):
        w = torch.randn(n, k, device="cuda") / k**0.5
        q, s = fp8.quantize_weight(w, "block" if block else "channel")
        out.append(Fp8Weight(q, s))
    return out


def timed(fn, weights) -> float | None:
    """Microseconds per product, None where the config does not fit or the call refuses
    the shape (``torch._scaled_mm``'s limits)."""
    try:
        return time_per_product(fn, weights)
    except (OutOfResources, RuntimeError) as err:
        print(f"  skipped: {type(err).__name__}: {str(err)[:100]}")
        return None


def bench_gemv(name, weights, block, silu_mul, budget, normed: bool) -> dict:
    n, k = weights[0].shape
    x, r = (torch.randn(1, k, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    g = torch.rand(k, device="cuda", dtype=torch.bfloat16) + 0.5

    def one_row(w, config):
        if not normed:
            return gemv(x, w, None, config, silu_mul)
        return norm_gemv(x, r, g, 1e-6, w, None, (*config, True), silu_mul)[0]

    sweep = {}
    for config in GEMV_GRID:
        if budget.spent():
            break
        sweep[config] = timed(lambda w, c=config: one_row(w, c), weights)
    found = {c: t for c, t in sweep.items() if t is not None}
    best = min(found, key=found.get)
    operand = fused_add_rms_norm(x, r, g, 1e-6)[0] if normed else x
    want = fp8.linear(operand, weights[0].q, weights[0].scale)
    if silu_mul:
        from tokenspeed_kernels.activation import silu_and_mul

        want = silu_and_mul(want)
    ok = torch.allclose(one_row(weights[0], best).float(), want.float(),
                        **fp8.product_tolerance(want))  # fmt: skip
    scaled_mm = None
    if not block and not silu_mul:
        xq, sx = quantize_rows(x)
        scaled_mm = timed(lambda w: fp8_gemm(xq, sx, w, None, torch.bfloat16, (True,) * 7),
                          weights)  # fmt: skip
    us = found[best]
    print(f"{name:>8} M=1 {'norm ' if normed else ''}{'silu ' if silu_mul else ''}best {best}: "
          f"{us:.1f} us ({n * k / us / 1e6:.2f} TB/s); scaled_mm "
          f"{scaled_mm and round(scaled_mm, 1)} us")  # fmt: skip
    return {"shape": name, "n": n, "k": k, "block": block, "silu_mul": silu_mul, "batch": 1,
            "norm_prologue": normed,
            "best_config": list(best), "us": us, "tb_per_s": n * k / us / 1e6,
            "scaled_mm_us": scaled_mm, "matches_reference": ok,
            "sweep_us": {str(c): t for c, t in sweep.items()}}  # fmt: skip


def bench_gemm(name, weights, block, m, budget) -> dict:
    n, k = weights[0].shape
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    xq, sx = quantize_rows(x, fp8.BLOCK if block else None)
    block_ms = [max(16, triton.next_power_of_2(m))] if m <= 64 else [64, 128]
    sweep = {}
    grid = GEMM_GRID if block else GEMM_GRID + WIDE_K_GRID
    for block_m in block_ms:
        for tiles in grid:
            if budget.spent():
                break
            config = (False, block_m, *tiles)
            sweep[config] = timed(
                lambda w, c=config: fp8_gemm(xq, sx, w, None, torch.bfloat16, c), weights
            )
    if not block:
        config = (True, 1, 1, 1, 1, 1, 1)
        sweep[config] = timed(lambda w: fp8_gemm(xq, sx, w, None, torch.bfloat16, config),
                              weights)  # fmt: skip
    found = {c: t for c, t in sweep.items() if t is not None}
    best = min(found, key=found.get)
    got = fp8_gemm(xq, sx, weights[0], None, torch.bfloat16, best)
    want = fp8.linear(x, weights[0].q, weights[0].scale)
    ok = torch.allclose(got.float(), want.float(), **fp8.product_tolerance(want))
    us = found[best]
    print(f"{name:>8} M={m:<4} best {best}: {us:.1f} us ({n * k / us / 1e6:.2f} TB/s)")
    return {"shape": name, "n": n, "k": k, "block": block, "batch": m,
            "m_bucket": m_bucket(m), "best_config": list(best), "us": us,
            "tb_per_s": n * k / us / 1e6, "matches_reference": ok,
            "sweep_us": {str(c): t for c, t in sweep.items()}}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument(
        "--buckets",
        type=int,
        nargs="*",
        default=[16, 64, 256, 512],
        help="row counts of the many-row products; none: one row only",
    )
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--write-config", action="store_true")
    parser.add_argument("--budget-s", type=float, default=240.0)
    parser.add_argument("--gemm-only", action="store_true", help="skip the one-row products")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_fp8_gemm.py needs a CUDA device")
    torch.manual_seed(0)  # the same operands, so the same reference check, every sweep
    budget = Budget(args.budget_s)
    start = time.perf_counter()
    copy = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: D2D copy {copy / 1e12:.2f} TB/s")
    rows = []
    for model in args.models:
        kind, shapes = MODELS[model]
        block = kind == "block"
        for name, n, k in shapes:
            if budget.spent():
                break
            weights = fp8_copies(n, k, block)
            if not args.gemm_only:
                normed = name in NORMED
                rows.append(bench_gemv(f"{model} {name}", weights, block, False, budget, normed))
            if name == "gate_up" and not args.gemm_only:
                rows.append(bench_gemv(f"{model} {name}", weights, block, True, budget, True))
            for m in args.buckets:
                if not budget.spent():
                    rows.append(bench_gemm(f"{model} {name}", weights, block, m, budget))
            del weights
            torch.cuda.empty_cache()
    gemv_picks = {(r["n"], r["k"], r["block"], r["silu_mul"]): tuple(r["best_config"])
                  for r in rows if r["batch"] == 1 and r["matches_reference"]}  # fmt: skip
    gemm_picks = {(r["n"], r["k"], r["block"], r["m_bucket"]): tuple(r["best_config"])
                  for r in rows if r["batch"] > 1 and r["matches_reference"]}  # fmt: skip
    elapsed = time.perf_counter() - start
    print(tuning.dumps("fp8_gemv", gemv_picks))
    print(tuning.dumps("fp8_gemm", gemm_picks))
    print(f"{elapsed:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**run_info(copy), "elapsed_s": elapsed, "rows": rows}, f, indent=1)
    if args.write_config:
        print(f"-> {tuning.update('fp8_gemv', gemv_picks)}")
        print(f"-> {tuning.update('fp8_gemm', gemm_picks)}")
    if not all(r["matches_reference"] for r in rows):
        sys.exit("some winner differs from fp8.linear (see above)")


if __name__ == "__main__":
    main()
