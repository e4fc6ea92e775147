"""A GPU step's time by kernel, from the torch profiler: what ``bench/decode_profile.py`` and
``bench/prefill_profile.py`` report. GPU-only (the callers check)."""

from __future__ import annotations

import json
import platform
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch

from tokenspeed_aio.bench.output import git_commit

# Substrings of kernel names -> the category a step's time is reported under (first match).
CATEGORIES = (
    ("attention", ("_decode_split", "decode", "_extend_kernel", "flash")),
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


def time_step(step: Callable[[], object], repeats: int, warmup: int = 5) -> float:
    """Mean GPU time of ``step`` in ms over ``repeats`` back-to-back calls (CUDA events)."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        step()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / repeats


def kernel_breakdown(step: Callable[[], object], steps: int = 5, top: int = 20) -> dict:
    """Profile ``steps`` calls of ``step``; per step: kernel count, each kernel's summed time
    and its marginal time (from the previous kernel's end to its own: a kernel that starts
    early and waits, as under programmatic dependent launch, has a duration that overstates
    what it adds; a step's first kernel also carries the host gap between steps)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    by_kernel: dict[str, float] = defaultdict(float)
    marginal: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    prev_end = None
    for evt in sorted(kernels, key=lambda e: e.time_range.end):
        by_kernel[evt.name] += evt.device_time / steps / 1e3  # ms per step
        counts[evt.name] += 1
        if prev_end is not None:
            marginal[evt.name] += (evt.time_range.end - prev_end) / steps / 1e3
        prev_end = evt.time_range.end
    by_category: dict[str, float] = defaultdict(float)
    for name, ms in by_kernel.items():
        by_category[category(name)] += ms

    def listed(times: dict[str, float]) -> list[dict]:
        ranked = sorted(times.items(), key=lambda kv: -kv[1])[:top]
        return [{"name": n[:120], "ms": ms, "calls": counts[n] // steps} for n, ms in ranked]

    return {
        "kernels_per_step": sum(counts.values()) // steps,
        "kernel_ms_per_step": sum(by_kernel.values()),
        "by_category_ms": dict(sorted(by_category.items(), key=lambda kv: -kv[1])),
        "top_kernels_ms": listed(by_kernel),
        "top_marginal_ms": listed(marginal),
    }


def write_profile(path: Path, shape: str, results: list[dict], **measured: dict) -> None:
    """A profile script's raw JSON: the shape, the machine, the commit, what the script
    ``measured`` beside its steps (bandwidth, matmul rate) and the per-step ``results``."""
    commit = git_commit()
    doc = {
        "shape": shape,
        "machine": {"gpu": torch.cuda.get_device_name(), "host": platform.node()},
        "torch": torch.__version__,
        "commit": commit,
        **measured,
        "results": results,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1))
    print(f"raw JSON: {path}")
