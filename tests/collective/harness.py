"""Helpers for the mesh tests: free loopback ports and ranks run as tasks of one process."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from tokenspeed_aio.bench.ports import HOST, free_port
from tokenspeed_aio.collective import Mesh, Rendezvous


async def run_ranks(
    world: int,
    body: Callable[[Mesh], Awaitable[Any]],
    *,
    collective_timeout: float = 5.0,
    limit: float = 20.0,
) -> list[Any]:
    """Form a ``world``-rank mesh in this process over real loopback TCP, run ``body`` on every
    rank concurrently, close the meshes, and return each rank's result or exception."""
    rendezvous = Rendezvous(HOST, free_port())

    async def rank_main(rank: int) -> Any:
        mesh = await Mesh.connect(
            rank, world, rendezvous, timeout=10, collective_timeout=collective_timeout
        )
        try:
            return await body(mesh)
        finally:
            await mesh.close()

    ranks = asyncio.gather(*(rank_main(rank) for rank in range(world)), return_exceptions=True)
    return await asyncio.wait_for(ranks, limit)
