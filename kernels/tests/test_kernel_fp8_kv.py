"""FP8 (e4m3) KV caches in every kernel that writes or reads one: the stores quantize each head
by its scale as ``fp8.quantize`` does (bit for bit), and attention over an FP8 cache equals
attention over its dequantized values. Each test runs with the V cache in both orders of
``kv_layout``: token-major, and dim-major (the engine's FP8 pools)."""

import pytest
import torch
from kernel_testing import DEVICE, assert_close, dim_major_copy, make_paged_batch
from tokenspeed_kernels import fp8
from tokenspeed_kernels.decode_attention import NewToken, decode_attention
from tokenspeed_kernels.extend_attention import extend_attention
from tokenspeed_kernels.fp8 import Fp8Weight
from tokenspeed_kernels.gemv import norm_gemv
from tokenspeed_kernels.gemv_rope_kv import norm_gemv_rope_kv
from tokenspeed_kernels.kv_write import kv_write
from tokenspeed_kernels.reference import paged_attention_reference
from tokenspeed_kernels.rotary import apply_rotary

from tokenspeed_aio.model.layers.rotary import build_cos_sin_cache

HKV, D = 2, 64


def _scales(seed=0):
    gen = torch.Generator().manual_seed(seed)
    k = (torch.rand(HKV, generator=gen) * 0.02 + 0.005).to(DEVICE)
    v = (torch.rand(HKV, generator=gen) * 0.02 + 0.005).to(DEVICE)
    return k, v


@pytest.fixture(params=["token-major", "dim-major"])
def v_order(request):
    return request.param


def _ordered(v_cache, v_order):
    return dim_major_copy(v_cache) if v_order == "dim-major" else v_cache


def _fp8_batch(contexts, query_lens, v_order, group=2, seed=0):
    batch = make_paged_batch(
        contexts, query_lens, num_q_heads=group * HKV, num_kv_heads=HKV, head_dim=D,
        page_size=16, dtype=torch.bfloat16, seed=seed,
    )  # fmt: skip
    scales = _scales(seed)
    batch.k_cache = fp8.quantize(batch.k_cache, scales[0][:, None])
    batch.v_cache = _ordered(fp8.quantize(batch.v_cache, scales[1][:, None]), v_order)
    return batch, scales


def _quantized(x, scale):
    return fp8.quantize(x, scale[:, None])


def _dequantized(cache, scale):
    return (cache.float() * scale[:, None]).to(torch.bfloat16)


