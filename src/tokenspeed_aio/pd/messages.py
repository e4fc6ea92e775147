"""The transfer peers' wire: the bootstrap protocol (a prefill engine's ranks register,
decode ranks look them up) and the control protocol between a decode rank and its
prefill rank. msgpack, each frame preceded by its 4-byte length (framing.py).

The control protocol is versioned (``CONTROL_VERSION``, in Hello and Welcome): a prefill
rank refuses a decode rank of another version, and a decode rank a prefill rank of
another, each with an error naming both versions. A field added at the end of a message
with a default keeps older frames decodable; anything else is a new version."""

from __future__ import annotations

import msgspec

from tokenspeed_aio.wire.messages import TokenLogprobs

# 1: Hold (a room's request registered on the decode rank) and Ping (its heartbeat).
# 0: a peer whose Hello or Welcome has no version field (it decodes as 0).
CONTROL_VERSION = 1


class KvLayout(msgspec.Struct, array_like=True, frozen=True):
    """One rank's share of the paged KV pool: per layer, a K and a V region of
    ``num_blocks`` pages of ``page_bytes`` each (model/kv_cache.py's layout)."""

    num_layers: int
    page_size: int  # tokens per page
    page_bytes: int  # bytes of one page of one layer's K (or V) on this rank
    num_blocks: int
    tp_size: int
    k_bases: list[int]  # address of each layer's K region (registered with Mooncake)
    v_bases: list[int]

    def mismatch(self, other: KvLayout) -> str | None:
        """Why another rank's pages cannot receive (or send) this rank's, or None."""
        if self.tp_size != other.tp_size:
            return (
                f"unequal tensor parallelism (tp={other.tp_size} on the other side, "
                f"tp={self.tp_size} here): prefill and decode engines must run the same tp"
            )
        for name in ("num_layers", "page_size", "page_bytes"):
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine != theirs:
                return f"the KV layouts differ: {name} is {theirs} there and {mine} here"
        return None


class RankEndpoint(msgspec.Struct, array_like=True, frozen=True):
    """Where a prefill rank takes claims (its control server) and its transfer engine."""

    tp_rank: int
    host: str
    port: int
    session: str  # Mooncake's session id of the rank's transfer engine ("host:port")
    instance: int  # random per peer start: a restarted engine is another peer
    layout: KvLayout


# -- bootstrap ------------------------------------------------------------------------
class RegisterRank(msgspec.Struct, tag=True, array_like=True, frozen=True):
    endpoint: RankEndpoint


class Lookup(msgspec.Struct, tag=True, array_like=True, frozen=True):
    """A decode rank asks for the prefill engine's ranks."""


class Roster(msgspec.Struct, tag=True, array_like=True, frozen=True):
    ranks: list[RankEndpoint]  # in tp_rank order, once every rank registered
    error: str | None = None


# -- control: decode rank -> prefill rank ----------------------------------------------
class Hello(msgspec.Struct, tag=True, array_like=True, frozen=True):
    """A decode rank's cache identity: a restart is another instance, whatever its
    address; the prefill rank writes only into the pages this identity advertised."""

    instance: int
    tp_rank: int
    session: str  # the decode rank's Mooncake session id (the write target)
    layout: KvLayout
    version: int = 0  # the decode rank's CONTROL_VERSION


class Hold(msgspec.Struct, tag=True, array_like=True, frozen=True):
    """A request for the room registered on this decode rank; its Claim follows once its
    landing pages are allocated. From here on the room is this connection's: should the
    connection drop or its heartbeat lapse, the prefill rank fails the room at once."""

    room: int


class Ping(msgspec.Struct, tag=True, array_like=True, frozen=True):
    """The decode rank's heartbeat (peer.HEARTBEAT_SECONDS), whether or not rooms are in
    flight: a prefill rank that hears nothing for peer.HEARTBEAT_LAPSE_SECONDS takes the
    decode rank for dead."""


class Claim(msgspec.Struct, tag=True, array_like=True, frozen=True):
    """The landing pages of a room: write the prompt's KV there."""

    room: int
    pages: list[int]


class Cancel(msgspec.Struct, tag=True, array_like=True, frozen=True):
    """Stop the room; answered by CancelAck once its queued and executing writes
    retired. Repeating it is safe."""

    room: int


# -- control: prefill rank -> decode rank ----------------------------------------------
class Welcome(msgspec.Struct, tag=True, array_like=True, frozen=True):
    instance: int
    error: str | None = None  # why the prefill rank refuses this decode rank
    version: int = 0  # the prefill rank's CONTROL_VERSION


class Done(msgspec.Struct, tag=True, array_like=True, frozen=True):
    """The room's KV was written (every write acknowledged) and its first token."""

    room: int
    token: int
    logprobs: TokenLogprobs | None
    num_bytes: int
    seconds: float


class Fail(msgspec.Struct, tag=True, array_like=True, frozen=True):
    """The room failed; sent only once no write of this rank can still reach it."""

    room: int
    status: int
    message: str


class CancelAck(msgspec.Struct, tag=True, array_like=True, frozen=True):
    room: int


BootstrapMessage = RegisterRank | Lookup | Roster
ControlMessage = Hello | Hold | Claim | Cancel | Ping | Welcome | Done | Fail | CancelAck
