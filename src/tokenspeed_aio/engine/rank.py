"""One engine rank assembled: data plane (forward thread), scheduler, event loop.

Used in-process by AsyncEngine with one rank, and by every rank process the
launcher starts (with a ZMQ transport on the replica's first member).
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging

from tokenspeed_aio.args import EngineArgs
from tokenspeed_aio.control.batch_log import BatchLog
from tokenspeed_aio.control.cache_ops import CacheOps
from tokenspeed_aio.control.control import Control
from tokenspeed_aio.control.dp import DpAgreement, DpGroup
from tokenspeed_aio.control.event_loop import EventLoop
from tokenspeed_aio.control.faults import FaultInjector
from tokenspeed_aio.control.grammar import GrammarQueue
from tokenspeed_aio.control.ingress import Ingress
from tokenspeed_aio.control.output import OutputProcessor
from tokenspeed_aio.control.pd import PdTransfers
from tokenspeed_aio.control.relay import Relay, ReplicaGroup
from tokenspeed_aio.control.request_stats import RequestStats
from tokenspeed_aio.control.storage import StorageOps
from tokenspeed_aio.control.transport import Transport
from tokenspeed_aio.data_plane.specs import DeviceSpecs, RankInfo
from tokenspeed_aio.gc_policy import freeze_startup_heap
from tokenspeed_aio.scheduler.scheduler import HostTierConfig, Scheduler, SchedulerConfig

logger = logging.getLogger(__name__)


NO_XGRAMMAR = (
    "structured output needs the xgrammar package, which is not installed "
    "(pip install 'tokenspeed_aio[grammar]')"
)


def _grammar_backend(args: EngineArgs, specs: DeviceSpecs):
    if args.grammar_backend == "none":
        return None
    if importlib.util.find_spec("xgrammar") is None:  # an optional dependency (it brings Triton)
        logger.warning("%s: constrained requests will be refused", NO_XGRAMMAR)
        return None
    from tokenspeed_aio.grammar.xgrammar_backend import XGrammarBackend

    return XGrammarBackend(args.tokenizer or args.model, specs.vocab_size, specs.eos_token_ids)


def _host_tier(args: EngineArgs, specs: DeviceSpecs) -> HostTierConfig | None:
    if not specs.host_blocks:
        return None
    return HostTierConfig(
        num_blocks=specs.host_blocks,
        num_snapshot_pages=specs.snapshot_pages,
        num_snapshot_states=specs.snapshot_states,
        write_policy=args.kvstore_write_policy,
    )


def _kv_event_publisher(args: EngineArgs, specs: DeviceSpecs, rank: RankInfo):
    """The replica's ZMQ KV-event publisher (its first member's; the others mirror it)."""
    if args.kv_events_endpoint is None or rank.tp_rank != 0:
        return None
    from tokenspeed_aio.control.kv_publisher import ZmqKVEventPublisher, replica_endpoints

    pub, replay = replica_endpoints(
        args.kv_events_endpoint, args.kv_events_replay_endpoint, rank.dp_rank
    )
    logger.info("publishing KV events on %s (replay %s)", pub, replay)
    return ZmqKVEventPublisher(
        pub,
        replay,
        block_size=specs.page_size,
        dp_rank=rank.dp_rank,
        queue_size=args.kv_events_queue_size,
    )


class EngineRank:
    def __init__(self, loop: EventLoop, data_plane, specs: DeviceSpecs, kv_publisher=None) -> None:
        self.loop = loop
        self.data_plane = data_plane
        self.specs = specs
        self.kv_publisher = kv_publisher
        if kv_publisher is not None:
            loop.kv_events.subscribe(kv_publisher.publish)

    @classmethod
    async def start(
        cls,
        args: EngineArgs,
        transport: Transport | None,
        rank: RankInfo | None = None,
        group: ReplicaGroup | None = None,
        dp_group: DpGroup | None = None,
        faults: FaultInjector | None = None,
    ) -> EngineRank:
        from tokenspeed_aio.data_plane.forward_thread import ForwardThreadDataPlane

        rank = rank or RankInfo()
        data_plane = ForwardThreadDataPlane(asyncio.get_running_loop())
        try:
            specs, transfer = await data_plane.build(args, rank)
        except BaseException:
            await data_plane.shutdown()
            raise
        scheduler = Scheduler(
            SchedulerConfig(
                num_blocks=specs.num_blocks,
                page_size=specs.page_size,
                max_num_seqs=specs.max_num_seqs,
                max_num_batched_tokens=args.chunked_prefill_size,
                max_model_len=specs.max_model_len,
                enable_prefix_caching=args.enable_prefix_caching,
                host=_host_tier(args, specs),
                storage=specs.storage,
                role=specs.role,
            )
        )
        loop = EventLoop(
            scheduler=scheduler,
            grammar=GrammarQueue(
                _grammar_backend(args, specs),
                args.grammar_compile_timeout_secs,
                group,
                disabled=NO_XGRAMMAR if args.grammar_backend != "none" else None,
            ),
            data_plane=data_plane,
            relay=Relay(transport, group, is_owner=rank.tp_rank == 0),
            ingress=Ingress(max_model_len=specs.max_model_len, role=specs.role),
            output=OutputProcessor(
                eos_token_ids=specs.eos_token_ids,
                request_stats=RequestStats(args.log_request_stats and rank.tp_rank == 0),
                sends_kv=specs.role == "prefill",
            ),
            in_flight_depth=args.in_flight_depth,
            replica=rank.dp_rank,
            dp=DpAgreement(dp_group) if dp_group is not None else None,
            faults=faults,
            cache_ops=CacheOps(group, block_bytes=specs.kv_bytes_per_block),
            control=Control(
                data_plane,
                dp_group if dp_group is not None else group,
                dp=dp_group is not None,
                weight_version=args.weight_version,
            ),
            batch_log=BatchLog(args.log_batch_interval if rank.tp_rank == 0 else 0, rank.dp_rank),
            pd=PdTransfers(transfer, group, rank.tp_size),
            storage=StorageOps(rank.tp_size) if specs.storage else None,
        )
        logger.info(
            "rank ready: %d KV blocks of %d tokens (%d concurrent tokens), %s %s, attention %s",
            specs.num_blocks - 1,
            specs.page_size,
            specs.max_concurrent_tokens,
            specs.device,
            specs.dtype,
            specs.attention_backend,
        )
        try:
            publisher = _kv_event_publisher(args, specs, rank)
        except BaseException:
            await data_plane.shutdown()
            raise
        return cls(loop, data_plane, specs, publisher)

    async def serve(self) -> None:
        """Enter serving (sync-debug armed, startup heap frozen), run rounds until a
        stop, then shut the data plane down."""
        try:
            await self.data_plane.enter_serving()
            freeze_startup_heap(automatic_full_collections=False)  # GcHooks runs them
            await self.loop.run()
        finally:
            if self.loop.grammar.backend is not None:
                self.loop.grammar.backend.shutdown()
            if self.kv_publisher is not None:
                await asyncio.to_thread(self.kv_publisher.close)
            await self.data_plane.shutdown()
