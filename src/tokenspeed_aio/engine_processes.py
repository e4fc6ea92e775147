"""An engine made of rank processes, driven over the ZMQ wire: used by ``serve`` and by
AsyncEngine when it has more than one rank."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from dataclasses import dataclass

from tokenspeed_aio.args import EngineArgs
from tokenspeed_aio.launcher import Launcher, ShutdownLatch
from tokenspeed_aio.rank_process import RankLaunch
from tokenspeed_aio.wire.messages import EngineRegistration, StopEngine
from tokenspeed_aio.wire.zmq_client import Endpoints, ZmqEngineClient

logger = logging.getLogger(__name__)


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass
class EngineProcesses:
    client: ZmqEngineClient
    launcher: Launcher
    registrations: dict[int, EngineRegistration]

    @property
    def max_model_len(self) -> int:
        return self.registrations[0].max_model_len

    async def stop(self) -> None:
        """Ask every replica to stop after its current round, then reap the tree."""
        with contextlib.suppress(Exception):
            self.client.broadcast(StopEngine())
        await self.launcher.shutdown()
        await self.client.close()


async def start_engine_processes(
    args: EngineArgs, *, log_level: str = "INFO", latch: ShutdownLatch | None = None
) -> EngineProcesses:
    """Start every rank, then wait for readiness and the replicas' registrations
    together; any rank failure tears the whole tree down and raises RankFailure."""
    endpoints = Endpoints.local()
    client = ZmqEngineClient(endpoints, args.dp)
    ports = free_ports(args.world_size + args.dp)
    mesh = tuple(("127.0.0.1", p) for p in ports[: args.world_size])
    tp_inits = tuple(f"tcp://127.0.0.1:{p}" for p in ports[args.world_size :])
    launches = [
        RankLaunch(args, r, endpoints, mesh, tp_inits, local_device_index=r, log_level=log_level)
        for r in range(args.world_size)
    ]
    launcher = Launcher(launches, latch)
    launcher.start()
    registrations = asyncio.ensure_future(client.accept_registrations())
    try:
        await launcher.wait_ready()
        regs = await registrations
    except BaseException:
        registrations.cancel()
        await launcher.shutdown(grace=0)
        await client.close()
        raise
    return EngineProcesses(client, launcher, regs)
