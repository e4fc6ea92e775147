"""An FP8 MLP's gate/up product and the quantized activation its down product takes, at 2-64
rows on a GPU: the product, then the SwiGLU launch that writes each chunk's amax and the
quantizing launch (``activation.silu_and_mul_quant``), against the product with the SwiGLU as
its epilogue (``fp8_gemm.fp8_gemm_silu_mul``), then the quantizing launch.

    python kernels/bench_fp8_swiglu.py [--buckets 16 32 64] [--json OUT.json] [--write-config]

Llama-3.1-8B's gate/up (28,672 x 4,096, per-row scales, per-token activations). Timing as
``bench_fp8_gemm.py``: the whole chain replayed from a CUDA graph over enough e4m3 copies of
the weight to defeat the L2, microseconds per chain, each side over its own grid of tiles
(the fused one's BLOCK_N counts one half). Both chains' quantized activations must be
bitwise what ``fp8.quantize_rows`` gives of their own activation, and the activations within
``fp8.product_tolerance`` of each other. ``--write-config`` writes the fused chain's best
tiles into this GPU's ``fp8_gemm_silu_mul`` table where it beat the unfused chain's best,
and removes the bucket's entry where it did not (the engine then takes the unfused chain).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from bench_fp8_gemm import fp8_copies, timed
from bench_kernels import copy_bandwidth, run_info
from tokenspeed_kernels import fp8, tuning
from tokenspeed_kernels.activation import silu_and_mul, silu_and_mul_quant
from tokenspeed_kernels.fp8_gemm import fp8_gemm, fp8_gemm_silu_mul, m_bucket
from tokenspeed_kernels.fp8_quant import quantize_by_chunk_amax, quantize_rows

N, K = 28672, 4096
# (BLOCK_N, BLOCK_K, num_warps, num_stages); BLOCK_M from the bucket, no split
PLAIN_GRID = [(64, 128, 4, 3), (64, 128, 4, 4), (128, 128, 4, 3), (64, 256, 4, 3),
              (128, 256, 4, 3), (128, 128, 8, 3), (128, 128, 4, 4)]  # fmt: skip
FUSED_GRID = [(32, 128, 4, 3), (64, 128, 4, 3), (64, 256, 4, 3), (64, 128, 4, 4),
              (64, 128, 8, 3), (128, 128, 8, 3), (32, 256, 4, 3)]  # fmt: skip


def unfused(xq, sx, w, config):
    y = fp8_gemm(xq, sx, w, None, torch.bfloat16, config)
    return y, silu_and_mul_quant(y)


def fused(xq, sx, w, config):
    act, amax = fp8_gemm_silu_mul(xq, sx, w, torch.bfloat16, config)
    return act, quantize_by_chunk_amax(act, amax)


def sweep(chain, xq, sx, weights, grid, block_m) -> dict:
    out = {}
    for block_n, block_k, warps, stages in grid:
        config = (False, block_m, block_n, block_k, 1, warps, stages)
        out[config] = timed(lambda w, c=config: chain(xq, sx, w, c), weights)
    return out


def bench(weights, m: int) -> dict:
    x = torch.randn(m, K, device="cuda", dtype=torch.bfloat16)
    xq, sx = quantize_rows(x)
    block_m = max(16, 1 << (m - 1).bit_length())
    plain = sweep(unfused, xq, sx, weights, PLAIN_GRID, block_m)
    fused_sweep = sweep(fused, xq, sx, weights, FUSED_GRID, block_m)
    best_plain = min((c for c in plain if plain[c]), key=plain.get)
    best_fused = min((c for c in fused_sweep if fused_sweep[c]), key=fused_sweep.get)
    y, (q, s) = unfused(xq, sx, weights[0], best_plain)
    act, (q_f, s_f) = fused(xq, sx, weights[0], best_fused)
    want = silu_and_mul(y)
    ok = (
        torch.allclose(act.float(), want.float(), **fp8.product_tolerance(want))
        and all(
            torch.equal(a.float(), b.float())
            for a, b in zip((q, s, q_f, s_f), (*fp8.quantize_rows(want), *fp8.quantize_rows(act)))
        )
    )  # fmt: skip
    row = {"batch": m, "unfused_best": list(best_plain), "unfused_us": plain[best_plain],
           "fused_best": list(best_fused), "fused_us": fused_sweep[best_fused],
           "matches": ok, "unfused_sweep_us": {str(c): t for c, t in plain.items()},
           "fused_sweep_us": {str(c): t for c, t in fused_sweep.items()}}  # fmt: skip
    print(f"M={m}: unfused {plain[best_plain]:.1f} us {best_plain}; fused "
          f"{fused_sweep[best_fused]:.1f} us {best_fused}; matches {ok}")  # fmt: skip
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--buckets", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--write-config", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_fp8_swiglu.py needs a CUDA device")
    torch.manual_seed(0)  # the same operands, so the same reference check, every sweep
    copy = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: D2D copy {copy / 1e12:.2f} TB/s")
    weights = fp8_copies(N, K, False)
    rows = [bench(weights, m) for m in args.buckets]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**run_info(copy), "rows": rows}, f, indent=1)
    if not all(r["matches"] for r in rows):
        sys.exit("a chain's output differs (see above)")
    if args.write_config:
        picks = {
            (N, K, m_bucket(r["batch"])): (
                tuple(r["fused_best"][1:4] + r["fused_best"][5:])
                if r["fused_us"] < r["unfused_us"]
                else None
            )
            for r in rows
        }
        print(f"-> {tuning.update('fp8_gemm_silu_mul', picks)}")


if __name__ == "__main__":
    main()
