"""The prefix cache's keys and what it holds: a request's full blocks are hashed into a
chain (a block's key is its parent's key and its own tokens) and published into the
block pool's index once every token of the block was dispatched.

A block may be published before its forward ran: the device runs forwards in dispatch
order, so any later prefix hit reads it after the forward that writes it.
"""

from __future__ import annotations

from tokenspeed_aio.scheduler.block_pool import BlockPool
from tokenspeed_aio.scheduler.request import Request

# Stands for the missing parent of a request's first block inside the hashed tuple:
# ``hash(None)`` depends on None's address before Python 3.12, so it would differ between
# processes. Any fixed int does; a key that collides with it is caught by the stored-key
# check like any other collision.
_ROOT = 0


def chain_hash(parent: int | None, tokens: tuple[int, ...]) -> int:
    """Key of a full block: its parent's key (None for a first block) and its own tokens.

    Tuples of ints hash identically in every process (no PYTHONHASHSEED salt), so
    ranks and restarts agree. A hit is verified against the stored tokens, so a
    64-bit collision can never hand a request someone else's KV.
    """
    return hash((_ROOT if parent is None else parent, tokens))


def hash_full_blocks(req: Request, page_size: int) -> None:
    """Extend ``req.block_hashes`` over every full block of its known tokens."""
    hashes = req.block_hashes
    token_ids = req.token_ids
    for i in range(len(hashes), len(token_ids) // page_size):
        parent = hashes[-1][0] if hashes else None
        tokens = tuple(token_ids[i * page_size : (i + 1) * page_size])
        hashes.append((chain_hash(parent, tokens), parent, tokens))


def publish_full_blocks(pool: BlockPool, req: Request) -> None:
    """Cache the request's blocks whose tokens are all known and computed (dispatched)."""
    if not pool.enable_prefix_caching:
        return
    page = pool.page_size
    full = min(req.num_computed, len(req.token_ids)) // page
    if full <= req.num_cached_blocks:
        return
    hash_full_blocks(req, page)
    for i in range(req.num_cached_blocks, full):
        pool.cache(req.block_ids[i], *req.block_hashes[i])
    req.num_cached_blocks = full
