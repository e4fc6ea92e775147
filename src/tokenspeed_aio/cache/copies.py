"""Block copies between the device KV pool and host pages, through a device staging buffer.

A device block is scattered over 2 x num_layers tensors of the pool; a host page holds it
whole. A store gathers the blocks into staging with one launch (an index_select over the
block-major view of the pool), then copies staging to the host pages -- one copy per run
of consecutive pages. A load copies host pages into staging the same way, then scatters
staging into the pool: per layer when the forward waits on per-layer fences, else with
one launch. Blocks beyond the staging buffer's size go in chunks, in stream order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from tokenspeed_aio.guards.host_sync import host_to_device


def runs(dst: Sequence[int]) -> list[tuple[int, int, int]]:
    """(offset, first dst, length) of the maximal runs of consecutive ``dst`` values."""
    out = []
    start = 0
    for i in range(1, len(dst) + 1):
        if i == len(dst) or dst[i] != dst[i - 1] + 1:
            out.append((start, dst[start], i - start))
            start = i
    return out


class BlockCopier:
    """Copies for one stream: it owns a staging buffer only that stream uses. ``pool``
    returns the device KV pool [2, L, N, page, H, D] as it is now (a CPU memory release
    replaces it)."""

    def __init__(self, pool: Callable[[], torch.Tensor], stage_blocks: int) -> None:
        self.pool = pool
        kv = pool()
        self.device = kv.device
        page_shape = (kv.shape[0], kv.shape[1], *kv.shape[3:])
        self.stage = torch.empty((stage_blocks, *page_shape), dtype=kv.dtype, device=kv.device)

    def _by_block(self) -> torch.Tensor:
        """The pool viewed block-major: [N, 2, L, page, H, D]."""
        return self.pool().permute(2, 0, 1, 3, 4, 5)

    def _index(self, blocks: Sequence[int]) -> torch.Tensor:
        return host_to_device(np.asarray(blocks, np.int64), self.device)

    def store(self, src: Sequence[int], host: torch.Tensor, dst: Sequence[int]) -> None:
        """Device blocks ``src`` -> host pages ``dst`` (enqueued on the current stream)."""
        n = len(self.stage)
        for at in range(0, len(src), n):
            chunk, pages = src[at : at + n], dst[at : at + n]
            stage = self.stage[: len(chunk)]
            torch.index_select(self._by_block(), 0, self._index(chunk), out=stage)
            for i, page, length in runs(pages):
                host[page : page + length].copy_(stage[i : i + length], non_blocking=True)

    def load(
        self,
        host_of: Callable[[int], tuple[torch.Tensor, int]],
        count: int,
        dst: Sequence[int],
        per_layer: Callable[[int], None] | None = None,
    ) -> None:
        """``count`` host pages -> device blocks ``dst``; ``host_of(i)`` names the i-th
        source (its pages tensor and page). ``per_layer(layer)`` is called after each
        layer of the last chunk is in place (the fences)."""
        n = len(self.stage)
        kv = self.pool()
        by_block = kv.permute(2, 0, 1, 3, 4, 5)
        for at in range(0, count, n):
            c = min(n, count - at)
            stage = self.stage[:c]
            sources = [host_of(at + i) for i in range(c)]
            i = 0
            while i < c:  # runs of consecutive pages of one tensor: one copy each
                pages, page = sources[i]
                j = i + 1
                while j < c and sources[j][0] is pages and sources[j][1] == page + j - i:
                    j += 1
                stage[i:j].copy_(pages[page : page + j - i], non_blocking=True)
                i = j
            index = self._index(dst[at : at + c])
            if per_layer is None or at + c < count:
                by_block.index_copy_(0, index, stage)
                continue
            for layer in range(kv.shape[1]):
                kv[:, layer].index_copy_(1, index, stage[:, :, layer].transpose(0, 1))
                per_layer(layer)

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Device-to-device: each (src, dst) block, every layer (sources read first)."""
        src, dst = zip(*pairs)
        by_block = self._by_block()
        blocks = torch.index_select(by_block, 0, self._index(src))
        by_block.index_copy_(0, self._index(dst), blocks)

    def zero_blocks(self, blocks: Sequence[int]) -> None:
        self.pool().index_fill_(2, self._index(blocks), 0)
