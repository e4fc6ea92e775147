"""Allocation and sizing of the paged KV cache (layout in forward_context.py)."""

from __future__ import annotations

import torch
from tokenspeed_kernels import kv_layout

from tokenspeed_aio.model.parallel import divide

FP8_KV_DTYPES = ("fp8", "fp8_e4m3")


def resolve_kv_cache_dtype(name: str, activation_dtype: torch.dtype) -> torch.dtype:
    """``--kv-cache-dtype``: ``auto`` is the activations' dtype, ``fp8`` e4m3."""
    if name in FP8_KV_DTYPES:
        return torch.float8_e4m3fn
    if name != "auto":
        raise ValueError(f"kv_cache_dtype {name!r} is not supported (auto, fp8)")
    return activation_dtype


def local_num_kv_heads(total_kv_heads: int, tp_size: int) -> int:
    """KV heads this rank stores: a split when there are enough, else one replicated head."""
    if tp_size >= total_kv_heads:
        if tp_size % total_kv_heads:
            raise ValueError(
                f"tensor-parallel size {tp_size} is not a multiple of the number of KV heads "
                f"({total_kv_heads})"
            )
        return 1
    return divide(total_kv_heads, tp_size, "number of KV heads")


def kv_cache_bytes_per_block(
    num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """Bytes one block takes across all layers, K and V (``num_kv_heads`` local to a rank)."""
    return 2 * num_layers * page_size * num_kv_heads * head_dim * dtype.itemsize


def allocate_kv_pool(
    num_layers: int,
    num_blocks: int,
    page_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> torch.Tensor:
    """The whole pool as one tensor [2 (K, V), num_layers, num_blocks, page_size,
    num_kv_heads, head_dim], zeroed: one allocation, so a block's pages across every layer
    can be gathered or scattered with one launch (the host tiers' copies).

    Zeroed so the null block (block 0), which padding rows read, holds finite values.
    """
    shape = (2, num_layers, num_blocks, page_size, num_kv_heads, head_dim)
    return torch.zeros(shape, dtype=dtype, device=device)


def kv_cache_views(pool: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """Per-layer K and V caches [num_blocks, page_size, num_kv_heads, head_dim], views of the
    pool: token-major, except an FP8 pool's V caches, which are dim-major (``kv_layout``:
    the decode kernel's probabilities x V product reads them a page at a time). A block's
    bytes stay one run either way."""
    layers = range(pool.shape[1])
    # pool[kv, layer] selects one view each (unbinding would make views that an in-place
    # write outside inference mode refuses).
    values = tuple(pool[1, i] for i in layers)
    if pool.dtype == torch.float8_e4m3fn:
        values = tuple(kv_layout.dim_major(v) for v in values)
    return tuple(pool[0, i] for i in layers), values


def allocate_kv_cache(*shape, **where) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """Per-layer K and V caches [num_blocks, page_size, num_kv_heads, head_dim] of a zeroed
    pool (``allocate_kv_pool``'s arguments)."""
    return kv_cache_views(allocate_kv_pool(*shape, **where))
