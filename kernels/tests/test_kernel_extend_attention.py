import pytest
import torch
from kernel_testing import assert_close, gpu_test, make_paged_batch
from tokenspeed_kernels.extend_attention import extend_attention
from tokenspeed_kernels.kv_write import kv_write
from tokenspeed_kernels.reference import paged_attention_reference

# (context, new tokens) per row: a decode-like row, a short chunk over a short prefix, a chunk
# crossing query and key tiles over a prefix that is not tile-aligned, a fresh prefill.
ROWS = [(0, 1), (5, 9), (70, 70), (0, 130)]


def _run(rows, *, group, num_kv_heads=1, head_dim=64, page_size=16, dtype=torch.float32,
         seed=0, scale=0.125, tiles=None):  # fmt: skip
    contexts, query_lens = zip(*rows)
    batch = make_paged_batch(
        list(contexts), list(query_lens), num_q_heads=group * num_kv_heads,
        num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page_size, dtype=dtype,
        seed=seed,
    )  # fmt: skip
    kv_write(batch.k_new, batch.v_new, batch.k_cache, batch.v_cache, batch.slot_mapping)
    out = torch.full_like(batch.q, float("nan"))
    extend_attention(
        batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.query_start_loc,
        batch.seq_lens, max(query_lens), scale, out=out, tiles=tiles,
    )  # fmt: skip
    ref = paged_attention_reference(
        batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.query_start_loc,
        batch.seq_lens, scale,
    )  # fmt: skip
    return out, ref, int(batch.query_start_loc[-1])


@pytest.mark.parametrize(
    "group,num_kv_heads,page_size,head_dim,dtype",
    [
        (1, 2, 1, 64, torch.float32),
        (4, 1, 16, 64, torch.float32),
        (8, 1, 16, 128, torch.float32),
        (1, 1, 16, 128, torch.bfloat16),
        (4, 2, 1, 64, torch.bfloat16),
        (8, 1, 16, 64, torch.bfloat16),
    ],
)
def test_extend_matches_reference(group, num_kv_heads, page_size, head_dim, dtype):
    out, ref, real = _run(ROWS, group=group, num_kv_heads=num_kv_heads, head_dim=head_dim,
                          page_size=page_size, dtype=dtype, seed=group)  # fmt: skip
    assert_close(out[:real], ref[:real])
    assert out[real:].isnan().all(), "the padding token must not be written"


@pytest.mark.parametrize("tiles", [(16, 16, 4, 1), (128, 128, 8, 3), (128, 32, 4, 2)])
def test_extend_tiles_match_reference(tiles):
    """Any (queries, keys) tiling gives the same attention: rows shorter and longer than a
    query tile, prefixes inside and across key tiles."""
    out, ref, real = _run(ROWS + [(200, 150)], group=4, num_kv_heads=2, seed=3, tiles=tiles)
    assert_close(out[:real], ref[:real])
    assert out[real:].isnan().all()


@gpu_test
@pytest.mark.parametrize("group", [1, 4, 8])
def test_extend_long_prefill_gpu(group):
    rows = [(0, 2048), (1000, 1000), (37, 1), (4000, 96), (16, 513)]
    out, ref, real = _run(rows, group=group, num_kv_heads=32 // group, head_dim=128,
                          dtype=torch.bfloat16, seed=group, scale=128**-0.5)  # fmt: skip
    assert_close(out[:real], ref[:real])
