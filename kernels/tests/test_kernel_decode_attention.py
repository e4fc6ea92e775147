import pytest
import torch
from kernel_testing import (
    DEVICE,
    assert_close,
    assert_equal_unless_normed_on_gpu,
    gpu_test,
    make_paged_batch,
)
from tokenspeed_kernels.decode_attention import (
    MAX_KV_SPLITS,
    NewToken,
    _decode_split_kernel,
    _new_token_args,
    decode_attention,
    num_kv_splits_for,
)
from tokenspeed_kernels.reference import kv_write_reference, paged_attention_reference
from tokenspeed_kernels.rotary import apply_rotary

from tokenspeed_aio.model.layers.rotary import build_cos_sin_cache

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
        (3, 16, 64, torch.float32),  # groups that are not a power of two: padded merge tiles
        (6, 16, 128, torch.bfloat16),
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


def test_decode_merges_every_split_of_a_row():
    # 2048 keys in 32 splits of one 64-key tile each: the merge's whole split tile is used.
    batch = _decode_batch([2047, 700], group=2, seed=9)
    out, ref = _run(batch, num_kv_splits=MAX_KV_SPLITS)
    assert_close(out, ref)


@pytest.mark.parametrize("splits", [1, 2])  # 1: the split kernel writes the output itself
def test_decode_row_with_no_keys_gives_zeros(splits):
    # A CUDA-graph padding row may carry seq_len 0: it must come out finite (zeros).
    batch = _decode_batch([5, 40], group=2)
    batch.seq_lens[0] = 0
    out, ref = _run(batch, num_kv_splits=splits)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert_close(out[1], ref[1])


def test_decode_single_split_equals_the_merge_of_one_split():
    # One split writes the output directly; merging a single split is exact, so the two paths
    # give the same bits. The merging program zeroes the counters it used.
    batch = _decode_batch([0, 130, 399], group=4, dtype=torch.bfloat16, seed=4)
    direct = _run(batch, num_kv_splits=1)[0]
    q = batch.q
    mid_o = torch.empty(*q.shape[:2], 1, q.shape[2], dtype=torch.float32, device=q.device)
    mid_lse = torch.empty(*q.shape[:2], 1, dtype=torch.float32, device=q.device)
    merged = torch.empty_like(q)
    counters = torch.zeros(3 * 2, dtype=torch.int32, device=q.device)
    _decode_split_kernel[(3, 2, 1)](
        q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, mid_o, mid_lse,
        merged, counters, q, q, 0.125 * 1.4426950408889634, 1, merged.stride(0), merged.stride(1),
        q.stride(0), q.stride(1), *batch.k_cache.stride()[:3], *batch.v_cache.stride(),
        batch.block_tables.stride(0), *_new_token_args(q, batch.k_cache, batch.v_cache, None),
        GROUP=4, BLOCK_H=16, HEAD_DIM=64, BLOCK_D=64, PAGE_SIZE=16, BLOCK_N=64, DIRECT=False,
        BLOCK_G=4, BLOCK_S=MAX_KV_SPLITS, NEW_TOKEN=False, QK_NORM=False, PRECISE=False,
        V_PAGES=False,
    )  # fmt: skip
    assert torch.equal(direct, merged)
    assert not counters.any()


def test_decode_leaves_a_callers_counters_zero_for_the_next_launch():
    batch = _decode_batch([0, 130, 399], group=4, seed=5)
    counters = torch.zeros(16, dtype=torch.int32, device=batch.q.device)
    expected = _run(batch, num_kv_splits=3)[0]
    for _ in range(2):
        out = decode_attention(batch.q, batch.k_cache, batch.v_cache, batch.block_tables,
                               batch.seq_lens, 0.125, 3, counters=counters)  # fmt: skip
        assert torch.equal(out, expected)
        assert not counters.any()


def test_decode_reads_strided_queries_and_writes_into_out():
    batch = _decode_batch([7, 70], group=2)
    wide = torch.randn(2, 3, *batch.q.shape[1:], device=batch.q.device)
    wide[:, 1] = batch.q
    out = torch.full_like(batch.q, float("nan"))
    decode_attention(wide[:, 1], batch.k_cache, batch.v_cache, batch.block_tables,
                     batch.seq_lens, 0.125, 2, out=out)  # fmt: skip
    assert_close(out, _run(batch, 2)[1])


