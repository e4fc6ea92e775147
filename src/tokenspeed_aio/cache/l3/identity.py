"""What names an L3 object: the deployment identity (the model's architecture, the
weights' identity, the KV dtype, the page size and the KV layout of this rank's pages)
hashed into a namespace, and under it the page's hash-chain key. Engines serving the same
model with the same layout share objects; any difference gives another namespace, so
objects of different deployments never collide. Each tensor-parallel rank stores its own
shard of a page (its KV heads), so the rank is part of the layout.

An object is a header -- the block's chain key, its parent's and its tokens -- followed by
the page's bytes. A read checks the header against the block it was asked for, so neither a
64-bit hash collision nor a foreign object ever lands in a page.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import asdict, dataclass

_MAGIC = b"TSL3"
_HEAD = struct.Struct("<4sIqqI")  # magic, version, hash, parent (or 0), token count
_VERSION = 1
_NO_PARENT = 0


@dataclass(frozen=True)
class DeploymentIdentity:
    architecture: str
    weights: str  # the checkpoint's identity (its path and files), or dummy weights' seed
    dtype: str  # the KV cache's dtype
    page_size: int
    layout: str  # this rank's page shape and its place in the tensor-parallel group

    @property
    def namespace(self) -> str:
        text = json.dumps(asdict(self), sort_keys=True)
        return "ts-" + hashlib.sha256(text.encode()).hexdigest()[:24]


def object_key(namespace: str, chain_hash: int) -> str:
    return f"{namespace}/{chain_hash & (2**64 - 1):016x}"


def encode_object(
    chain_hash: int, parent: int | None, tokens: tuple[int, ...], page: memoryview
) -> bytes:
    head = _HEAD.pack(
        _MAGIC,
        _VERSION,
        _signed(chain_hash),
        _signed(_NO_PARENT if parent is None else parent),
        len(tokens),
    )
    return b"".join((head, struct.pack(f"<{len(tokens)}q", *tokens), page))


def decode_object(
    value: bytes, chain_hash: int, parent: int | None, tokens: tuple[int, ...], page_bytes: int
) -> memoryview:
    """The page's bytes, once the header matches the block asked for (else ValueError)."""
    n = len(tokens)
    body = _HEAD.size + 8 * n
    if len(value) != body + page_bytes:
        raise ValueError(f"object has {len(value)} bytes, expected {body + page_bytes}")
    magic, version, h, p, count = _HEAD.unpack_from(value)
    if magic != _MAGIC or version != _VERSION:
        raise ValueError("not an L3 page object")
    want_parent = _signed(_NO_PARENT if parent is None else parent)
    if h != _signed(chain_hash) or p != want_parent or count != n:
        raise ValueError("object names another block")
    if struct.unpack_from(f"<{n}q", value, _HEAD.size) != tokens:
        raise ValueError("object holds other tokens")
    return memoryview(value)[body:]


def _signed(value: int) -> int:
    value &= 2**64 - 1
    return value - 2**64 if value >= 2**63 else value
