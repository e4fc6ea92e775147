import pytest
import torch
from kernel_testing import assert_close, gpu_test, make_paged_batch
from tokenspeed_kernels.decode_attention import (
    MAX_KV_SPLITS,
    _decode_split_kernel,
    decode_attention,
    num_kv_splits_for,
)
from tokenspeed_kernels.reference import kv_write_reference, paged_attention_reference

# Length 1, a few tokens, one crossing several splits of 64-key tiles, and a long one.
CONTEXTS = [0, 16, 250, 399]


def _decode_batch(contexts, *, group, num_kv_heads=2, head_dim=64, page_size=16,
                  dtype=torch.float32, seed=0):  # fmt: skip
    batch = make_paged_batch(
        contexts, [1] * len(contexts), num_q_heads=group * num_kv_heads,
        num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page_size, dtype=dtype,
        pad=False, seed=seed,
    )  # fmt: skip
    kv_write_reference(batch.k_new, batch.v_new, batch.k_cache, batch.v_cache, batch.slot_mapping)
    return batch


def _run(batch, num_kv_splits, scale=0.125):
    out = decode_attention(
        batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, scale,
        num_kv_splits,
    )  # fmt: skip
    ref = paged_attention_reference(
        batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.query_start_loc,
        batch.seq_lens, scale,
    )  # fmt: skip
    return out, ref


@pytest.mark.parametrize(
    "group,page_size,head_dim,dtype",
    [
        (1, 1, 64, torch.float32),
        (4, 16, 64, torch.float32),
        (8, 16, 128, torch.float32),
        (8, 1, 64, torch.float32),
        (1, 16, 128, torch.bfloat16),
        (4, 1, 128, torch.bfloat16),
        (8, 16, 64, torch.bfloat16),
        (4, 16, 64, torch.float16),
    ],
)
def test_decode_matches_reference(group, page_size, head_dim, dtype):
    batch = _decode_batch(CONTEXTS, group=group, head_dim=head_dim, page_size=page_size,
                          dtype=dtype, seed=group + page_size)  # fmt: skip
    out, ref = _run(batch, num_kv_splits=4)
    assert out.dtype == dtype
    assert_close(out, ref)


def test_decode_result_does_not_depend_on_split_count():
    batch = _decode_batch([0, 130, 399], group=4)
    outs = [_run(batch, num_kv_splits=s)[0] for s in (1, 3, 7)]
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("splits", [1, 2])  # 1: the split kernel writes the output itself
def test_decode_row_with_no_keys_gives_zeros(splits):
    # A CUDA-graph padding row may carry seq_len 0: it must come out finite (zeros).
    batch = _decode_batch([5, 40], group=2)
    batch.seq_lens[0] = 0
    out, ref = _run(batch, num_kv_splits=splits)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert_close(out[1], ref[1])


def test_decode_single_split_equals_the_merge_of_one_split():
    # One split skips the reduce kernel; merging a single split is exact, so the two paths
    # give the same bits.
    from tokenspeed_kernels.decode_attention import _decode_reduce_kernel

    batch = _decode_batch([0, 130, 399], group=4, dtype=torch.bfloat16, seed=4)
    direct = _run(batch, num_kv_splits=1)[0]
    q = batch.q
    mid_o = torch.empty(*q.shape[:2], 1, q.shape[2], dtype=torch.float32, device=q.device)
    mid_lse = torch.empty(*q.shape[:2], 1, dtype=torch.float32, device=q.device)
    merged = torch.empty_like(q)
    _decode_split_kernel[(3, 2, 1)](
        q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, mid_o, mid_lse,
        merged, 0.125 * 1.4426950408889634, 1, merged.stride(0), merged.stride(1),
        q.stride(0), q.stride(1), *batch.k_cache.stride()[:3], *batch.v_cache.stride()[:3],
        batch.block_tables.stride(0),
        GROUP=4, BLOCK_H=16, HEAD_DIM=64, BLOCK_D=64, PAGE_SIZE=16, BLOCK_N=64, DIRECT=False,
    )  # fmt: skip
    _decode_reduce_kernel[(3, 8)](
        mid_o, mid_lse, batch.seq_lens, merged, 1, merged.stride(0), merged.stride(1),
        HEAD_DIM=64, BLOCK_D=64, BLOCK_N=64,
    )  # fmt: skip
    assert torch.equal(direct, merged)


def test_decode_reads_strided_queries_and_writes_into_out():
    batch = _decode_batch([7, 70], group=2)
    wide = torch.randn(2, 3, *batch.q.shape[1:], device=batch.q.device)
    wide[:, 1] = batch.q
    out = torch.full_like(batch.q, float("nan"))
    decode_attention(wide[:, 1], batch.k_cache, batch.v_cache, batch.block_tables,
                     batch.seq_lens, 0.125, 2, out=out)  # fmt: skip
    assert_close(out, _run(batch, 2)[1])


def test_num_kv_splits_depends_only_on_host_constants():
    assert num_kv_splits_for(1, 8, 4096, 132) == num_kv_splits_for(1, 8, 4096, 132)
    for batch_size in (1, 2, 8, 64, 256):
        for max_len in (1, 100, 4096, 131072):
            splits = num_kv_splits_for(batch_size, 8, max_len, 132)
            assert 1 <= splits <= MAX_KV_SPLITS
    assert num_kv_splits_for(256, 8, 131072, 132) == 1  # the GPU is already full
    assert num_kv_splits_for(1, 8, 200, 132) == 1  # too short to be worth splitting


@gpu_test
@pytest.mark.parametrize("group", [1, 4, 8])
def test_decode_llama_shapes_gpu(group):
    contexts = [0, 1, 15, 16, 17, 255, 1000, 4095] * 8
    batch = _decode_batch(contexts, group=group, num_kv_heads=32 // group, head_dim=128,
                          dtype=torch.bfloat16, seed=group)  # fmt: skip
    for splits in (1, 5, 16):
        out, ref = _run(batch, splits, scale=128**-0.5)
        assert_close(out, ref)


@gpu_test
def test_decode_compiles_once_across_batch_sizes_and_lengths_gpu():
    device = torch.cuda.current_device()
    before = len(_decode_split_kernel.device_caches[device][0])
    for seed, contexts in enumerate([[3], [0, 500, 2000], list(range(0, 3000, 97))]):
        batch = _decode_batch(contexts, group=4, num_kv_heads=8, head_dim=128,
                              dtype=torch.bfloat16, seed=seed)  # fmt: skip
        for splits in (1, 3, num_kv_splits_for(len(contexts), 8, 4096, 132)):
            _run(batch, splits)
    # One variant writing partials, one writing the output (a single split).
    assert len(_decode_split_kernel.device_caches[device][0]) - before <= 2
