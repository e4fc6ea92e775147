"""The entry point of one rank process: form the mesh, build the rank, register with
the frontend (replica owners), report ready, serve until stopped.

A rank that fails reports it on its ready channel and leaves with ``os._exit``: it
does not finalize its interpreter, so a lingering thread cannot keep it alive. A
rank that was stopped returns normally.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import pickle
import signal
import sys
import traceback
from dataclasses import dataclass
from typing import NoReturn

from tokenspeed_aio.args import EngineArgs
from tokenspeed_aio.wire.zmq_client import Endpoints

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankLaunch:
    args: EngineArgs
    rank: int  # global rank of this node's engine
    endpoints: Endpoints  # the frontend's sockets (replica owners dial them)
    # Every rank's (host, port) for the TCP mesh, or "HOST:PORT" of its rendezvous.
    mesh_addresses: tuple[tuple[str, int], ...] | str
    tp_init_methods: tuple[str, ...]  # torch.distributed rendezvous, one per replica
    local_device_index: int = 0
    log_level: str = "INFO"


def rank_main(launch: RankLaunch, ready_fd: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the frontend orchestrates shutdown
    logging.basicConfig(
        level=launch.log_level.upper(),
        format=f"%(asctime)s rank{launch.rank} %(levelname)s %(name)s: %(message)s",
    )
    ready = os.fdopen(ready_fd, "wb", buffering=0)
    async_logs = None
    if launch.args.enable_async_logging:
        from tokenspeed_aio.engine.async_logging import AsyncLogging

        async_logs = AsyncLogging()
        async_logs.install()

    def report(kind: str, value: str | None = None) -> None:
        ready.write(json.dumps({"kind": kind, "value": value}).encode() + b"\n")

    def fail(err: BaseException) -> NoReturn:
        logger.error("rank %d failed: %r", launch.rank, err, exc_info=err)
        if async_logs is not None:  # the records reach the stream before the launcher hears
            async_logs.shutdown()
        try:
            report("failed", f"{err!r}\n{''.join(traceback.format_exception(err, limit=8))}")
        except OSError:
            logger.error("the launcher is gone; exiting")
        os._exit(1)

    try:
        _run(launch, report, fail)
    except BaseException as err:
        fail(err)
    if async_logs is not None:
        async_logs.shutdown()


def _run(launch: RankLaunch, report, fail) -> None:
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    runner(_serve(launch, report, fail))


async def _fail_if_a_peer_is_lost(mesh, fail) -> None:
    """Until the rank is ready: a peer that failed in its startup fails this rank now. This
    rank may be blocked in its forward thread (a torch.distributed rendezvous waits up to 30
    minutes for the failed peer), which no cancellation reaches, hence ``fail``'s exit."""
    from tokenspeed_aio.collective.errors import MeshError

    why = await mesh.peer_lost()
    fail(MeshError(f"{why} during startup"))


async def _serve(launch: RankLaunch, report, fail) -> None:
    from tokenspeed_aio.collective import Mesh, Ranks, Rendezvous
    from tokenspeed_aio.control.faults import FaultInjector
    from tokenspeed_aio.data_plane.specs import RankInfo
    from tokenspeed_aio.engine.rank import EngineRank
    from tokenspeed_aio.wire.messages import WIRE_VERSION, EngineRegistration
    from tokenspeed_aio.wire.zmq_transport import ZmqTransport

    args = launch.args
    ranks = Ranks.build(launch.rank, args.world_size, args.tp, args.dp)
    mesh = None
    if args.world_size > 1:
        peers = launch.mesh_addresses
        peers = Rendezvous.parse(peers) if isinstance(peers, str) else list(peers)
        mesh = await Mesh.connect(launch.rank, args.world_size, peers)
        watch = asyncio.ensure_future(_fail_if_a_peer_is_lost(mesh, fail))
    owner = ranks.tp_rank == 0
    transport = (
        ZmqTransport(launch.endpoints.input, launch.endpoints.output, ranks.dp_rank)
        if owner
        else None
    )
    info = RankInfo(
        tp_rank=ranks.tp_rank,
        tp_size=args.tp,
        dp_rank=ranks.dp_rank,
        dist_init_method=launch.tp_init_methods[ranks.dp_rank] if args.tp > 1 else None,
        local_device_index=launch.local_device_index,
    )
    replica = mesh.group(ranks.replica) if mesh is not None and args.tp > 1 else None
    dp_world = mesh.group(ranks.world) if mesh is not None and args.dp > 1 else None
    rank = await EngineRank.start(
        args,
        transport,
        info,
        group=replica,
        dp_group=dp_world,
        faults=FaultInjector.from_env(launch.rank),
    )
    if transport is not None:
        specs = rank.specs
        await transport.register(
            EngineRegistration(
                wire_version=WIRE_VERSION,
                replica=ranks.dp_rank,
                request_types=("generate", "abort", "control"),
                role=specs.role,
                model=(args.served_model_names or [args.model])[0],
                max_model_len=specs.max_model_len,
                vocab_size=specs.vocab_size,
                eos_token_ids=specs.eos_token_ids,
                num_blocks=specs.num_blocks,
                page_size=specs.page_size,
                tp=args.tp,
                dp=args.dp,
                bootstrap_port=args.disaggregation_bootstrap_port if specs.role == "prefill" else 0,
            )
        )
    if mesh is not None:
        watch.cancel()
    report("ready")
    try:
        await rank.serve()
    finally:
        if transport is not None:
            await transport.close()
        if mesh is not None:
            await mesh.close()


if __name__ == "__main__":
    rank_main(pickle.loads(sys.stdin.buffer.read()), int(sys.argv[1]))
