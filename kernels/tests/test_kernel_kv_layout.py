"""The two page orders of ``kv_layout``: a dim-major view keeps the shape and each block's
span, slot addressing agrees with torch indexing, and other memory orders are refused."""

import pytest
import torch
from tokenspeed_kernels import kv_layout


def test_dim_major_keeps_the_shape_and_each_blocks_bytes():
    cache = torch.arange(3 * 4 * 2 * 8, dtype=torch.float32).view(3, 4, 2, 8)
    view = kv_layout.dim_major(cache)
    assert view.shape == cache.shape and view.data_ptr() == cache.data_ptr()
    assert kv_layout.is_dim_major(view) and not kv_layout.is_dim_major(cache)
    # block 1's values are the same 64 elements, ordered [head, dim, token]
    assert torch.equal(view[1].permute(1, 2, 0).flatten(), cache[1].flatten())
    assert kv_layout.strides(view) == (64, 1, 32, 4)
    assert kv_layout.strides(cache) == (64, 16, 8, 1)


def test_slots_address_both_orders_alike():
    token = torch.zeros(5, 4, 2, 8)
    dim = kv_layout.dim_major(torch.zeros(5, 4, 2, 8))
    slot_mapping = torch.tensor([0, 5, 19, 7])
    values = torch.randn(4, 2, 8)
    for cache in (token, dim):
        cache[kv_layout.slots(cache, slot_mapping)] = values
    assert torch.equal(token, dim)
    assert torch.equal(token[1, 1], values[1])  # slot 5: block 1, offset 1


def test_other_orders_are_refused():
    head_major = torch.zeros(3, 2, 4, 8).permute(0, 2, 1, 3)  # [block, page, head, dim] view
    assert not kv_layout.blocks_packed(head_major)
    with pytest.raises(ValueError, match="packed token- or dim-major"):
        kv_layout.strides(head_major)
    assert kv_layout.blocks_packed(torch.zeros(3, 4, 2, 8))
    assert kv_layout.dim_major(torch.zeros(3, 1, 2, 8)).stride(3) == 1  # one token a page
