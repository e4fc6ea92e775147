"""What a retraction costs a victim of ``--tokens`` tokens: stored and restored through the
host tiers (its image: a stream-ordered L2 write-back of its full pages and a snapshot of
its tail page and slot state, then a restore into a new slot), against recomputing it (a
prefill forward of all its tokens, as a recompute retraction re-admits it).

    python bench/retraction_restore.py [--shape llama-8b] [--tokens 4096] [--repeats 5]
                                       [--out PATH]

Builds the engine's device side as a rank does (dummy weights; the L2 host pool in pinned
memory on CUDA), enters serving (the no-host-sync and no-JIT checks armed, as
TOKENSPEED_DATA_PLANE_SYNC_DEBUG / TOKENSPEED_JIT_COMPILE_CHECK say), and times each path
from submission until the device finished (wall clock, medians over the repeats): the
resume cost a restore adds is its H2D leg; the store runs when the victim is retracted.
Runs on CPU too (the tiny shape) to check the script.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from tokenspeed_aio.args import EngineArgs
from tokenspeed_aio.bench.output import OUT_HELP, default_out_path
from tokenspeed_aio.bench.shapes import checkpoint_dir
from tokenspeed_aio.cache.ops import cache_ops_from_plan
from tokenspeed_aio.data_plane.device import build_device_side
from tokenspeed_aio.data_plane.specs import RankInfo
from tokenspeed_aio.guards.host_sync import allow_host_sync
from tokenspeed_aio.sampling_params import SamplingParams
from tokenspeed_aio.scheduler.cache_ops import CachePlan, RestoreOp, SnapshotOp, WriteBackOp
from tokenspeed_aio.scheduler.plan import ExecutionPlan, NewSlotOwner, ScheduledRow


def _wait(handle, device: torch.device, op_ids: set[int]) -> None:
    """Until the device finished (and, for cache ops, the ACKs arrived)."""
    with allow_host_sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    while op_ids:
        op_ids -= set(handle.poll_cache_results().acks)
        time.sleep(0.0002)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="llama-8b")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--out", type=Path, help=OUT_HELP)
    ns = parser.parse_args()
    cuda = torch.cuda.is_available()
    path = checkpoint_dir(ns.shape, Path(tempfile.gettempdir()) / "tokenspeed_aio-bench")
    page = ns.page_size
    pages = -(-(ns.tokens + 1) // page)  # the victim's pages, its tail one included
    args = EngineArgs(
        model=str(path),
        load_format="dummy",
        device="cuda" if cuda else "cpu",
        page_size=page,
        max_model_len=ns.tokens + 2 * page,
        max_num_seqs=4,
        num_kv_blocks=2 * pages + 2,
        kvstore_ratio=1.5,
        chunked_prefill_size=ns.tokens + page,
        enforce_eager=True,
    )
    build = build_device_side(args, RankInfo())
    handle, specs = build.handle, build.specs
    device = torch.device(specs.device)
    full = pages - 1  # hash-complete pages; the last one is the tail
    victim = list(range(1, pages + 1))  # device blocks it holds
    fresh = list(range(pages + 1, 2 * pages + 1))  # the new owner's, when restored
    rng = np.random.default_rng(0)
    prompt = rng.integers(5, specs.vocab_size, ns.tokens + 1).tolist()
    owner = NewSlotOwner(SamplingParams(max_tokens=1, temperature=0.0), 0, prompt, [])
    op = iter(range(1, 1_000_000))
    store_ms, restore_ms, recompute_ms = [], [], []
    for i in range(ns.repeats + 1):  # the first round warms the paths up, untimed
        if i == 1:  # it compiled every kernel these shapes use: serving (the checks) begins
            handle.enter_serving()
        # Recompute: the victim's tokens through a prefill forward, into its blocks.
        row = ScheduledRow(
            "victim", 0, 0, ns.tokens, prompt[: ns.tokens], tuple(victim), 0, True, 0, owner
        )
        start = time.perf_counter()
        handle.execute(ExecutionPlan(plan_id=2 * i, rows=[row]))
        _wait(handle, device, set())
        recompute_ms.append(1e3 * (time.perf_counter() - start))
        # Retraction image: its full pages to L2, its tail page and slot state to the
        # snapshot pool (the victim's slot 0), in one plan's stream-ordered stores.
        wb, sn, rs = next(op), next(op), next(op)
        plan = ExecutionPlan(
            plan_id=2 * i + 1,
            cache=CachePlan(
                write_backs=[
                    WriteBackOp(wb, tuple(victim[:full]), tuple(range(full)), True, "retraction")
                ],
                snapshots=[SnapshotOp(sn, "victim", 0, tuple(victim[full:]), (0,), 0)],
            ),
        )
        start = time.perf_counter()
        handle.execute(plan, cache_ops_from_plan(plan))
        _wait(handle, device, {wb, sn})
        store_ms.append(1e3 * (time.perf_counter() - start))
        # Restore into slot 1 and fresh blocks.
        plan = ExecutionPlan(
            plan_id=2 * i + 1,
            cache=CachePlan(
                restores=[RestoreOp(rs, "victim", 1, tuple(range(full)), (0,), tuple(fresh), 0)]
            ),
        )
        start = time.perf_counter()
        handle.execute(plan, cache_ops_from_plan(plan))
        _wait(handle, device, {rs})
        restore_ms.append(1e3 * (time.perf_counter() - start))
    handle.shutdown()
    block_bytes = specs.kv_bytes_per_block
    med = {
        "recompute_ms": statistics.median(recompute_ms[1:]),
        "store_ms": statistics.median(store_ms[1:]),
        "restore_ms": statistics.median(restore_ms[1:]),
    }
    doc = {
        "shape": ns.shape,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "tokens": ns.tokens,
        "pages": pages,
        "bytes_each_way": pages * block_bytes,
        "raw_ms": {"recompute": recompute_ms, "store": store_ms, "restore": restore_ms},
        "median": med,
        "restore_over_recompute": med["restore_ms"] / med["recompute_ms"],
        "store_plus_restore_over_recompute": (med["store_ms"] + med["restore_ms"])
        / med["recompute_ms"],
        "restore_gb_per_s": pages * block_bytes / med["restore_ms"] / 1e6,
    }
    print(f"| {ns.shape}, {ns.tokens}-token victim | ms (median of {ns.repeats}) |")
    print("| --- | --- |")
    print(f"| recompute (prefill forward) | {med['recompute_ms']:.2f} |")
    print(f"| image store (write-back + snapshot) | {med['store_ms']:.2f} |")
    print(f"| restore (H2D + slot state) | {med['restore_ms']:.2f} |")
    print(f"restore / recompute = {doc['restore_over_recompute']:.3f}; "
          f"store + restore / recompute = {doc['store_plus_restore_over_recompute']:.3f}; "
          f"restore at {doc['restore_gb_per_s']:.1f} GB/s")  # fmt: skip
    out = ns.out or default_out_path("retraction-restore")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"raw JSON: {out}")


if __name__ == "__main__":
    main()
