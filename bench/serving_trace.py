"""Where a served decode step's time goes: the engine in process (``AsyncEngine``), ``--batch``
requests decoding together on an 8B shape, the torch profiler around a window of steps.

    python bench/serving_trace.py [--shape llama-8b] [--batch 1] [--steps 60] [--out PATH]

Unlike ``decode_profile.py`` (the decode graph replayed alone) this sees the whole forward as
serving runs it: the inputs' copies, the graph, the sampler, the result copies, and the time
the GPU waits for the host. Reports per step: the wall time between tokens, the GPU's busy
time (the union of its kernels and copies), the idle gaps and what ran right after each, and
the work outside the decode graph by kernel. GPU-only.

"Outside the graph" is told apart by launch count: kernels launched at least twice per step
are the layers' (inside the graph); the rest are listed, so the graph's own once-per-step
kernels (the embedding gather, the final norm) appear there too, next to the sampler and
the copies.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

from tokenspeed_aio.api.engine import AsyncEngine
from tokenspeed_aio.args import EngineArgs
from tokenspeed_aio.bench.output import OUT_HELP, default_out_path
from tokenspeed_aio.bench.shapes import checkpoint_dir
from tokenspeed_aio.sampling_params import SamplingParams

GAP_US = 1.0  # idle stretches shorter than this are the hardware's own kernel turnaround


def device_intervals(prof) -> list[tuple[float, float, str]]:
    """(start µs, end µs, name) of every kernel and copy the profiler saw, in start order."""
    spans = [
        (e.time_range.start, e.time_range.end, e.name)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
    ]
    return sorted(spans)


def summarize(spans: list[tuple[float, float, str]], steps: int, graph_kernels: set[str]) -> dict:
    busy, gaps = 0.0, []
    cursor = spans[0][0]
    for start, end, name in spans:
        if start > cursor + GAP_US:
            gaps.append((start - cursor, name))
        busy += max(0.0, end - max(start, cursor))
        cursor = max(cursor, end)
    window = cursor - spans[0][0]
    after_gap: dict[str, list[float]] = defaultdict(list)
    for us, name in gaps:
        after_gap[name[:80]].append(us)
    outside: dict[str, list[float]] = defaultdict(list)
    for start, end, name in spans:
        if name not in graph_kernels:
            outside[name[:80]].append(end - start)
    return {
        "steps": steps,
        "window_ms": window / 1e3,
        "gpu_busy_ms_per_step": busy / steps / 1e3,
        "gpu_idle_ms_per_step": (window - busy) / steps / 1e3,
        "gaps_per_step": len(gaps) / steps,
        "idle_before_kernel_us_per_step": {
            k: round(sum(v) / steps, 2)
            for k, v in sorted(after_gap.items(), key=lambda kv: -sum(kv[1]))[:15]
        },
        "outside_graph_us_per_step": {
            k: {"calls": round(len(v) / steps, 2), "us": round(sum(v) / steps, 2)}
            for k, v in sorted(outside.items(), key=lambda kv: -sum(kv[1]))[:25]
        },
    }


async def trace(ns) -> dict:
    args = EngineArgs(
        model=str(checkpoint_dir(ns.shape, Path(tempfile.mkdtemp()))),
        load_format="dummy",
        dtype="bfloat16",
        max_model_len=4096,
        max_num_seqs=max(ns.batch, 8),
        gpu_memory_utilization=0.85,
        attention_backend=ns.attention_backend,
    )
    rng = np.random.default_rng(0)
    total = ns.warmup + ns.steps + 20
    params = SamplingParams(max_tokens=total, temperature=0.0, ignore_eos=True)
    stamps: list[float] = []
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])

    async def one(i: int) -> None:
        ids = rng.integers(1, 1000, size=ns.input_len).tolist()
        n = 0
        async for _ in engine.generate(prompt_token_ids=ids, sampling_params=params):
            n += 1
            if i:
                continue
            if n == ns.warmup:
                prof.start()
            if ns.warmup <= n < ns.warmup + ns.steps + 1:
                stamps.append(time.perf_counter())
            if n == ns.warmup + ns.steps:
                torch.cuda.synchronize()
                prof.stop()

    async with await AsyncEngine.start(args) as engine:
        await asyncio.gather(*(one(i) for i in range(ns.batch)))
    # The decode graph's per-layer kernels (module doc: once-per-step ones are listed too).
    spans = device_intervals(prof)
    counts: dict[str, int] = defaultdict(int)
    for _, _, name in spans:
        counts[name] += 1
    graph_kernels = {name for name, c in counts.items() if c >= 2 * ns.steps}
    result = summarize(spans, ns.steps, graph_kernels)
    result["wall_ms_per_step"] = float(np.mean(np.diff(stamps)) * 1e3)
    result["batch"] = ns.batch
    result["shape"] = ns.shape
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama-8b")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--warmup", type=int, default=40)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--attention-backend", default="triton")
    parser.add_argument("--out", type=Path, help=OUT_HELP)
    ns = parser.parse_args()
    result = asyncio.run(trace(ns))
    print(json.dumps(result, indent=1))
    out = ns.out or default_out_path("serving-trace")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
