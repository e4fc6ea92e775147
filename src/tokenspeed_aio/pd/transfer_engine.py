"""The Mooncake transfer engine (``mooncake-transfer-engine-non-cuda`` on CPU, the CUDA
build on GPU): the only module that imports it. Peer-to-peer handshake (no metadata
server); the protocol is TCP unless ``TOKENSPEED_PD_PROTOCOL`` names another
(``rdma`` where the machine has RDMA NICs)."""

from __future__ import annotations

import logging
import os
import threading

logger = logging.getLogger(__name__)

# Writes per batch call: the TCP transport's lanes queue a bounded number of slices and
# refuse a larger batch whole (a 1k-token prompt on scattered pages is 4096 writes).
MAX_BATCH = 256


class MooncakeEngine:
    def __init__(self, host: str) -> None:
        os.environ.setdefault("GLOG_minloglevel", "2")  # its INFO lines flood the log
        try:
            from mooncake.engine import TransferEngine
        except ImportError as err:
            raise RuntimeError(
                "prefill/decode disaggregation needs the Mooncake transfer engine: pip "
                "install 'tokenspeed_aio[pd]' (mooncake-transfer-engine-non-cuda on CPU, "
                f"mooncake-transfer-engine on CUDA; it needs libibverbs1): {err}"
            ) from err
        self.protocol = os.environ.get("TOKENSPEED_PD_PROTOCOL", "tcp")
        self._engine = TransferEngine()
        rc = self._engine.initialize(host, "P2PHANDSHAKE", self.protocol, "")
        if rc != 0:
            raise RuntimeError(f"the Mooncake transfer engine failed to start on {host} ({rc})")
        self.session = f"{host}:{self._engine.get_rpc_port()}"
        self._registered: list[int] = []
        self._lock = threading.Lock()

    def register(self, address: int, length: int) -> None:
        """Register a region once, at startup (the KV pool's layers)."""
        rc = self._engine.register_memory(address, length)
        if rc != 0:
            raise RuntimeError(f"Mooncake could not register {length} bytes at {address:#x}")
        self._registered.append(address)

    def write(
        self, session: str, sources: list[int], targets: list[int], lengths: list[int]
    ) -> int:
        """Write local regions into a peer's registered memory, MAX_BATCH at a time;
        blocks (releasing the GIL) until every write was acknowledged. 0 on success,
        else the failed batch's code (the writes after it are not attempted)."""
        for i in range(0, len(sources), MAX_BATCH):
            end = i + MAX_BATCH
            rc = self._engine.batch_transfer_sync_write(
                session, sources[i:end], targets[i:end], lengths[i:end]
            )
            if rc != 0:
                return rc
        return 0

    def close(self) -> None:
        with self._lock:
            for address in self._registered:
                self._engine.unregister_memory(address)
            self._registered.clear()
