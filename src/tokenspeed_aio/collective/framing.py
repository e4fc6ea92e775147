"""The mesh's wire format: msgpack messages, each framed by a 4-byte little-endian length."""

from __future__ import annotations

import struct
from typing import Any

import msgspec

HEADER = struct.Struct("<I")
# A corrupt or foreign length prefix must not make a rank allocate gigabytes; a round's largest
# message (a relay carrying prompts) stays far below this.
MAX_FRAME_BYTES = 1 << 30


class Hello(msgspec.Struct, array_like=True, frozen=True):
    """A dialing rank introduces itself to the lower rank it dialed."""

    job_id: str  # ranks of different jobs that reach each other's ports must not pair up
    world_size: int  # ranks started with different layouts must fail, not deadlock
    rank: int
    target: int  # the rank the dialer believes listens here: catches differing address tables


class Welcome(msgspec.Struct, array_like=True, frozen=True):
    """The dialed rank's answer to a Hello: its rank, or why it rejects the dialer."""

    rank: int
    error: str | None = None


class Register(msgspec.Struct, array_like=True, frozen=True):
    """A rank tells the rendezvous where its mesh listener can be dialed."""

    job_id: str
    world_size: int
    rank: int
    host: str
    port: int


class Roster(msgspec.Struct, array_like=True, frozen=True):
    """The rendezvous' answer: every rank's listening address in rank order, or why it failed."""

    addresses: list[tuple[str, int]]
    error: str | None = None


class Envelope(msgspec.Struct, array_like=True, gc=False):
    """One rank's contribution to one collective call."""

    group: tuple[int, ...]  # the group's ranks: the frames of all groups share one connection
    seq: int  # the group's call number: a differing call order between ranks shows here
    op: str  # the call's signature (kind, root, reduce op), which every rank must share
    error: str | None  # a rank-local error, carried by the exchange instead of a value
    value: Any


_encoder = msgspec.msgpack.Encoder()
ENVELOPE_DECODER = msgspec.msgpack.Decoder(Envelope)


def encode_frame(message: Any) -> bytearray:
    """Encode ``message`` behind its length prefix, as one buffer for one write.

    NOTE: a transport may keep a view of the buffer until it is sent; it is never mutated.
    """
    frame = bytearray(HEADER.size)
    _encoder.encode_into(message, frame, HEADER.size)
    HEADER.pack_into(frame, 0, len(frame) - HEADER.size)
    return frame


def frame_body(frame: bytearray) -> memoryview:
    """The message bytes of a frame made by ``encode_frame``."""
    return memoryview(frame)[HEADER.size :]
