"""Decode-attention bandwidth on a GPU: Llama-3-8B shapes, batch 1/64/256, context 1k/4k.

    python kernels/bench_kernels.py [--json OUT.json]

For each case it times ``decode_attention`` replayed from a CUDA graph, as the engine runs
decode (``triton.testing.do_bench_cudagraph``), with the split count the backend would use and
with every power-of-two split count to show what the heuristic leaves on the table; ``eager``
is ``triton.testing.do_bench`` on plain launches, bound by the host's launch cost at small
sizes. Bandwidth counts the bytes the kernel must read (K and V of
every row's context, q, block tables) and write (out); a device-to-device copy measured in the
same run gives the roofline. Every row has the full context; blocks are shuffled.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import triton
import triton.testing
from tokenspeed_kernels.decode_attention import decode_attention, num_kv_splits_for
from tokenspeed_kernels.extend_attention import extend_attention

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, PAGE_SIZE = 32, 8, 128, 16
DTYPE = torch.bfloat16
BATCHES = (1, 64, 256)
CONTEXTS = (1024, 4096)
MAX_MODEL_LEN = 8192


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second."""
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src))
    return 2 * src.numel() / (ms * 1e-3)


def run_info(copy: float) -> dict:
    """What every kernel benchmark's JSON starts with: the device, the copy bandwidth
    measured in the same run, the software."""
    return {
        "device": torch.cuda.get_device_name(),
        "copy_tb_per_s": copy / 1e12,
        "torch": torch.__version__,
        "triton": triton.__version__,
    }


def replayed_ms(graph: torch.cuda.CUDAGraph, replays: int) -> float:
    """Mean ms per replay of a captured graph, after three warm replays (CUDA events)."""
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / replays


def emit_report(copy: float, key: str, results: list[dict], path: str | None) -> None:
    """A benchmark's JSON (``run_info`` and its ``results`` under ``key``) to stdout and, if
    given, to ``path``."""
    report = {**run_info(copy), key: results}
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=1)
    json.dump(report, sys.stdout, indent=1)


def paged_batch(batch: int, context: int):
    blocks_per_row = triton.cdiv(context, PAGE_SIZE)
    num_blocks = 1 + batch * blocks_per_row
    shape = (num_blocks, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, dtype=DTYPE, device="cuda")
    v_cache = torch.randn(shape, dtype=DTYPE, device="cuda")
    ids = torch.randperm(num_blocks - 1, device="cuda", dtype=torch.int32) + 1
    block_tables = ids.view(batch, blocks_per_row)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, NUM_Q_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
    return q, k_cache, v_cache, block_tables, seq_lens


def bench_decode(batch: int, context: int, num_sms: int) -> dict:
    q, k_cache, v_cache, block_tables, seq_lens = paged_batch(batch, context)
    out = torch.empty_like(q)
    counters = torch.zeros(batch * NUM_KV_HEADS, dtype=torch.int32, device="cuda")  # kept zero
    itemsize = q.element_size()
    kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * itemsize
    bytes_moved = kv_bytes + 2 * q.numel() * itemsize + block_tables.numel() * 4

    def fn(splits: int):
        return lambda: decode_attention(
            q, k_cache, v_cache, block_tables, seq_lens, HEAD_DIM**-0.5, splits, out=out,
            counters=counters,
        )  # fmt: skip

    def run(splits: int) -> float:
        fn(splits)()  # compile outside the timing
        return triton.testing.do_bench_cudagraph(fn(splits))

    chosen = num_kv_splits_for(batch, NUM_KV_HEADS, MAX_MODEL_LEN, num_sms)
    sweep = {s: run(s) for s in (1, 2, 4, 8, 16, 32)}
    ms = run(chosen)
    best = min(sweep, key=sweep.get)
    return {
        "batch": batch,
        "context": context,
        "splits": chosen,
        "us": ms * 1e3,
        "eager_us": triton.testing.do_bench(fn(chosen)) * 1e3,
        "bytes": bytes_moved,
        "tb_per_s": bytes_moved / (ms * 1e-3) / 1e12,
        "best_splits": best,
        "best_us": sweep[best] * 1e3,
        "sweep_us": {s: round(t * 1e3, 2) for s, t in sweep.items()},
    }


def bench_prefill(context: int) -> dict:
    """One fresh prompt of ``context`` tokens (causal), for a TFLOP/s figure."""
    q, k_cache, v_cache, block_tables, seq_lens = paged_batch(1, context)
    q = torch.randn(context, NUM_Q_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
    query_start_loc = torch.tensor([0, context], dtype=torch.int32, device="cuda")
    fn = lambda: extend_attention(  # noqa: E731
        q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, context, HEAD_DIM**-0.5
    )
    fn()
    ms = triton.testing.do_bench(fn)
    flops = 2 * 2 * NUM_Q_HEADS * HEAD_DIM * context * context / 2  # QK^T and PV, causal half
    return {"prefill_tokens": context, "us": ms * 1e3, "tflops": flops / (ms * 1e-3) / 1e12}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_kernels.py needs a CUDA device")
    props = torch.cuda.get_device_properties(0)
    copy = copy_bandwidth()
    print(f"{props.name}: {props.multi_processor_count} SMs, D2D copy {copy / 1e12:.2f} TB/s")
    print(f"decode attention, Hq={NUM_Q_HEADS} Hkv={NUM_KV_HEADS} D={HEAD_DIM} bf16 page 16")
    print(
        f"{'B':>4} {'ctx':>5} {'splits':>6} {'us':>8} {'TB/s':>6} {'of copy':>7} {'eager':>7}  best"
    )
    decode = []
    for batch in BATCHES:
        for context in CONTEXTS:
            r = bench_decode(batch, context, props.multi_processor_count)
            decode.append(r)
            print(
                f"{batch:>4} {context:>5} {r['splits']:>6} {r['us']:>8.1f} {r['tb_per_s']:>6.2f}"
                f" {r['tb_per_s'] * 1e12 / copy:>7.0%} {r['eager_us']:>7.1f}  {r['best_us']:.1f} us"
                f" at {r['best_splits']} splits"
            )
            torch.cuda.empty_cache()
    prefill = [bench_prefill(n) for n in (1024, 4096)]
    for r in prefill:
        print(f"extend attention, {r['prefill_tokens']} new tokens: {r['us']:.0f} us, "
              f"{r['tflops']:.0f} TFLOP/s")  # fmt: skip
    if args.json:
        result = {
            **run_info(copy),
            "decode": decode,
            "prefill": prefill,
        }
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
