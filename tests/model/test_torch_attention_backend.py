"""The torch backend against a per-row reference, on raw tensors (no model)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenspeed_aio.model.attention.registry import create_backend
from tokenspeed_aio.model.forward_context import AttentionMetadata, ForwardContext
from tokenspeed_aio.model.kv_cache import allocate_kv_cache

PAGE, HQ, HKV, D = 4, 4, 2, 8


def _reference(q, k, v):
    """Causal attention of the last len(q) positions over all of k/v ([S, H, D])."""
    s, n = k.shape[0], q.shape[0]
    mask = torch.ones(n, s, dtype=torch.bool).tril(diagonal=s - n)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.repeat_interleave(HQ // HKV, 1).transpose(0, 1),
        v.repeat_interleave(HQ // HKV, 1).transpose(0, 1),
        attn_mask=mask,
    )
    return out.transpose(0, 1).flatten(1)


def test_rows_attend_causally_over_cached_prefix_and_padding_writes_nothing():
    gen = torch.Generator().manual_seed(0)
    k_caches, v_caches = allocate_kv_cache(1, 16, PAGE, HKV, D, torch.float32, "cpu")
    # Three rows: a decode over 6 cached tokens, a chunk of 5 after 3 cached, a fresh 7.
    context, query = [6, 3, 0], [1, 5, 7]
    tables = [[5, 9, 0], [12, 2, 0], [7, 3, 0]]
    full_k = [torch.randn(c + q, HKV, D, generator=gen) for c, q in zip(context, query)]
    full_v = [torch.randn(c + q, HKV, D, generator=gen) for c, q in zip(context, query)]
    slots = []
    for row, (c, q) in enumerate(zip(context, query)):
        for pos in range(c + q):
            slot = tables[row][pos // PAGE] * PAGE + pos % PAGE
            if pos < c:  # the cached prefix is already in the cache
                k_caches[0].view(-1, HKV, D)[slot] = full_k[row][pos]
                v_caches[0].view(-1, HKV, D)[slot] = full_v[row][pos]
            else:
                slots.append(slot)
    slots.append(-1)  # one padding token at the end: must write nothing
    num_tokens = sum(query) + 1
    q = torch.randn(num_tokens, HQ * D, generator=gen)
    k = torch.cat([fk[c:] for fk, c in zip(full_k, context)] + [torch.full((1, HKV, D), 9.0)])
    v = torch.cat([fv[c:] for fv, c in zip(full_v, context)] + [torch.full((1, HKV, D), 9.0)])
    seq_lens = [c + n for c, n in zip(context, query)]
    attn = AttentionMetadata(
        num_tokens=num_tokens,
        num_rows=3,
        max_query_len=max(query),
        max_seq_len=max(seq_lens),
        is_decode_only=False,
        query_start_loc=torch.tensor([0, 1, 6, 13], dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        context_lens=torch.tensor(context, dtype=torch.int32),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        slot_mapping=torch.tensor(slots),
        query_lens_host=tuple(query),
        seq_lens_host=tuple(seq_lens),
    )
    backend = create_backend("torch")
    ctx = ForwardContext(attn, backend, k_caches, v_caches)
    out = backend.forward(q, k.flatten(1), v.flatten(1), 0, ctx)

    assert out.shape == (num_tokens, HQ * D)
    assert k_caches[0][0].abs().sum() == 0 and v_caches[0][0].abs().sum() == 0  # null block
    starts = [0, 1, 6]
    for row, (s, n) in enumerate(zip(starts, query)):
        want = _reference(q[s : s + n].view(n, HQ, D), full_k[row], full_v[row])
        torch.testing.assert_close(out[s : s + n], want, atol=1e-5, rtol=1e-5)


def test_qk_norm_norms_each_head_before_rope_and_the_cache_write():
    from tokenspeed_aio.model.layers.norm import RMSNorm
    from tokenspeed_aio.model.layers.rotary import RotaryEmbedding

    gen = torch.Generator().manual_seed(1)
    n, tables = 6, [[3, 5]]
    attn = AttentionMetadata(
        num_tokens=n,
        num_rows=1,
        max_query_len=n,
        max_seq_len=n,
        is_decode_only=False,
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32),
        context_lens=torch.tensor([0], dtype=torch.int32),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        slot_mapping=torch.tensor([tables[0][p // PAGE] * PAGE + p % PAGE for p in range(n)]),
        query_lens_host=(n,),
        seq_lens_host=(n,),
    )
    rope = (RotaryEmbedding(D, 64, 10000.0), torch.arange(n))
    q_norm, k_norm = RMSNorm(D, 1e-6), RMSNorm(D, 1e-6)
    for norm in (q_norm, k_norm):
        norm.weight.data = 1 + 0.3 * torch.randn(D, generator=gen)
    q = 3 * torch.randn(n, HQ * D, generator=gen)
    k, v = 3 * torch.randn(n, HKV * D, generator=gen), torch.randn(n, HKV * D, generator=gen)
    backend = create_backend("torch")
    ctx = ForwardContext(
        attn, backend, *allocate_kv_cache(1, 8, PAGE, HKV, D, torch.float32, "cpu")
    )
    out = backend.forward(q, k, v, 0, ctx, rope, (q_norm, k_norm))

    normed_q = q_norm(q.view(n, HQ, D)).flatten(1)
    normed_k = k_norm(k.view(n, HKV, D)).flatten(1)
    ref = ForwardContext(
        attn, backend, *allocate_kv_cache(1, 8, PAGE, HKV, D, torch.float32, "cpu")
    )
    assert torch.equal(out, backend.forward(normed_q, normed_k, v, 0, ref, rope))
    assert torch.equal(ctx.k_caches[0], ref.k_caches[0])
    assert torch.equal(ctx.v_caches[0], ref.v_caches[0])


def test_backends_ignore_construction_hints_they_do_not_need():
    backend = create_backend("torch", max_model_len=4096)
    assert backend.name == "torch" and not backend.supports_cuda_graphs


def test_unknown_backend_names_the_available_ones():
    with pytest.raises(ValueError, match=r"unknown attention backend 'nope'.*torch"):
        create_backend("nope")


def test_backend_with_missing_dependency_fails_clearly(monkeypatch):
    from tokenspeed_aio.model.attention import registry

    def factory():
        raise ImportError("No module named 'flashinfer'")

    monkeypatch.setitem(registry._FACTORIES, "flashinfer", factory)
    with pytest.raises(ValueError, match=r"'flashinfer' is unavailable.*No module named"):
        create_backend("flashinfer")


def test_an_fp8_cache_stores_non_finite_values_as_finite_ones():
    # A slot past a row's length on its last page is still read (weighted by zero) by the
    # kernels' page-at-a-time V loads, so a NaN a block's earlier owner left there would
    # poison the next owner's rows: every e4m3 store saturates infinities and takes NaN to
    # -448, as the kernels' conversion does.
    from tokenspeed_kernels import fp8

    from tokenspeed_aio.model.attention.torch_backend import store_kv

    (k_cache,), (v_cache,) = allocate_kv_cache(
        1, 3, PAGE, HKV, D, dtype=fp8.FP8, device=torch.device("cpu")
    )
    k = torch.full((2, HKV, D), float("nan"))
    v = torch.full((2, HKV, D), float("inf"))
    v[1] = -float("inf")
    scales = (torch.ones(HKV), torch.full((HKV,), 0.5))
    store_kv(k, v, k_cache, v_cache, torch.tensor([PAGE, PAGE + 1]), scales)
    k_stored, v_stored = k_cache.float()[1, :2], v_cache.float()[1, :2]
    assert torch.equal(k_stored, torch.full_like(k_stored, -448.0))
    assert torch.equal(v_stored[0], torch.full_like(v_stored[0], 448.0))
    assert torch.equal(v_stored[1], torch.full_like(v_stored[1], -448.0))
