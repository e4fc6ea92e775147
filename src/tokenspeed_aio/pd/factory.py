"""Builds a rank's transfer peer from its KV pool, once, at startup (inside
build_device_side): the Mooncake engine, the pool's registration, the peer."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from tokenspeed_aio.args import EngineArgs
from tokenspeed_aio.pd.layout import kv_layout, region_bytes
from tokenspeed_aio.pd.peer import PeerLoop, new_instance
from tokenspeed_aio.pd.receiver import DecodePeer
from tokenspeed_aio.pd.sender import PrefillPeer
from tokenspeed_aio.pd.transfer_engine import MooncakeEngine
from tokenspeed_aio.wire.addresses import local_address

logger = logging.getLogger(__name__)


def advertised_host(args: EngineArgs) -> str:
    """The address this engine's transfer endpoints (the bootstrap server, the KV senders)
    listen on and other engines reach them at: ``--disaggregation-host``; across nodes, the
    interface that reaches ``--dist-init-addr``; else loopback."""
    if args.disaggregation_host:
        return args.disaggregation_host
    if args.nnodes > 1:
        return local_address(args.dist_init_addr.rsplit(":", 1)[0])
    return "127.0.0.1"


def build_transfer_peer(
    args: EngineArgs, tp_rank: int, tp_size: int, k_caches: Sequence, v_caches: Sequence
) -> PeerLoop | None:
    """The rank's peer for ``args.disaggregation_mode`` (None for a plain engine). The
    KV pool is registered with the transfer engine here, once."""
    role = args.disaggregation_mode
    if role == "plain":
        return None
    host = advertised_host(args)
    engine = MooncakeEngine(host)
    layout = kv_layout(k_caches, v_caches, tp_size)
    for base in (*layout.k_bases, *layout.v_bases):
        engine.register(base, region_bytes(layout))
    instance = new_instance()
    timeout = args.disaggregation_bootstrap_timeout
    if role == "decode":
        peer: PeerLoop = DecodePeer(
            engine=engine, layout=layout, tp_rank=tp_rank, instance=instance, timeout=timeout
        )
    else:
        # The first rank serves the bootstrap port; every rank registers there.
        dial = host
        if args.nnodes > 1:
            dial = args.dist_init_addr.rsplit(":", 1)[0]
        peer = PrefillPeer(
            engine=engine,
            layout=layout,
            tp_rank=tp_rank,
            instance=instance,
            timeout=timeout,
            host=host,
            bootstrap=(dial, args.disaggregation_bootstrap_port),
            serve_bootstrap=tp_rank == 0,
        )
    logger.info(
        "%s transfer peer: Mooncake %s session %s, %d KV regions registered",
        role,
        engine.protocol,
        engine.session,
        2 * layout.num_layers,
    )
    return peer
