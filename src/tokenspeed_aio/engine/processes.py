"""An engine made of rank processes, driven over the ZMQ wire: used by ``serve`` and by
AsyncEngine when it has more than one rank."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from dataclasses import dataclass

from tokenspeed_aio.args import EngineArgs
from tokenspeed_aio.engine.launcher import Launcher, RankFailure, ShutdownLatch
from tokenspeed_aio.engine.rank_process import RankLaunch
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


def rank_launches(args: EngineArgs, log_level: str) -> tuple[Endpoints, list[RankLaunch]]:
    """This node's ranks. One node: IPC sockets and free local ports. Several: node 0's
    dist_init_addr PORT serves the mesh rendezvous, PORT+1/+2 the frontend's sockets,
    PORT+3+i replica i's torch.distributed rendezvous."""
    if args.nnodes > 1:
        host, port = args.dist_init_addr.rsplit(":", 1)
        base = int(port)
        endpoints = Endpoints.tcp(host, base + 1, base + 2)
        mesh: tuple | str = args.dist_init_addr
        tp_inits = tuple(f"tcp://{host}:{base + 3 + i}" for i in range(args.dp))
    else:
        endpoints = Endpoints.local()
        ports = free_ports(args.world_size + args.dp)
        mesh = tuple(("127.0.0.1", p) for p in ports[: args.world_size])
        tp_inits = tuple(f"tcp://127.0.0.1:{p}" for p in ports[args.world_size :])
    first = args.local_ranks.start
    launches = [
        RankLaunch(
            args, r, endpoints, mesh, tp_inits, local_device_index=r - first, log_level=log_level
        )
        for r in args.local_ranks
    ]
    return endpoints, launches


async def run_headless_node(args: EngineArgs, latch: ShutdownLatch, log_level: str) -> int:
    """A node > 0: run this node's ranks (their owners dial node 0's frontend) until they
    exit or a signal; non-zero when a rank failed."""
    _, launches = rank_launches(args, log_level)
    launcher = Launcher(launches, latch)
    launcher.start()
    try:
        await launcher.wait_ready()
        exited = asyncio.ensure_future(launcher.watch())
        stop = asyncio.ensure_future(latch.requested.wait())
        await asyncio.wait({exited, stop}, return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        if exited.done():
            logger.error("%s", exited.result())
        else:
            exited.cancel()
    except RankFailure as err:
        logger.error("%s", err)
    finally:
        await launcher.shutdown(grace=2.0)
    return 0 if all(code == 0 for code in launcher.exit_codes()) else 1


async def start_engine_processes(
    args: EngineArgs, *, log_level: str = "INFO", latch: ShutdownLatch | None = None
) -> EngineProcesses:
    """Start this node's ranks, then wait for readiness and every replica's registration
    together; any rank failure tears the tree down and raises RankFailure."""
    endpoints, launches = rank_launches(args, log_level)
    client = ZmqEngineClient(endpoints, args.dp)
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
