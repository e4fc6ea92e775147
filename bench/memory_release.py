"""Memory release and resume for RL, measured: how much of the engine's device memory
``release_memory_occupation(weights, kv_cache)`` gives back (``torch.cuda.mem_get_info``),
how long each step of the cycle takes, and whether generation after the resume gives the
same greedy tokens as before the release.

    python bench/memory_release.py --out DIR [--shape llama-8b] [--device cuda]

The engine runs in this process with dummy weights and ``--enable-memory-saver`` (weights
and KV cache in CUDA virtual memory, CUDA graphs captured over them). Steps: generate,
pause(wait), release(weights, kv_cache), resume(weights), resume(kv_cache), continue,
generate. On CPU (``--device cpu --shape tiny``) it runs the same cycle and reports the
process's resident memory instead (a smoke run, not a measurement).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from pathlib import Path

import psutil
import torch

from tokenspeed_aio import AsyncEngine, EngineArgs, SamplingParams
from tokenspeed_aio.bench.output import git_commit
from tokenspeed_aio.bench.shapes import checkpoint_dir, shape_config
from tokenspeed_aio.guards.host_sync import allow_host_sync

GiB = 2**30


def device_free(device: str) -> int:
    """Free device memory (CUDA), or minus the process's resident set (CPU)."""
    if device == "cuda":
        with allow_host_sync():
            torch.cuda.synchronize()
            return torch.cuda.mem_get_info()[0]
    return -psutil.Process().memory_info().rss


async def generate(engine, prompts, params):
    async def one(ids):
        last = None
        async for out in engine.generate(prompt_token_ids=ids, sampling_params=params):
            last = out
        return last.token_ids

    return await asyncio.gather(*(one(p) for p in prompts))


async def run(args) -> dict:
    path = checkpoint_dir(args.shape)
    vocab = shape_config(args.shape)["vocab_size"]
    rng = random.Random(0)
    prompts = [[rng.randrange(1, vocab) for _ in range(n)] for n in (17, 120, 333, 512)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    if args.device == "cuda":
        torch.cuda.init()
        torch.cuda.mem_get_info()  # this process's context exists before the baseline
    before_start = device_free(args.device)
    engine_args = EngineArgs(
        model=str(path),
        load_format="dummy" if args.shape not in ("tiny", "overhead") else "auto",
        device=args.device,
        max_model_len=args.max_model_len,
        enable_memory_saver=args.device == "cuda",
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_num_seqs=64,
    )
    start = time.perf_counter()
    engine = await AsyncEngine.start(engine_args, rank_processes=False)
    steps = {"start": time.perf_counter() - start}
    free = {"before_start": before_start}
    try:
        start = time.perf_counter()
        tokens_before = await generate(engine, prompts, params)
        steps["generate"] = time.perf_counter() - start
        await engine.wait_idle()
        free["started"] = device_free(args.device)
        for name, call in (
            ("pause_wait", engine.pause_generation("wait")),
            ("release_weights_kv", engine.release_memory_occupation(["weights", "kv_cache"])),
        ):
            start = time.perf_counter()
            await call
            steps[name] = time.perf_counter() - start
        free["released"] = device_free(args.device)
        for name, call in (
            ("resume_weights", engine.resume_memory_occupation(["weights"])),
            ("resume_kv_cache", engine.resume_memory_occupation(["kv_cache"])),
            ("continue", engine.continue_generation()),
        ):
            start = time.perf_counter()
            await call
            steps[name] = time.perf_counter() - start
        free["resumed"] = device_free(args.device)
        start = time.perf_counter()
        tokens_after = await generate(engine, prompts, params)
        steps["generate_after"] = time.perf_counter() - start
    finally:
        await engine.shutdown()
    held = free["before_start"] - free["started"]
    freed = free["released"] - free["started"]
    return {
        "shape": args.shape,
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "memory": "torch.cuda.mem_get_info" if args.device == "cuda" else "process RSS",
        "engine_held_bytes": held,
        "freed_bytes": freed,
        "freed_fraction": freed / held if held > 0 else None,
        "back_after_resume_bytes": free["released"] - free["resumed"],
        "free_bytes": free,
        "step_seconds": steps,
        "same_greedy_tokens": tokens_before == tokens_after,
        "tokens_checked": sum(len(t) for t in tokens_before),
        "commit": git_commit(),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="directory for the raw JSON")
    parser.add_argument("--shape", default="llama-8b")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    args = parser.parse_args()
    result = asyncio.run(run(args))
    args.out.mkdir(parents=True, exist_ok=True)
    name = f"memory-release-{args.shape}-{args.device}.json"
    (args.out / name).write_text(json.dumps(result, indent=2))
    print(f"\nmemory release, {result['shape']} on {result['device']} ({result['memory']})")
    print(f"  engine held      {result['engine_held_bytes'] / GiB:8.2f} GiB")
    fraction = result["freed_fraction"]
    shown = f"{100 * fraction:.1f} %" if fraction is not None else "-"
    print(f"  released         {result['freed_bytes'] / GiB:8.2f} GiB  ({shown})")
    print(f"  taken back       {result['back_after_resume_bytes'] / GiB:8.2f} GiB")
    print(f"  same greedy tokens after resume: {result['same_greedy_tokens']}")
    for step, seconds in result["step_seconds"].items():
        print(f"  {step:<20} {seconds * 1000:9.1f} ms")
    print(f"raw: {args.out / name}")
    ok = result["same_greedy_tokens"] and (args.device != "cuda" or (fraction or 0) >= 0.9)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