def test_kv_write_quantizes_each_head_by_its_scale(v_order):
    batch, (ks, vs) = _fp8_batch([5, 0], [3, 4], v_order)
    k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()
    kv_write(batch.k_new, batch.v_new, k_cache, v_cache, batch.slot_mapping, (ks, vs))
    slots = batch.slot_mapping[:-1]  # the last token is padding: written nowhere
    flat = k_cache.flatten(0, 1)
    assert torch.equal(flat[slots].float(), _quantized(batch.k_new[:-1], ks).float())
    assert torch.equal(
        v_cache.flatten(0, 1)[slots].float(), _quantized(batch.v_new[:-1], vs).float()
    )
    untouched = torch.ones(flat.shape[0], dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    assert torch.equal(flat[untouched].float(), batch.k_cache.flatten(0, 1)[untouched].float())


def test_values_beyond_the_scales_range_saturate(v_order):
    """A value past 448 * scale (a later prompt above a calibrated scale's amax) stores as
    +-448, never NaN: e4m3 has no infinity and its one NaN sits right above 448."""
    batch, (ks, vs) = _fp8_batch([5, 0], [3, 4], v_order)
    k_new, v_new = batch.k_new * 1000, batch.v_new * 1000  # |x| / scale up to ~1e6
    assert float((k_new[:-1].float().abs() / ks[:, None]).amax()) > 448 * 100
    want_k, want_v = _quantized(k_new[:-1], ks), _quantized(v_new[:-1], vs)
    assert float(want_k.float().abs().amax()) == 448 and not want_k.float().isnan().any()
    slots = batch.slot_mapping[:-1]
    k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()
    kv_write(k_new, v_new, k_cache, v_cache, batch.slot_mapping, (ks, vs))
    assert torch.equal(k_cache.flatten(0, 1)[slots].float(), want_k.float())
    assert torch.equal(v_cache.flatten(0, 1)[slots].float(), want_v.float())
    cos_sin = build_cos_sin_cache(D, 256, 10000.0, None).to(DEVICE)
    k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()
    q = batch.q.clone()
    positions = torch.arange(k_new.shape[0], device=DEVICE)
    apply_rotary(q, k_new.clone(), positions, cos_sin, (v_new, k_cache, v_cache,
                 batch.slot_mapping), None, (ks, vs))  # fmt: skip
    stored = k_cache.flatten(0, 1)[slots].float()
    assert not stored.isnan().any() and float(stored.abs().amax()) == 448
    assert torch.equal(v_cache.flatten(0, 1)[slots].float(), want_v.float())


@pytest.mark.parametrize("splits", [1, 3])
def test_decode_over_an_fp8_cache_is_decode_over_its_values(splits, v_order):
    batch, (ks, vs) = _fp8_batch([0, 40, 150], [1, 1, 1], v_order, group=4)
    out = decode_attention(
        batch.q[:3], batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, 0.125,
        splits, kv_scales=(ks, vs),
    )  # fmt: skip
    ref = paged_attention_reference(
        batch.q[:3], _dequantized(batch.k_cache, ks), _dequantized(batch.v_cache, vs),
        batch.block_tables, batch.query_start_loc, batch.seq_lens, 0.125,
    )  # fmt: skip
    assert_close(out, ref)


def test_unsplit_decode_over_an_fp8_cache_is_the_same_alone_and_in_a_batch(v_order):
    # The batch-invariant mode's launch (one split a row): a row's keys are summed in the same
    # tiles whatever the batch, so the row alone is the row beside another bit for bit.
    batch, scales = _fp8_batch([150, 200], [1, 1], v_order, group=4, seed=2)
    args = (batch.k_cache, batch.v_cache)
    both = decode_attention(
        batch.q[:2], *args, batch.block_tables, batch.seq_lens, 0.125, 1, kv_scales=scales
    )
    alone = decode_attention(
        batch.q[1:2], *args, batch.block_tables[1:2], batch.seq_lens[1:2], 0.125, 1,
        kv_scales=scales,
    )  # fmt: skip
    assert torch.equal(alone, both[1:2])


def test_decode_new_token_store_is_the_rotary_store(v_order):
    batch, scales = _fp8_batch([7, 33], [1, 1], v_order, group=2, seed=3)
    cos_sin = build_cos_sin_cache(D, 256, 10000.0, None).to(DEVICE)
    positions = batch.context_lens.long()
    rows = 2
    k, v, slots = batch.k_new[:rows], batch.v_new[:rows], batch.slot_mapping[:rows]
    caches = [(batch.k_cache.clone(), batch.v_cache.clone()) for _ in range(2)]
    q1 = batch.q[:rows].clone()
    apply_rotary(q1, k.clone(), positions, cos_sin, (v, *caches[0], slots), None, scales)
    want = decode_attention(q1, *caches[0], batch.block_tables, batch.seq_lens, 0.125, 2,
                            kv_scales=scales)  # fmt: skip
    new = NewToken(k, v, positions, cos_sin, slots)
    got = decode_attention(batch.q[:rows], *caches[1], batch.block_tables, batch.seq_lens,
                           0.125, 2, new_token=new, kv_scales=scales)  # fmt: skip
    assert torch.equal(caches[0][0].float(), caches[1][0].float())
    assert torch.equal(caches[0][1].float(), caches[1][1].float())
    assert torch.equal(got, want)


def test_extend_over_an_fp8_cache_is_extend_over_its_values(v_order):
    batch, (ks, vs) = _fp8_batch([0, 20], [37, 9], v_order, group=2, seed=5)
    kv_write(batch.k_new, batch.v_new, batch.k_cache, batch.v_cache, batch.slot_mapping,
             (ks, vs))  # fmt: skip
    out = extend_attention(
        batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.query_start_loc,
        batch.seq_lens, 37, 0.125, kv_scales=(ks, vs),
    )  # fmt: skip
    ref = paged_attention_reference(
        batch.q, _dequantized(batch.k_cache, ks), _dequantized(batch.v_cache, vs),
        batch.block_tables, batch.query_start_loc, batch.seq_lens, 0.125,
    )  # fmt: skip
    assert_close(out[:-1], ref[:-1])


def test_fp8_qkv_product_with_rope_and_fp8_kv_epilogue_is_the_unfused_pair(v_order):
    hq, k_dim = 4, 128
    rows = (hq + 2 * HKV) * D
    wq, s = fp8.quantize_weight(torch.randn(rows, k_dim) / k_dim**0.5, "channel")
    w = Fp8Weight(wq.to(DEVICE), s.to(DEVICE))
    gen = torch.Generator().manual_seed(7)
    x, r = (torch.randn(1, k_dim, generator=gen).to(DEVICE, torch.bfloat16) for _ in range(2))
    g = torch.randn(k_dim, generator=gen).to(DEVICE, torch.bfloat16)
    cos_sin = build_cos_sin_cache(D, 64, 10000.0, None).to(DEVICE)
    positions = torch.tensor([9], device=DEVICE)
    slot = torch.tensor([37], device=DEVICE)
    scales = _scales(9)
    shape = (4, 16, HKV, D)
    zeros = torch.zeros(shape, dtype=fp8.FP8, device=DEVICE)
    fused, plain = ([zeros.clone(), _ordered(zeros, v_order).clone()] for _ in range(2))
    config = (8, 128, 4, 1, True)
    q, h = norm_gemv_rope_kv(x, r, g, 1e-6, w, None, positions, cos_sin, *fused, slot, config,
                             scales)  # fmt: skip
    qkv, h_ref = norm_gemv(x, r, g, 1e-6, w, None, (16, 128, 4, 1, True))
    q_ref, k_ref, v_ref = qkv.view(1, -1, D).split([hq, HKV, HKV], dim=1)
    q_ref = q_ref.contiguous()
    apply_rotary(q_ref, k_ref.contiguous(), positions, cos_sin, (v_ref, *plain, slot), None,
                 scales)  # fmt: skip
    assert torch.equal(h, h_ref) and torch.equal(q.view(1, hq, D), q_ref)
    assert torch.equal(fused[0].float(), plain[0].float())
    assert torch.equal(fused[1].float(), plain[1].float())
