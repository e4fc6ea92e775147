"""The extend (prefill) attention's tiles by cache dtype: every (queries per program, keys per
tile, warps, stages) of a grid, Llama-3-8B heads, fresh prompts as a prefill round holds them.

    python kernels/bench_extend_tiles.py --json OUT.json

Each case is timed by ``triton.testing.do_bench``; TFLOP/s counts the causal half of QK^T and
PV. Every tile's output is checked against the current ``extend_attention.TILES`` entry's (the
same sums in another order). The fastest entry per dtype says what ``TILES`` should hold.
"""

from __future__ import annotations

import argparse
import itertools
import sys

import torch
import triton
import triton.testing
from bench_kernels import (
    HEAD_DIM,
    NUM_KV_HEADS,
    NUM_Q_HEADS,
    copy_bandwidth,
    emit_report,
    paged_batch,
)
from tokenspeed_kernels import kv_layout
from tokenspeed_kernels.extend_attention import TILES, extend_attention
from tokenspeed_kernels.fp8 import FP8

# (rows, new tokens each): a round of 8 fresh 1,024-token prompts, one fresh 8,192-token prompt
CASES = ((8, 1024), (1, 8192))
GRID = list(itertools.product((64, 128), (64, 128), (4, 8), (2, 3)))


def tile_name(tiles: tuple) -> str:
    return "x".join(str(t) for t in tiles)


def bench_case(rows: int, tokens: int, fp8: bool, grid: list[tuple]) -> dict:
    _, k_cache, v_cache, block_tables, seq_lens = paged_batch(rows, tokens)
    scales = None
    if fp8:  # the engine's FP8 pool: V dim-major (kv_layout)
        k_cache = torch.empty_like(k_cache, dtype=FP8).copy_(k_cache)
        v_cache = kv_layout.dim_major(torch.empty_like(k_cache)).copy_(v_cache)
        ones = torch.ones(NUM_KV_HEADS, dtype=torch.float32, device="cuda")
        scales = (ones, ones)
    q = torch.randn(rows * tokens, NUM_Q_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    starts = torch.arange(0, rows + 1, dtype=torch.int32, device="cuda") * tokens

    def run(tiles):
        return extend_attention(
            q, k_cache, v_cache, block_tables, starts, seq_lens, tokens, HEAD_DIM**-0.5,
            kv_scales=scales, tiles=tiles,
        )  # fmt: skip

    default = TILES[k_cache.element_size()]
    expected = run(default).float()
    flops = 2 * 2 * NUM_Q_HEADS * HEAD_DIM * rows * tokens * tokens / 2
    sweep, errors = {}, {}
    for tiles in grid:
        name = tile_name(tiles)
        try:
            diff = (run(tiles).float() - expected).abs().max().item()
            if not diff < 2e-2:
                errors[name] = f"max abs difference {diff} from the default tile's output"
                continue
            sweep[name] = triton.testing.do_bench(lambda tiles=tiles: run(tiles)) * 1e3
        except Exception as err:  # a tile the device cannot hold (shared memory, registers)
            errors[name] = f"{type(err).__name__}: {str(err)[:200]}"
    best = min(sweep, key=sweep.get)
    return {
        "kv": "fp8" if fp8 else "bf16",
        "rows": rows,
        "new_tokens": tokens,
        "default": tile_name(default),
        "default_us": sweep.get(tile_name(default)),
        "best": best,
        "best_us": sweep[best],
        "best_tflops": flops / (sweep[best] * 1e-6) / 1e12,
        "sweep_us": {k: round(v, 1) for k, v in sweep.items()},
        "errors": errors,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--tiles", nargs="*", help="only these (QxKEYSxWARPSxSTAGES)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_extend_tiles.py needs a CUDA device")
    grid = [tuple(int(v) for v in t.split("x")) for t in args.tiles] if args.tiles else GRID
    copy = copy_bandwidth()
    results = []
    for (rows, tokens), fp8 in itertools.product(CASES, (False, True)):
        results.append(bench_case(rows, tokens, fp8, grid))
        r = results[-1]
        print(f"{r['kv']} {rows} x {tokens}: default {r['default']} {r['default_us']:.0f} us, "
              f"best {r['best']} {r['best_us']:.0f} us ({r['best_tflops']:.0f} TFLOP/s)",
              flush=True)  # fmt: skip
        torch.cuda.empty_cache()
    emit_report(copy, "extend", results, args.json)


if __name__ == "__main__":
    main()
