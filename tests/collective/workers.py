"""Rank programs for the multi-process tests; importable by spawned processes."""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any

from tokenspeed_aio.collective import Mesh, PeerLostError, Ranks, Rendezvous

from .harness import HOST


async def scheduling_round(mesh: Mesh, in_step: Any) -> Any:
    """A round's collectives on a tp=2, dp=2 layout: relay, DP agreement, column reduce."""
    ranks = Ranks.build(mesh.rank, mesh.world_size, tp=2, dp=2)
    replica = mesh.group(ranks.replica)
    messages = await replica.broadcast([f"req-{mesh.rank}"], root=ranks.replica_leader)
    batch_sizes = await mesh.group(ranks.world).all_gather(ranks.dp_rank + 1)
    column_sum = await mesh.group(ranks.dp_column).all_reduce(mesh.rank, "sum")
    await mesh.world.agree(None)
    return messages, batch_sizes, column_sum


async def wait_for_lost_peer(mesh: Mesh, in_step: Any) -> Any:
    """One round in step, then a call that only a lost peer can end (no timeout helps)."""
    await mesh.world.all_gather("in step")
    if mesh.rank == 1:
        # An event, not the results queue: a process killed mid-put can wedge a queue.
        in_step.set()
        await asyncio.sleep(3600)  # the test kills this process here
    started = time.monotonic()
    try:
        await mesh.world.all_gather("waiting", timeout=math.inf)
    except PeerLostError as err:
        return err.peer, str(err), time.monotonic() - started
    return None


PROGRAMS = {"scheduling_round": scheduling_round, "wait_for_lost_peer": wait_for_lost_peer}


async def run_rank(rank: int, world: int, port: int, program: str, in_step: Any) -> Any:
    async with await Mesh.connect(rank, world, Rendezvous(HOST, port), timeout=20) as mesh:
        return await PROGRAMS[program](mesh, in_step)


def rank_process(
    rank: int, world: int, port: int, program: str, in_step: Any, results: Any
) -> None:
    """A spawned rank: run ``program`` and report (rank, result) on the ``results`` queue."""
    results.put((rank, asyncio.run(run_rank(rank, world, port, program, in_step))))
