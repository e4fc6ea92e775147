"""Where a slot's values live in a paged KV cache, for every kernel that writes or reads one.

A cache is seen as ``[num_blocks, page_size, num_kv_heads, head_dim]`` whatever its memory
order; each block's values fill one contiguous span (``stride(0)`` apart), so a block moves as
one run of bytes (host tiers, transfers). Inside a block the order is one of two:

- token-major (``stride(3) == 1``): each token's heads back to back, a head's ``head_dim``
  values contiguous. Every K cache, and the V cache of a 16-bit pool.
- dim-major (``stride(1) == 1``, ``dim_major``): the block stored as ``[num_kv_heads,
  head_dim, page_size]``, a head's page one contiguous run with the page's tokens innermost.
  The V cache of an FP8 pool: the probabilities x V product sums over tokens, so its operand
  wants consecutive tokens of one dimension side by side; with one byte a value, Hopper has
  no transposing shared-memory load to get them from a token-major tile, and the decode
  kernel spent as many instructions gathering bytes as on the rest of its loop
  (docs/performance.md). A dim-major tile is the K tile's case, transposed.

A slot ``s`` (``block * page_size + offset``) addresses ``(s // page_size) * stride(0) +
(s % page_size) * stride(1)``, then ``head * stride(2) + dim * stride(3)``: ``strides``
and the kernels' ``kv_layout_jit.slot_offset`` serve both orders, so writers and readers
take any cache this module allows. This module stays free of Triton, as ``fp8`` does: the
engine's CPU path imports it.

The decode and extend kernels read a dim-major V cache a whole page at a time, so the slots
of a sequence's last page past its length are read too, weighted by zero: they must hold
finite values. The pool is zeroed when allocated and when resumed, and every e4m3 writer --
the kernels (``fp8_jit.to_e4m3``) and the torch path (``fp8.quantize``) -- clamps with
maxNum/minNum (infinities saturate, NaN goes to -448), so none leaves a non-finite one.
"""

from __future__ import annotations

import torch


def dim_major(cache: torch.Tensor) -> torch.Tensor:
    """The dim-major view of a contiguous ``[num_blocks, page_size, heads, head_dim]`` cache's
    memory: the same shape, each block's bytes reinterpreted as ``[heads, head_dim,
    page_size]`` (module doc). For an allocation: it does not move values."""
    assert cache.is_contiguous()
    num_blocks, page_size, heads, head_dim = cache.shape
    if page_size == 1:  # one token a page: the two orders are the same memory
        return cache
    return cache.view(num_blocks, heads, head_dim, page_size).permute(0, 3, 1, 2)


def is_dim_major(cache: torch.Tensor) -> bool:
    return cache.stride(1) == 1 and cache.shape[1] > 1


def strides(cache: torch.Tensor) -> tuple[int, int, int, int]:
    """``(block, page, head, dim)`` strides of a cache; ValueError unless it is in one of the
    module's two orders, blocks packed back to back."""
    _, page_size, heads, head_dim = cache.shape
    s_block, s_page, s_head, s_dim = cache.stride()
    if is_dim_major(cache):
        packed = (s_head, s_dim) == (head_dim * page_size, page_size)
    else:
        packed = (s_page, s_head, s_dim) == (heads * head_dim, head_dim, 1)
    if not packed or s_block != page_size * heads * head_dim:
        raise ValueError(
            f"a KV cache of packed token- or dim-major blocks, not strides {cache.stride()}"
        )
    return s_block, s_page, s_head, s_dim


def blocks_packed(cache: torch.Tensor) -> bool:
    """Whether ``cache`` is in one of the module's orders (a block one contiguous span)."""
    try:
        strides(cache)
    except ValueError:
        return False
    return True


def slots(cache: torch.Tensor, slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(block, offset) index tensors of slots, for torch indexing of either order
    (``cache[block, offset]`` is the slot's ``[heads, head_dim]``)."""
    page_size = cache.shape[1]
    return slot_mapping // page_size, slot_mapping % page_size
