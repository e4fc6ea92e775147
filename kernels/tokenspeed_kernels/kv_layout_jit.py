"""``kv_layout``'s slot addressing as a Triton helper, for the kernels."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def slot_offset(slot, page_size, stride_block, stride_page):
    """Offset (int64) of ``slot``'s token in a cache with these strides (``kv_layout``)."""
    s = slot.to(tl.int64)
    return (s // page_size) * stride_block + (s % page_size) * stride_page
