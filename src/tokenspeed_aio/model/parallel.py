"""Tensor-parallel state of this process's forward thread.

Module-level on purpose: a rank process has exactly one forward thread, and the
layers read their shard index from here while they are built. Collectives are
no-ops at size 1, so single-GPU runs need no process group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_rank = 0
_size = 1
_group: dist.ProcessGroup | None = None


def init_tensor_parallel(rank: int, size: int, group: dist.ProcessGroup | None = None) -> None:
    """Set this process's TP rank and size; ``group`` defaults to the world group."""
    global _rank, _size, _group
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"invalid tensor-parallel rank {rank} for size {size}")
    if size > 1 and not dist.is_initialized():
        raise ValueError(f"tensor-parallel size {size} needs torch.distributed initialized first")
    _rank, _size, _group = rank, size, group


def tp_rank() -> int:
    return _rank


def tp_size() -> int:
    return _size


def divide(numerator: int, denominator: int, what: str) -> int:
    """Exact split of ``what`` across ranks, with an error a user can act on."""
    if numerator % denominator:
        raise ValueError(
            f"{what} ({numerator}) is not divisible by tensor-parallel size {denominator}"
        )
    return numerator // denominator


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the TP group, in place."""
    if _size > 1:
        dist.all_reduce(x, group=_group)
    return x


def tp_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim``, in rank order."""
    if _size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(_size)]
    dist.all_gather(parts, x, group=_group)
    return torch.cat(parts, dim=dim)