class _NewTokens:
    """A decode batch whose new tokens are not in the cache yet: raw q, k, v as views of one
    qkv output (strided rows, as the model hands them over), positions seq_len - 1, and the
    new tokens' slots poisoned with NaN, so a program that read one before its write would
    show it. ``padding`` rows become graph padding: seq_len 0, slot -1; ``no_slot`` rows keep
    their keys but store nothing (slot -1, as an idle forward's token)."""

    def __init__(self, contexts, *, group, dtype, num_kv_heads=2, head_dim=64, page_size=16,
                 padding=(), no_slot=(), qk_norm=False, seed=0):  # fmt: skip
        batch = make_paged_batch(
            contexts, [1] * len(contexts), num_q_heads=group * num_kv_heads,
            num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page_size, dtype=dtype,
            pad=False, seed=seed,
        )  # fmt: skip
        slots = batch.slot_mapping
        for row in padding:
            batch.seq_lens[row] = 0
        slots[list(padding) + list(no_slot)] = -1
        for cache in (batch.k_cache, batch.v_cache):
            cache.view(-1, num_kv_heads, head_dim)[slots[slots >= 0]] = float("nan")
        n = len(contexts)
        qkv = torch.cat([t.flatten(1) for t in (batch.q, batch.k_new, batch.v_new)], 1)
        q_end, k_end = batch.q[0].numel(), batch.q[0].numel() + batch.k_new[0].numel()
        self.q = qkv[:, :q_end].view(batch.q.shape)
        self.k = qkv[:, q_end:k_end].view(batch.k_new.shape)
        self.v = qkv[:, k_end:].view(batch.v_new.shape)
        self.positions = (batch.seq_lens.long() - 1).clamp(min=0)
        self.cos_sin = build_cos_sin_cache(head_dim, 4096, 10000.0).to(DEVICE)
        self.qk_norm = None
        if qk_norm:
            gen = torch.Generator().manual_seed(seed + 1)
            w = (1 + 0.3 * torch.randn(2, head_dim, generator=gen)).to(DEVICE, dtype)
            self.qk_norm = (w[0], w[1], 1e-6)
        self.batch, self.qkv, self.n = batch, qkv, n

    def unfused(self, splits, scale=0.125):
        """``apply_rotary`` with the cache write, then ``decode_attention``: (out, caches)."""
        b = self.batch
        k_cache, v_cache = b.k_cache.clone(), b.v_cache.clone()
        q, k = self.q.clone(), self.k.clone()
        kv_store = (self.v, k_cache, v_cache, b.slot_mapping)
        apply_rotary(q, k, self.positions, self.cos_sin, kv_store, self.qk_norm)
        out = decode_attention(q, k_cache, v_cache, b.block_tables, b.seq_lens, scale, splits)
        return out, k_cache, v_cache

    def fused(self, splits, scale=0.125):
        b = self.batch
        k_cache, v_cache = b.k_cache.clone(), b.v_cache.clone()
        new = NewToken(self.k, self.v, self.positions, self.cos_sin, b.slot_mapping, self.qk_norm)
        out = decode_attention(self.q, k_cache, v_cache, b.block_tables, b.seq_lens, scale,
                               splits, new_token=new)  # fmt: skip
        return out, k_cache, v_cache


# With 3 splits the new keys (positions 16, 64, 130) fall in splits 0, 1 and 2.
NEW_TOKEN_CONTEXTS = [16, 64, 0, 130, 5]


@pytest.mark.parametrize("qk_norm", [False, True], ids=["rope", "qk_norm"])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_new_token_prologue_equals_apply_rotary_then_decode(dtype, group, splits, qk_norm):
    # Row 2 is a graph padding row (seq_len 0, slot -1), row 4 stores nothing (slot -1).
    batch = _NewTokens(NEW_TOKEN_CONTEXTS, group=group, dtype=dtype, padding=[2], no_slot=[4],
                       qk_norm=qk_norm, seed=group + splits)  # fmt: skip
    qkv = batch.qkv.clone()
    out, k_cache, v_cache = batch.fused(splits)
    want, want_k, want_v = batch.unfused(splits)
    assert_equal_unless_normed_on_gpu(out, want, qk_norm)
    assert_equal_unless_normed_on_gpu(k_cache, want_k, qk_norm)
    assert torch.equal(v_cache, want_v)
    assert torch.equal(batch.qkv, qkv), "q, k and v are only read"
    assert not out.isnan().any(), "a new key was read before it was stored"
    assert torch.equal(out[2], torch.zeros_like(out[2]))


def test_new_token_of_a_row_without_keys_is_stored_by_split_zero():
    # A keyless row still stores its token where apply_rotary would (no program attends it).
    batch = _NewTokens([3, 40], group=2, dtype=torch.float32, padding=[0])
    batch.batch.slot_mapping[0] = 5  # block 0 is the null block: a slot no row reads
    out, k_cache, v_cache = batch.fused(2)
    want, want_k, want_v = batch.unfused(2)
    assert torch.equal(out, want) and torch.equal(out[0], torch.zeros_like(out[0]))
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    assert not torch.equal(k_cache[0, 5], batch.batch.k_cache[0, 5])


@gpu_test
@pytest.mark.parametrize("qk_norm", [False, True], ids=["llama", "qwen3"])
def test_new_token_prologue_8b_shapes_gpu(qk_norm):
    # Llama-3-8B / Qwen3-8B attention (32 q heads on 8 kv heads of 128, bf16) with the rows'
    # new keys in every position of a split; here the splits run at once, so one that read a
    # new key before its writer stored it would read the NaN its slot holds.
    contexts = [0, 1, 15, 16, 17, 63, 64, 255, 1000, 4095] * 4
    rows = len(contexts)
    batch = _NewTokens(contexts + [0, 0], group=4, dtype=torch.bfloat16, num_kv_heads=8,
                       head_dim=128, padding=[rows], no_slot=[rows + 1], qk_norm=qk_norm,
                       seed=7)  # fmt: skip
    scale = 128**-0.5
    for splits in (1, 5, 16):
        out, k_cache, v_cache = batch.fused(splits, scale)
        want, want_k, want_v = batch.unfused(splits, scale)
        assert not out.isnan().any(), "a new key was read before it was stored"
        assert torch.equal(v_cache, want_v)
        if qk_norm:  # the norm's sum of squares may add in another order (rotary.py): an ulp
            torch.testing.assert_close(k_cache.float(), want_k.float(), rtol=1e-2, atol=1e-2)
        else:  # each product rounds alone in both kernels (precise_math.mul_rn)
            assert torch.equal(k_cache, want_k)
        assert_close(out, want)
        assert torch.equal(out[rows], torch.zeros_like(out[rows]))


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
