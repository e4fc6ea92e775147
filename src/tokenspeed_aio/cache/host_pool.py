"""The host KV buffers: the L2 host pool and the snapshot pool's pages, in pinned memory on
CUDA (plain memory on CPU), sized at startup.

A host page holds one device block whole, every layer's K and V, so one block is one
contiguous copy each way; the device pool keeps its per-layer layout::

    device pool (model/kv_cache.py):  kv[2, num_layers, num_blocks, page, heads, dim]
    host page i:                       host[i] = kv[:, :, block]   ->  [2, L, page, H, D]
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import psutil
import torch

logger = logging.getLogger(__name__)

# Host memory the pools may take, as a fraction of what the machine has available: the
# rest stays for the process, the page cache and the tokenizer threads.
MAX_HOST_FRACTION = 0.8


@dataclass(frozen=True)
class HostSizing:
    """How many host pages the tiers get (0: the tier is off)."""

    l2_blocks: int
    snapshot_pages: int
    snapshot_states: int

    @classmethod
    def of(
        cls,
        *,
        ratio: float,
        size_gb: float | None,
        device_blocks: int,
        block_bytes: int,
        max_num_seqs: int,
    ) -> HostSizing:
        """``ratio`` x the device pool's usable blocks, or ``size_gb`` of pages; the
        snapshot pool holds two tail pages per request slot, at most a quarter of L2."""
        if size_gb:
            l2 = int(size_gb * 2**30 // block_bytes)
        else:
            l2 = int(ratio * (device_blocks - 1))
        if l2 <= 0:
            return cls(0, 0, 0)
        pages = max(1, min(2 * max_num_seqs, l2 // 4))
        return cls(l2, pages, max_num_seqs)

    def bytes(self, block_bytes: int) -> int:
        return (self.l2_blocks + self.snapshot_pages) * block_bytes


def check_host_memory(need: int, local_ranks: int, pinned: bool) -> None:
    """A clear startup error when the pools of this node's ranks cannot fit."""
    available = psutil.virtual_memory().available
    total = need * local_ranks
    if total > MAX_HOST_FRACTION * available:
        raise ValueError(
            f"kvstore: the host KV pools need {total / 2**30:.2f} GiB "
            f"({need / 2**30:.2f} GiB x {local_ranks} ranks on this node) but the machine "
            f"has {available / 2**30:.2f} GiB available (at most {MAX_HOST_FRACTION:.0%} of "
            "it is used); lower --kvstore-ratio or --kvstore-size-gb"
        )


def allocate_host_pages(
    num_pages: int, page_shape: tuple[int, ...], dtype: torch.dtype, pinned: bool
) -> torch.Tensor:
    """[num_pages, *page_shape] host memory, pinned on CUDA machines.

    Pinned by registering plain memory with the driver (``cudaHostRegister``), not through
    ``pin_memory=True``: torch's caching host allocator rounds every block up to a power of
    two, which would pin up to twice the pool. ``release_host_pages`` unregisters it.
    """
    size = num_pages * torch.Size(page_shape).numel() * dtype.itemsize
    what = "pin" if pinned else "allocate"
    try:
        pages = torch.empty((num_pages, *page_shape), dtype=dtype)
    except RuntimeError as err:
        raise ValueError(_no_memory(what, size, err)) from err
    if pinned and size:
        status = int(torch.cuda.cudart().cudaHostRegister(pages.data_ptr(), size, 0))
        if status != 0:
            raise ValueError(_no_memory(what, size, f"cudaHostRegister returned {status}"))
    return pages


def release_host_pages(pages: torch.Tensor | None, pinned: bool) -> None:
    if pages is not None and pinned and pages.numel():
        torch.cuda.cudart().cudaHostUnregister(pages.data_ptr())


def _no_memory(what: str, size: int, err: object) -> str:
    return (
        f"kvstore: could not {what} {size / 2**30:.2f} GiB of host memory for the KV pools "
        f"({err}); lower --kvstore-ratio or --kvstore-size-gb"
    )
