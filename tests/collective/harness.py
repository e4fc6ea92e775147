"""Helpers for the mesh tests: free loopback ports and ranks run as tasks of one process."""

from __future__ import annotations

import asyncio
import random
import socket
from collections.abc import Awaitable, Callable
from typing import Any

from tokenspeed_aio.collective import Mesh, Rendezvous

HOST = "127.0.0.1"


def free_port() -> int:
    """A port nothing listens on right now (the OS's pick)."""
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def free_base_port(count: int) -> int:
    """The first of ``count`` consecutive ports nothing listens on right now."""
    for _ in range(100):
        base = random.randrange(20000, 60000 - count)
        socks = []
        try:
            for port in range(base, base + count):
                sock = socket.socket()
                socks.append(sock)
                sock.bind((HOST, port))
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError(f"no {count} consecutive free ports found")


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
