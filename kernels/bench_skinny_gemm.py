"""Small-batch linear layers on a GPU: cuBLAS against the Triton ``skinny_gemm``'s tiles.

cuBLAS (``F.linear``) against ``skinny_gemm`` over a grid of tile configs, for the Llama-3-8B
and Qwen3-8B projections at 2 to 64 rows (``--batch``).

    python kernels/bench_skinny_gemm.py [--silu-mul] [--batch M ...] [--json OUT.json]
                                        [--write-config]

Timing as in ``bench_gemv.py``: a CUDA graph replays one product over each of several copies
of the weight in turn (more bytes than the L2 holds), reported as microseconds per product and
weight-read bandwidth, next to a device-to-device copy measured in the same run.

Within an M bucket (``skinny_gemm.m_bucket``: rows pad to 16, 32 or 64) the kernel does the
same work whatever M is, so the tile search runs once per (shape, bucket), at the bucket's
largest batch, and its winner is then timed at every batch of the bucket against cuBLAS at
that batch. The search goes coarse to fine rather than over the whole grid (every config
costs a compile and a timing):

1. BLOCK_N 16/32/64/128 x SPLIT_K 1/2/4/8 at BLOCK_K 128, 4 warps, 4 stages, keeping those
   that launch between half a wave and 16 waves of programs (one wave: a program per SM);
2. BLOCK_K 64/128/256 at the best of 1;
3. num_warps 4/8 x num_stages 3/4/5 at the best of 2.

Every step keeps ``K / SPLIT_K >= BLOCK_K`` and skips configs that do not fit the shared
memory. Each winner's output is checked against ``F.linear`` at every batch before it is
reported. The winners that match ``F.linear`` and beat cuBLAS at every batch of their bucket
belong in this GPU's ``skinny_gemm`` table: ``--write-config`` writes them into its file for
the current device and removes the (shape, bucket) keys measured where cuBLAS won
(``tokenspeed_kernels/tuning.py``); ``--json`` writes every timing and the winners' table.
``kernels/bench_decode_chain.py`` then picks the 64-row keys in a decoder layer's chain.

``--silu-mul`` times the gate/up projections with the SwiGLU activation as the product's
epilogue (``skinny_gemm(..., silu_mul=True)``) against cuBLAS followed by ``silu_and_mul``;
its winners belong in ``skinny_gemm_silu_mul``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch.nn.functional as F
import triton
from bench_gemv import GATE_UP_SHAPES, time_per_product, weight_copies
from bench_gemv import SHAPES as GEMV_SHAPES
from bench_kernels import copy_bandwidth, run_info
from tokenspeed_kernels import tuning
from tokenspeed_kernels.activation import silu_and_mul
from tokenspeed_kernels.skinny_gemm import MAX_M, m_bucket, skinny_gemm
from triton.runtime.errors import OutOfResources

# bench_gemv's projections but the lm_heads (the logits of every row: a wide product that
# cuBLAS already streams near the bandwidth).
SHAPES = tuple(shape for shape in GEMV_SHAPES if "lm_head" not in shape[0])
BATCHES = (2, 4, 8, 16, 32, 64)
BLOCK_NS, BLOCK_KS, SPLIT_KS = (16, 32, 64, 128), (64, 128, 256), (1, 2, 4, 8)
WARPS, STAGES = (4, 8), (3, 4, 5)
FIRST = (128, 4, 4)  # BLOCK_K, num_warps, num_stages of step 1
WAVES = (0.5, 16)  # programs per SM that step 1 keeps
TOLERANCE = dict(rtol=2e-2, atol=2e-2)  # bf16: an output rounding, plus a little


def search(features: int, k: int, time_us, num_sms: int) -> tuple[int, ...]:
    """The coarse-to-fine walk of the module doc; ``time_us(config)`` is None where the
    config does not fit."""

    def fastest(configs):
        times = {c: time_us(c) for c in configs}
        return min((c for c in configs if times[c] is not None), key=times.get)

    block_k, warps, stages = FIRST
    best = fastest([
        (block_n, block_k, split_k, warps, stages)
        for block_n in BLOCK_NS
        for split_k in SPLIT_KS
        if k // split_k >= block_k
        and WAVES[0] <= triton.cdiv(features, block_n) * split_k / num_sms <= WAVES[1]
    ])  # fmt: skip
    block_n, _, split_k, _, _ = best
    best = fastest([(block_n, bk, split_k, warps, stages) for bk in BLOCK_KS if k // split_k >= bk])
    return fastest([(*best[:3], w, s) for w in WARPS for s in STAGES])


def bench_bucket(name: str, weights: list, xs: dict, silu_mul: bool) -> dict:
    """One shape at the batches ``xs`` of one M bucket: the search, then each batch against
    cuBLAS."""
    n, k = weights[0].shape
    bytes_read = n * k * 2
    bucket, top = m_bucket(max(xs)), max(xs)
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count

    def kernel(x, config):
        return lambda w: skinny_gemm(x, w, config=config, silu_mul=silu_mul)

    def cublas(x):
        return lambda w: silu_and_mul(F.linear(x, w)) if silu_mul else F.linear(x, w)

    swept: dict[tuple[int, ...], float | None] = {}

    def time_us(config):
        if config not in swept:
            try:
                swept[config] = time_per_product(kernel(xs[top], config), weights)
                print(f"{name:>14} M<={bucket:<2} {config!s:<22} {swept[config]:7.1f} us"
                      f" {bytes_read / swept[config] / 1e6:5.2f} TB/s")  # fmt: skip
            except OutOfResources:
                swept[config] = None
        return swept[config]

    best = search(n // 2 if silu_mul else n, k, time_us, num_sms)
    per_batch = []
    for m, x in xs.items():
        y, ref = kernel(x, best)(weights[0]), cublas(x)(weights[0])
        ours = swept[best] if m == top else time_per_product(kernel(x, best), weights)
        theirs = time_per_product(cublas(x), weights)
        per_batch.append({
            "batch": m,
            "cublas_us": theirs,
            "cublas_tb_per_s": bytes_read / theirs / 1e6,
            "skinny_us": ours,
            "skinny_tb_per_s": bytes_read / ours / 1e6,
            "speedup": theirs / ours,
            "matches_linear": torch.allclose(y.float(), ref.float(), **TOLERANCE),
        })  # fmt: skip
        p = per_batch[-1]
        print(f"{name:>14} M={m:<2} best {best}: {ours:.1f} us ({p['skinny_tb_per_s']:.2f}"
              f" TB/s) vs cuBLAS {theirs:.1f} us ({p['cublas_tb_per_s']:.2f} TB/s), "
              f"{'matches' if p['matches_linear'] else 'DIFFERS FROM'} F.linear")  # fmt: skip
    return {
        "shape": name,
        "n": n,
        "k": k,
        "silu_mul": silu_mul,
        "m_bucket": bucket,
        "searched_at_batch": top,
        "best_config": list(best),
        "beats_cublas": all(p["speedup"] > 1 for p in per_batch),
        "matches_linear": all(p["matches_linear"] for p in per_batch),
        "batches": per_batch,
        "sweep": {
            str(c): None if t is None else {"us": t, "tb_per_s": bytes_read / t / 1e6}
            for c, t in swept.items()
        },
    }


def bench_shape(name: str, n: int, k: int, batches: list[int], silu_mul: bool) -> list[dict]:
    """One row per M bucket of ``batches``."""
    weights = weight_copies(n, k)
    buckets: dict[int, dict[int, torch.Tensor]] = {}
    for m in sorted(set(batches)):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        buckets.setdefault(m_bucket(m), {})[m] = x
    return [bench_bucket(name, weights, xs, silu_mul) for xs in buckets.values()]


def picks(rows: list[dict]) -> dict:
    """(N, K, m_bucket) -> the winner where it matched F.linear and beat cuBLAS at every batch
    of the bucket, else None (the key leaves the table: ``tuning.update``)."""
    return {
        (r["n"], r["k"], r["m_bucket"]): (
            tuple(r["best_config"]) if r["beats_cublas"] and r["matches_linear"] else None
        )
        for r in rows
    }


def table_name(silu_mul: bool) -> str:
    return "skinny_gemm_silu_mul" if silu_mul else "skinny_gemm"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--silu-mul", action="store_true", help="the gate/up projections only")
    parser.add_argument(
        "--batch", type=int, nargs="+", default=list(BATCHES), help="rows of x (1 to 64)"
    )
    parser.add_argument(
        "--write-config", action="store_true", help="write the picks into this GPU's table"
    )
    args = parser.parse_args()
    if not all(1 <= m <= MAX_M for m in args.batch):
        parser.error(f"--batch takes 1 to {MAX_M} rows")
    if not torch.cuda.is_available():
        sys.exit("bench_skinny_gemm.py needs a CUDA device")
    start = time.perf_counter()
    copy = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: D2D copy {copy / 1e12:.2f} TB/s")
    rows = []
    for shape in GATE_UP_SHAPES if args.silu_mul else SHAPES:
        rows += bench_shape(*shape, args.batch, args.silu_mul)
        torch.cuda.empty_cache()
    chosen = picks(rows)
    winners = {key: config for key, config in chosen.items() if config is not None}
    snippet = tuning.dumps(table_name(args.silu_mul), winners)
    elapsed = time.perf_counter() - start
    print(f"{snippet}\n{elapsed:.0f} s")
    if args.json:
        result = {
            **run_info(copy),
            "elapsed_s": elapsed,
            "shapes": rows,
            "configs": snippet,
        }
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.write_config:
        print(f"-> {tuning.update(table_name(args.silu_mul), chosen)}")
    if not all(r["matches_linear"] for r in rows):
        sys.exit("some winner differs from F.linear (see above)")


if __name__ == "__main__":
    main()
