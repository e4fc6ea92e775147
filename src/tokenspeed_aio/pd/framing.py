"""Length-prefixed msgpack frames over asyncio streams, for the transfer peers' wire."""

from __future__ import annotations

import asyncio
import struct

import msgspec

from tokenspeed_aio.pd.messages import BootstrapMessage, ControlMessage

_HEADER = struct.Struct("<I")
MAX_FRAME_BYTES = 64 << 20  # a claim lists a prompt's pages: far below this
_encode = msgspec.msgpack.Encoder().encode
_decoders = {
    "bootstrap": msgspec.msgpack.Decoder(BootstrapMessage),
    "control": msgspec.msgpack.Decoder(ControlMessage),
}


def write_frame(writer: asyncio.StreamWriter, message: msgspec.Struct) -> None:
    body = _encode(message)
    writer.write(_HEADER.pack(len(body)) + body)


async def read_frame(reader: asyncio.StreamReader, kind: str):
    """The next message; raises ConnectionError at EOF or on a malformed frame."""
    try:
        header = await reader.readexactly(_HEADER.size)
        (size,) = _HEADER.unpack(header)
        if size > MAX_FRAME_BYTES:
            raise ConnectionError(f"a {size}-byte frame: not a transfer peer")
        return _decoders[kind].decode(await reader.readexactly(size))
    except asyncio.IncompleteReadError as err:
        raise ConnectionError("the connection closed") from err
    except msgspec.DecodeError as err:
        raise ConnectionError(f"a malformed frame: {err}") from err
