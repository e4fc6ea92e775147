"""Whether the decode attention overlaps the FP8 products on two streams: Llama-3.1-8B's
decode step at many rows, FP8 weights and an e4m3 cache, as a CUDA graph.

    python kernels/bench_overlap.py --rows 512 --context 1536 --json OUT.json

A layer is the decode attention over every row's context and the four products of its rows
(qkv, o_proj, gate_up, down: ``torch._scaled_mm`` with row-wise scales); the graph holds
``--layers`` of them. Three schedules of the same work:

- ``serial``: each layer's attention, then its products, all rows at once, one stream;
- ``halves``: the rows in two halves, each half's attention then products, one stream;
- ``overlapped``: the same halves on two streams, each layer in two phases: the first half's
  attention beside the second half's products, then the second half's attention beside the
  first half's products (the dependencies of a two-batch pipeline).

``overlapped`` below ``halves`` is what two batches in flight would save; below ``serial``,
what they would save net of the smaller products.
"""

from __future__ import annotations

import argparse
import json

import torch
from bench_kernels import (
    HEAD_DIM,
    NUM_KV_HEADS,
    copy_bandwidth,
    emit_report,
    paged_batch,
    replayed_ms,
)
from tokenspeed_kernels import kv_layout
from tokenspeed_kernels.decode_attention import decode_attention, num_kv_splits_for
from tokenspeed_kernels.fp8 import FP8

# Llama-3.1-8B's products per layer: (N, K)
PRODUCTS = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096),
            "down": (4096, 14336)}  # fmt: skip


class Rows:
    """One group of rows' operands: its attention's query, tables and output, and its
    products' activations, all allocated once (a graph replays them)."""

    def __init__(self, q, block_tables, seq_lens, num_sms: int, max_len: int):
        self.q, self.block_tables, self.seq_lens = q, block_tables, seq_lens
        rows = q.shape[0]
        self.splits = num_kv_splits_for(rows, NUM_KV_HEADS, max_len, num_sms)
        self.out = torch.empty_like(q)
        self.counters = torch.zeros(rows * NUM_KV_HEADS, dtype=torch.int32, device="cuda")
        self.x = {k: torch.randn(rows, k, device="cuda").to(FP8) for k in {4096, 14336}}
        self.sx = torch.ones(rows, 1, dtype=torch.float32, device="cuda")


def attention(rows: Rows, k_cache, v_cache, scales) -> None:
    decode_attention(
        rows.q, k_cache, v_cache, rows.block_tables, rows.seq_lens, HEAD_DIM**-0.5, rows.splits,
        out=rows.out, counters=rows.counters, kv_scales=scales,
    )  # fmt: skip


def products(rows: Rows, weights) -> None:
    for (_, k), (w, sw) in zip(PRODUCTS.values(), weights, strict=True):
        torch._scaled_mm(rows.x[k], w.t(), scale_a=rows.sx, scale_b=sw, out_dtype=torch.bfloat16)


def graph_ms(record, replays: int) -> float:
    """Mean ms per replay of the graph that ``record()`` captures (on the capturing stream,
    which it may fork from and join back to)."""
    record()  # compile and warm outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        record()
    return replayed_ms(graph, replays)


def bench_rows(total: int, context: int, layers: int, replays: int, weights, side) -> dict:
    """Every schedule of the module doc, and each part alone, for ``total`` rows."""
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    q, k_cache, v_cache, block_tables, seq_lens = paged_batch(total, context)
    k_cache = torch.empty_like(k_cache, dtype=FP8).copy_(k_cache)
    v_cache = kv_layout.dim_major(torch.empty_like(k_cache)).copy_(v_cache)
    ones = torch.ones(NUM_KV_HEADS, dtype=torch.float32, device="cuda")
    scales = (ones, ones)
    every = Rows(q, block_tables, seq_lens, num_sms, context)
    a, b = (
        Rows(q[s], block_tables[s], seq_lens[s], num_sms, context)
        for s in (slice(0, total // 2), slice(total // 2, total))
    )

    def attend(rows: Rows) -> None:
        attention(rows, k_cache, v_cache, scales)

    def overlapped() -> None:
        main_stream = torch.cuda.current_stream()
        for attended, multiplied in ((a, b), (b, a)):
            side.wait_stream(main_stream)
            with torch.cuda.stream(side):
                products(multiplied, weights)
            attend(attended)
            main_stream.wait_stream(side)

    schedules = {
        "attention": lambda: attend(every),
        "products": lambda: products(every, weights),
        "attention_half": lambda: attend(a),
        "products_half": lambda: products(a, weights),
        "serial": lambda: (attend(every), products(every, weights)),
        "halves": lambda: [(attend(rows), products(rows, weights)) for rows in (a, b)],
        "overlapped": overlapped,
    }
    row = {"rows": total, "context": context, "layers": layers}
    for name, layer in schedules.items():
        ms = graph_ms(lambda layer=layer: [layer() for _ in range(layers)], replays)
        row[f"{name}_ms_per_layer"] = ms / layers
    row["overlapped_vs_serial"] = row["overlapped_ms_per_layer"] / row["serial_ms_per_layer"]
    row["overlapped_vs_halves"] = row["overlapped_ms_per_layer"] / row["halves_ms_per_layer"]
    kv_bytes = 2 * total * context * NUM_KV_HEADS * q.shape[2]  # e4m3 K and V
    row["attention_tb_per_s"] = kv_bytes / (row["attention_ms_per_layer"] * 1e9)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[512])
    parser.add_argument("--context", type=int, default=1536)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    copy = copy_bandwidth()
    weights = [
        (torch.randn(n, k, device="cuda").to(FP8), torch.ones(1, n, device="cuda"))
        for n, k in PRODUCTS.values()
    ]
    side = torch.cuda.Stream()
    results = []
    for total in args.rows:
        results.append(bench_rows(total, args.context, args.layers, args.replays, weights, side))
        print(json.dumps(results[-1]), flush=True)
        torch.cuda.empty_cache()
    emit_report(copy, "rows", results, args.json)


if __name__ == "__main__":
    main()
