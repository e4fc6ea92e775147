"""A rank's KV pool as the transfer peers see it: addresses and sizes, no tensors, and
the page runs a room's transfer writes."""

from __future__ import annotations

from collections.abc import Sequence

from tokenspeed_kernels.kv_layout import blocks_packed

from tokenspeed_aio.pd.messages import KvLayout


def kv_layout(k_caches: Sequence, v_caches: Sequence, tp_size: int) -> KvLayout:
    """The layout of per-layer [num_blocks, page_size, heads, head_dim] K and V tensors."""
    k0 = k_caches[0]
    num_blocks, page_size = k0.shape[0], k0.shape[1]
    page_bytes = k0[0].numel() * k0.element_size()
    for cache in (*k_caches, *v_caches):
        if not blocks_packed(cache):
            raise ValueError("the KV transfer needs per-layer KV caches of packed blocks")
    return KvLayout(
        num_layers=len(k_caches),
        page_size=page_size,
        page_bytes=page_bytes,
        num_blocks=num_blocks,
        tp_size=tp_size,
        k_bases=[c.data_ptr() for c in k_caches],
        v_bases=[c.data_ptr() for c in v_caches],
    )


def region_bytes(layout: KvLayout) -> int:
    """Bytes of one layer's K (or V) region."""
    return layout.num_blocks * layout.page_bytes


def write_plan(
    src: KvLayout, dst: KvLayout, src_pages: Sequence[int], dst_pages: Sequence[int]
) -> tuple[list[int], list[int], list[int]]:
    """(source addresses, target addresses, lengths) writing ``src_pages`` of every layer's
    K and V into ``dst_pages`` of the peer's; consecutive pages on both sides go as one
    write."""
    runs: list[tuple[int, int, int]] = []  # (src page, dst page, pages)
    for s, d in zip(src_pages, dst_pages):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    size = src.page_bytes
    sources, targets, lengths = [], [], []
    for layer in range(src.num_layers):
        for sbase, dbase in (
            (src.k_bases[layer], dst.k_bases[layer]),
            (src.v_bases[layer], dst.v_bases[layer]),
        ):
            for s, d, n in runs:
                sources.append(sbase + s * size)
                targets.append(dbase + d * size)
                lengths.append(n * size)
    return sources, targets, lengths
