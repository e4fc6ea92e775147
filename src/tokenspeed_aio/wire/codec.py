"""msgpack encoders/decoders for the wire's message unions (one per direction)."""

from __future__ import annotations

import msgspec

from tokenspeed_aio.wire.messages import HandshakeMessage, InboundMessage, OutputBatch

_encoder = msgspec.msgpack.Encoder()
encode = _encoder.encode
# The frontend sends the messages of one event-loop turn as one frame.
decode_inbound = msgspec.msgpack.Decoder(list[InboundMessage]).decode
decode_outbound = msgspec.msgpack.Decoder(OutputBatch).decode
decode_handshake = msgspec.msgpack.Decoder(HandshakeMessage).decode
