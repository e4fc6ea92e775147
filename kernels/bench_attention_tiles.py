"""Decode attention's tiles by cache dtype: every (keys per tile, warps, stages, register
cap) and split count, Llama-3-8B shapes, at the batch sizes and contexts of the fixed-1k runs.

    python kernels/bench_attention_tiles.py --json OUT.json

Each case is replayed from a CUDA graph (``triton.testing.do_bench_cudagraph``); bandwidth
counts the K and V bytes every row's context holds, against a device-to-device copy measured
in the same run. The fastest entry per case says what ``decode_attention.tiles_for`` should answer.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

import torch
import triton
import triton.testing
from bench_kernels import (
    HEAD_DIM,
    MAX_MODEL_LEN,
    NUM_KV_HEADS,
    PAGE_SIZE,
    copy_bandwidth,
    paged_batch,
    run_info,
)
from tokenspeed_kernels import kv_layout
from tokenspeed_kernels.decode_attention import (
    NewToken,
    decode_attention,
    num_kv_splits_for,
    tiles_for,
)

CASES = ((1, 1536), (64, 1024), (64, 1536), (512, 1536))
BLOCK_NS, WARPS, STAGES, REGISTERS = (64, 128), (4, 8), (1, 2, 3), (None, 128)


def tile_name(tiles: tuple) -> str:
    """KEYSxWARPSxSTAGES[xREGISTERS], as ``--tiles`` takes it."""
    return "x".join(str(t) for t in tiles if t is not None)


def head_major(cache: torch.Tensor) -> torch.Tensor:
    """The same values with each page's tokens of one head together in memory, seen through
    the kernel's [block, page, head, dim] strides."""
    return cache.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)


def new_token(q: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor) -> NewToken:
    """Each row's new token at position seq_len - 1, in that position's slot: the engine's
    launch, which rotates q and k and stores k and v before attending."""
    batch = q.shape[0]
    last = seq_lens.long() - 1
    slots = block_tables.gather(1, (last // PAGE_SIZE)[:, None])[:, 0].long() * PAGE_SIZE
    k, v = (torch.randn(batch, NUM_KV_HEADS, HEAD_DIM, dtype=q.dtype, device="cuda") for _ in "kv")
    cos_sin = torch.randn(MAX_MODEL_LEN, HEAD_DIM, dtype=torch.float32, device="cuda")
    return NewToken(k, v, last, cos_sin, slots + last % PAGE_SIZE)


def bench_case(
    batch: int,
    context: int,
    fp8: bool,
    num_sms: int,
    only: list[tuple] | None,
    layout: str = "token",
    fused: bool = False,
) -> dict:
    q, k_cache, v_cache, block_tables, seq_lens = paged_batch(batch, context)
    scales = None
    if fp8:  # the engine's FP8 pool: V dim-major (kv_layout)
        k_cache = torch.empty_like(k_cache, dtype=torch.float8_e4m3fn).copy_(k_cache)
        v_cache = kv_layout.dim_major(torch.empty_like(k_cache)).copy_(v_cache)
        ones = torch.ones(NUM_KV_HEADS, dtype=torch.float32, device="cuda")
        scales = (ones, ones)
    if layout == "head":
        k_cache = head_major(k_cache)
        if not fp8:
            v_cache = head_major(v_cache)
    out = torch.empty_like(q)
    counters = torch.zeros(batch * NUM_KV_HEADS, dtype=torch.int32, device="cuda")
    kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * k_cache.element_size()
    chosen = num_kv_splits_for(batch, NUM_KV_HEADS, MAX_MODEL_LEN, num_sms)
    new = new_token(q, block_tables, seq_lens) if fused else None

    def run(tiles: tuple, splits: int) -> float:
        def fn():
            decode_attention(
                q, k_cache, v_cache, block_tables, seq_lens, HEAD_DIM**-0.5, splits, out=out,
                counters=counters, kv_scales=scales, tiles=tiles, new_token=new,
            )  # fmt: skip

        fn()  # compile outside the timing
        return triton.testing.do_bench_cudagraph(fn) * 1e3

    sweep = {}
    default = tiles_for(batch, k_cache.element_size(), chosen)
    for tiles in only or [default, *itertools.product(BLOCK_NS, WARPS, STAGES, REGISTERS)]:
        for splits in sorted({chosen, min(2 * chosen, 32), min(4 * chosen, 32)}):
            sweep[f"{tile_name(tiles)}/{splits}"] = run(tiles, splits)
    default = f"{tile_name(only[0] if only else default)}/{chosen}"
    best = min(sweep, key=sweep.get)
    return {
        "kv": "fp8" if fp8 else "bf16",
        "layout": layout,
        "new_token": fused,
        "batch": batch,
        "context": context,
        "kv_bytes": kv_bytes,
        "default": default,
        "default_us": round(sweep[default], 2),
        "default_tb_per_s": kv_bytes / sweep[default] / 1e6,
        "best": best,
        "best_us": round(sweep[best], 2),
        "best_tb_per_s": kv_bytes / sweep[best] / 1e6,
        "sweep_us": {k: round(v, 2) for k, v in sweep.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the results here (after every case)")
    parser.add_argument("--kv", choices=("bf16", "fp8"), help="only this cache dtype")
    parser.add_argument("--case", help="only BATCH:CONTEXT")
    parser.add_argument("--tiles", help="only these KEYSxWARPSxSTAGES[xREGISTERS], comma-separated")
    parser.add_argument(
        "--layout",
        choices=("token", "head"),
        default="token",
        help="the caches' memory order: the engine's [block, page, head, dim], or each "
        "page's tokens of one head together (the same strided view; an FP8 V cache is "
        "dim-major either way)",
    )
    parser.add_argument(
        "--new-token",
        action="store_true",
        help="the engine's fused launch: each row's new key rotated and stored first",
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_attention_tiles.py needs a CUDA device")
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    copy = copy_bandwidth()
    results = []
    cases = [tuple(map(int, args.case.split(":")))] if args.case else CASES
    tiles = [tuple(map(int, t.split("x"))) for t in args.tiles.split(",")] if args.tiles else None
    kvs = (args.kv == "fp8",) if args.kv else (False, True)
    for fp8, (batch, context) in itertools.product(kvs, cases):
        r = bench_case(batch, context, fp8, num_sms, tiles, args.layout, args.new_token)
        results.append(r)
        print(
            f"{r['kv']:>4} B={batch:<4} ctx={context:<5} default {r['default']:<12} "
            f"{r['default_us']:>8.1f} us {r['default_tb_per_s']:5.2f} TB/s | best {r['best']:<12} "
            f"{r['best_us']:>8.1f} us {r['best_tb_per_s']:5.2f} TB/s",
            flush=True,
        )
        if args.json:
            with open(args.json, "w") as f:
                json.dump({**run_info(copy), "decode": results}, f, indent=1)


if __name__ == "__main__":
    main()
