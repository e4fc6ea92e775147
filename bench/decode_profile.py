"""Where a decode step's GPU time goes: the captured CUDA graph of one batch size, replayed
alone, timed with CUDA events and broken down by kernel with the torch profiler.

    python bench/decode_profile.py [--shape llama-8b] [--batch 1,64,256] [--context 1024]
                                   [--out PATH]

Builds the engine's device side exactly as a rank does (dummy weights, ``--attention-backend``,
the capture sizes given), fills every row's KV blocks to ``--context`` tokens, and replays
the decode graph of each batch size. Reports per batch: the step's GPU time, its roofline
(weights + KV bytes over the copy bandwidth measured in the same run), and the kernel
categories that fill the step. GPU-only.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np
import torch

from tokenspeed_aio.args import EngineArgs
from tokenspeed_aio.bench.kernel_profile import kernel_breakdown, time_step, write_profile
from tokenspeed_aio.bench.output import OUT_HELP, default_out_path
from tokenspeed_aio.bench.roofline import ModelBytes, measure_bandwidth, measure_matmul_peak
from tokenspeed_aio.bench.shapes import checkpoint_dir
from tokenspeed_aio.data_plane.cuda_graph import DecodeRows
from tokenspeed_aio.data_plane.device import build_device_side
from tokenspeed_aio.data_plane.specs import RankInfo
from tokenspeed_aio.model.config import ModelConfig


def decode_inputs(bs: int, context: int, page: int, width: int) -> DecodeRows:
    """Row i owns blocks [1 + i * per_row, ...): its context fills them; it writes at
    position ``context``."""
    per_row = -(-(context + 1) // page)
    tables = np.zeros((bs, width), np.int32)
    for i in range(bs):
        tables[i, :per_row] = 1 + i * per_row + np.arange(per_row)
    positions = np.full(bs, context, np.int64)
    blocks = tables[np.arange(bs), context // page].astype(np.int64)
    return DecodeRows(
        positions=positions,
        slot_mapping=blocks * page + context % page,
        slots=np.arange(bs, dtype=np.int64),
        seq_lens=np.full(bs, context + 1, np.int32),
        block_tables=tables,
    )


def profile_batch(runner, bs: int, context: int, page: int, replays: int) -> dict:
    graphs = runner.graphs
    width = -(-(context + 1) // page)
    rows = decode_inputs(bs, context, page, width)

    @torch.inference_mode()  # as the runner serves: the graphs' buffers are inference tensors
    def step():
        return graphs.replay(bs, rows)

    return {
        "batch": bs,
        "context": context,
        "step_ms": time_step(step, replays),
        **kernel_breakdown(step),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama-8b")
    parser.add_argument("--batch", default="1,64,256")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--replays", type=int, default=50)
    parser.add_argument(
        "--max-model-len", type=int, default=8192, help="sets the decode split count, as serving"
    )
    parser.add_argument("--attention-backend", default="triton")
    parser.add_argument("--kv-cache-dtype", default="auto", help="auto or fp8")
    parser.add_argument("--quantization", help="fp8: quantize the shape's weights at load")
    parser.add_argument("--out", type=Path, help=OUT_HELP)
    ns = parser.parse_args()
    sizes = [int(b) for b in ns.batch.split(",")]
    bandwidth = measure_bandwidth("cuda")
    matmul = measure_matmul_peak("cuda")
    torch.cuda.empty_cache()
    model_dir = checkpoint_dir(ns.shape, Path(tempfile.mkdtemp()))
    args = EngineArgs(
        model=str(model_dir),
        load_format="dummy",
        dtype="bfloat16",
        device="cuda",
        max_model_len=ns.max_model_len,
        num_kv_blocks=max(sizes) * -(-(ns.context + 1) // EngineArgs.page_size) + 1,
        max_num_seqs=max(sizes),
        cudagraph_capture_sizes=sizes,
        gpu_memory_utilization=0.85,
        attention_backend=ns.attention_backend,
        kv_cache_dtype=ns.kv_cache_dtype,
        quantization=ns.quantization,
    )
    build = build_device_side(args, RankInfo())
    runner = build.handle._runner  # a profiling script reaches past the handle on purpose
    config = ModelConfig.from_pretrained(model_dir)
    model_bytes = ModelBytes.of(
        config,
        "bfloat16",
        fp8_weights=config.quantization is not None or ns.quantization is not None,
        fp8_kv=ns.kv_cache_dtype != "auto",
    )
    results = []
    for bs in sizes:
        r = profile_batch(runner, bs, ns.context, args.page_size, ns.replays)
        floor_bytes = model_bytes.step_bytes([ns.context + 1] * bs)
        r["roofline_ms"] = floor_bytes / bandwidth["bytes_per_s"] * 1e3
        r["step_over_roofline"] = r["step_ms"] / r["roofline_ms"]
        results.append(r)
        print(json.dumps(r, indent=1))
    out = ns.out or default_out_path("decode-profile")
    write_profile(out, ns.shape, results, bandwidth=bandwidth, matmul=matmul)


if __name__ == "__main__":
    main()
