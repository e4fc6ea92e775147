"""The frontend side of the ZMQ wire: binds the sockets the replicas' first members
dial, takes their registrations, routes inbound messages by replica, and yields
their output batches."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import tempfile
import uuid
from dataclasses import dataclass

import zmq
import zmq.asyncio

from tokenspeed_aio.wire.codec import decode_handshake, decode_outbound, encode
from tokenspeed_aio.wire.messages import (
    WIRE_VERSION,
    EngineRegistration,
    InboundMessage,
    OutputBatch,
    RegistrationReply,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Endpoints:
    """Where the frontend listens; rank processes get these at launch."""

    input: str  # ROUTER: registrations and inbound messages
    output: str  # PULL: output batches

    @classmethod
    def local(cls) -> Endpoints:
        base = f"ipc://{tempfile.gettempdir()}/tokenspeed-{uuid.uuid4().hex[:12]}"
        return cls(input=f"{base}-in", output=f"{base}-out")

    @classmethod
    def tcp(cls, host: str, input_port: int, output_port: int) -> Endpoints:
        return cls(input=f"tcp://{host}:{input_port}", output=f"tcp://{host}:{output_port}")


class ZmqEngineClient:
    """Implements api.frontend.EngineConnection over ZMQ."""

    def __init__(self, endpoints: Endpoints, num_replicas: int) -> None:
        self.endpoints = endpoints
        self.num_replicas = num_replicas
        self._ctx = zmq.asyncio.Context()
        self._input = self._ctx.socket(zmq.ROUTER)
        self._input.setsockopt(zmq.LINGER, 0)
        self._input.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an unknown replica is an error
        self._output = self._ctx.socket(zmq.PULL)
        self._output.setsockopt(zmq.LINGER, 0)
        for sock, address in ((self._input, endpoints.input), (self._output, endpoints.output)):
            try:
                sock.bind(_bind_address(address))
            except zmq.ZMQError as err:  # a port in use, named, rather than a traceback
                self._ctx.destroy(linger=0)
                raise OSError(
                    err.errno, f"the frontend cannot listen at {address}: {os.strerror(err.errno)}"
                ) from err
        self.registrations: dict[int, EngineRegistration] = {}
        self._identities: dict[int, bytes] = {}
        self._pending: dict[int, list[InboundMessage]] = {}  # this turn's, by replica

    async def accept_registrations(self) -> dict[int, EngineRegistration]:
        """Wait until every replica's first member registered (the launcher bounds the
        wait by watching the rank processes at the same time)."""
        while len(self.registrations) < self.num_replicas:
            identity, frame = await self._input.recv_multipart()
            reg = decode_handshake(frame)
            reason = self._refusal(reg)
            reply = RegistrationReply(accepted=not reason, reason=reason)
            await self._input.send_multipart([identity, encode(reply)])
            if reason:
                raise ConnectionError(f"refused an engine registration: {reason}")
            self.registrations[reg.replica] = reg
            self._identities[reg.replica] = identity
            logger.info("replica %d registered: %s", reg.replica, reg.model)
        return self.registrations

    def _refusal(self, reg: object) -> str:
        if not isinstance(reg, EngineRegistration):
            return "the first message must be an EngineRegistration"
        if reg.wire_version != WIRE_VERSION:
            return f"wire version {reg.wire_version}, this frontend speaks {WIRE_VERSION}"
        if not 0 <= reg.replica < self.num_replicas or reg.replica in self.registrations:
            return f"unexpected replica {reg.replica}"
        return ""

    def send(self, msg: InboundMessage, replica: int) -> None:
        """Queue ``msg``: the messages of one event-loop turn go out in order, as one
        frame per replica (a fan-out of thousands costs one ZMQ send per turn)."""
        if not self._pending:
            asyncio.get_running_loop().call_soon(self._flush)
        self._pending.setdefault(replica, []).append(msg)

    def _flush(self) -> None:
        pending, self._pending = self._pending, {}
        for replica, messages in pending.items():
            frames = [self._identities[replica], encode(messages)]
            self._input.send_multipart(frames, copy=False).add_done_callback(_log_failure)

    def broadcast(self, msg: InboundMessage) -> None:
        for replica in self._identities:
            self.send(msg, replica)

    async def receive(self) -> OutputBatch:
        return decode_outbound(await self._output.recv())

    async def close(self) -> None:
        self._flush()
        self._ctx.destroy(linger=0)
        for address in (self.endpoints.input, self.endpoints.output):
            remove_ipc_file(address)


def remove_ipc_file(address: str) -> None:
    """Unlink a bound ipc:// endpoint's socket file (libzmq leaves it in the temp dir)."""
    if address.startswith("ipc://"):
        with contextlib.suppress(OSError):
            os.unlink(address[len("ipc://") :])


def _bind_address(address: str) -> str:
    """A tcp address names the host ranks dial (--dist-init-addr's): bind that interface
    only, not every one."""
    if address.startswith("tcp://"):
        host, port = address[len("tcp://") :].rsplit(":", 1)
        return f"tcp://{socket.gethostbyname(host)}:{port}"
    return address


def _log_failure(fut: asyncio.Future) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        logger.error("sending to an engine failed: %r", fut.exception())
