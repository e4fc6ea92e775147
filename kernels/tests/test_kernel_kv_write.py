import pytest
import torch
from kernel_testing import DEVICE, gpu_test, make_paged_batch
from tokenspeed_kernels.kv_write import kv_write
from tokenspeed_kernels.reference import kv_write_reference


def _check(batch) -> None:
    k_ref, v_ref = batch.k_cache.clone(), batch.v_cache.clone()
    kv_write_reference(batch.k_new, batch.v_new, k_ref, v_ref, batch.slot_mapping)
    kv_write(batch.k_new, batch.v_new, batch.k_cache, batch.v_cache, batch.slot_mapping)
    # Exact: a copy (the padding token's slot -1 and every other slot stay untouched).
    assert torch.equal(batch.k_cache, k_ref)
    assert torch.equal(batch.v_cache, v_ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page_size", [1, 16])
def test_kv_write_matches_reference_and_skips_padding(dtype, page_size):
    batch = make_paged_batch(
        [0, 3, 20], [5, 1, 17], num_q_heads=4, num_kv_heads=2, head_dim=64,
        page_size=page_size, dtype=dtype, seed=page_size,
    )  # fmt: skip
    _check(batch)


def test_kv_write_reads_strided_token_rows():
    # k and v as column slices of one fused qkv projection output.
    batch = make_paged_batch([2], [6], num_q_heads=2, num_kv_heads=2, head_dim=64,
                             page_size=16, dtype=torch.float32)  # fmt: skip
    qkv = torch.randn(7, 3 * 128, device=DEVICE)
    batch.k_new = qkv[:, 128:256].view(7, 2, 64)
    batch.v_new = qkv[:, 256:].view(7, 2, 64)
    _check(batch)


@gpu_test
def test_kv_write_large_batch_gpu():
    batch = make_paged_batch(
        [0, 100, 1000, 37] * 16, [300, 1, 20, 64] * 16, num_q_heads=32, num_kv_heads=8,
        head_dim=128, page_size=16, dtype=torch.bfloat16,
    )  # fmt: skip
    _check(batch)
