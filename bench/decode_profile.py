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
import platform
import subprocess
import tempfile
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

from tokenspeed_aio.args import EngineArgs
from tokenspeed_aio.bench.roofline import ModelBytes, measure_bandwidth, measure_matmul_peak
from tokenspeed_aio.bench.shapes import checkpoint_dir
from tokenspeed_aio.data_plane.device import build_device_side
from tokenspeed_aio.data_plane.specs import RankInfo
from tokenspeed_aio.model.config import ModelConfig
from tokenspeed_aio.model.cuda_graph import DecodeRows

# Substrings of kernel names -> the category a step's time is reported under.
CATEGORIES = (
    ("attention", ("_decode_split", "decode")),
    ("kv_write", ("kv_write",)),
    ("rmsnorm", ("rms_norm",)),
    ("rotary", ("rotary",)),
    ("silu_and_mul", ("silu_and_mul",)),
    ("gemm", ("gemm", "gemv", "nvjet", "sm90", "cutlass", "cublas", "splitK")),
)


def category(kernel: str) -> str:
    for name, needles in CATEGORIES:
        if any(n in kernel for n in needles):
            return name
    return "other"


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

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        step()
    end.record()
    end.synchronize()
    step_ms = start.elapsed_time(end) / replays

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    by_kernel: dict[str, float] = defaultdict(float)
    marginal: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    prev_end = None
    for evt in sorted(kernels, key=lambda e: e.time_range.end):
        by_kernel[evt.name] += evt.device_time / 5 / 1e3  # ms per step
        counts[evt.name] += 1
        # What the kernel adds to the step: the time from the previous kernel's end to its
        # own (a kernel that starts early and waits, as under programmatic dependent launch,
        # has a duration that overstates it). A replay's first kernel also carries the host
        # gap between this loop's replays.
        if prev_end is not None:
            marginal[evt.name] += (evt.time_range.end - prev_end) / 5 / 1e3
        prev_end = evt.time_range.end
    by_category: dict[str, float] = defaultdict(float)
    for name, ms in by_kernel.items():
        by_category[category(name)] += ms
    top = sorted(by_kernel.items(), key=lambda kv: -kv[1])[:20]
    top_marginal = sorted(marginal.items(), key=lambda kv: -kv[1])[:20]
    return {
        "batch": bs,
        "context": context,
        "step_ms": step_ms,
        "kernels_per_step": sum(counts.values()) // 5,
        "kernel_ms_per_step": sum(by_kernel.values()),
        "by_category_ms": dict(sorted(by_category.items(), key=lambda kv: -kv[1])),
        "top_kernels_ms": [{"name": n[:120], "ms": ms, "calls": counts[n] // 5} for n, ms in top],
        "top_marginal_ms": [
            {"name": n[:120], "ms": ms, "calls": counts[n] // 5} for n, ms in top_marginal
        ],
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
    parser.add_argument("--out", type=Path, default=Path("bench/results/decode-profile.json"))
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
    )
    build = build_device_side(args, RankInfo())
    runner = build.handle._runner  # a profiling script reaches past the handle on purpose
    config = ModelConfig.from_pretrained(model_dir)
    model_bytes = ModelBytes.of(config, "bfloat16")
    results = []
    for bs in sizes:
        r = profile_batch(runner, bs, ns.context, args.page_size, ns.replays)
        floor_bytes = model_bytes.step_bytes([ns.context + 1] * bs)
        r["roofline_ms"] = floor_bytes / bandwidth["bytes_per_s"] * 1e3
        r["step_over_roofline"] = r["step_ms"] / r["roofline_ms"]
        results.append(r)
        print(json.dumps(r, indent=1))
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    doc = {
        "shape": ns.shape,
        "machine": {"gpu": torch.cuda.get_device_name(), "host": platform.node()},
        "torch": torch.__version__,
        "commit": commit,
        "bandwidth": bandwidth,
        "matmul": matmul,
        "results": results,
    }
    ns.out.parent.mkdir(parents=True, exist_ok=True)
    ns.out.write_text(json.dumps(doc, indent=1))
    print(f"raw JSON: {ns.out}")


if __name__ == "__main__":
    main()
