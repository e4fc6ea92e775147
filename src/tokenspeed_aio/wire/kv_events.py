"""The KV-cache events on the wire, in vLLM's format (``vllm.distributed.kv_events``), so a
KV-aware router written for vLLM or SGLang (Dynamo's, the SGLang Model Gateway's) reads
them unchanged.

A PUB socket sends each round's batch as three frames ``(topic, seq, payload)``: ``seq``
is an 8-byte big-endian sequence number, ``payload`` a msgpack ``KVEventBatch``. A
subscriber that sees a gap asks the replay ROUTER (a REQ socket sending the 8-byte first
sequence number it misses) and gets ``(seq, payload)`` for every batch still buffered from
there, then ``(-1, b"")``. A sequence number dropped by the publisher's full queue is not
in the buffer either: a subscriber missing one must resynchronize (the cache may have
changed).
"""

from __future__ import annotations

import msgspec

END_OF_REPLAY = -1


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of the events (tagged by class name)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]  # consecutive blocks of one chain, parent first
    parent_block_hash: int | None  # the first block's parent (None: a prompt's first block)
    token_ids: list[int]  # block_size tokens per block
    block_size: int
    lora_id: int | None
    medium: str | None  # where the block lives: GPU, CPU


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    """Every block of the medium was dropped (a flush); it carries no fields."""


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float  # wall-clock seconds when the round drained it
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None  # the attention-DP replica that publishes it


encode_batch = msgspec.msgpack.Encoder().encode
decode_batch = msgspec.msgpack.Decoder(KVEventBatch).decode
