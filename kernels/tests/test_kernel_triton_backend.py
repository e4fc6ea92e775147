import pytest
import torch
from kernel_testing import (
    DEVICE,
    assert_equal_unless_normed_on_gpu,
    forward_context,
    gpu_test,
    make_paged_batch,
)

from tokenspeed_aio.model.attention.torch_backend import TorchAttentionBackend
from tokenspeed_aio.model.attention.triton_backend import TritonAttentionBackend
from tokenspeed_aio.model.layers.rotary import RotaryEmbedding


def _compare(contexts, query_lens, *, pad, dtype=torch.float32, heads=(4, 2), head_dim=64,
             page_size=16, tol=1e-4, max_model_len=4096, rope=False, qk_norm=None):  # fmt: skip
    batch = make_paged_batch(contexts, query_lens, num_q_heads=heads[0], num_kv_heads=heads[1],
                             head_dim=head_dim, page_size=page_size, dtype=dtype, pad=pad)  # fmt: skip
    n = batch.q.shape[0]
    positions = [c + j for c, ql in zip(contexts, query_lens) for j in range(ql)]
    positions = torch.tensor(positions + [0] * (n - len(positions)), device=batch.q.device)
    rotary = RotaryEmbedding(head_dim, 4096, 10000.0).to(batch.q.device)
    outs, caches = [], []
    for backend in (TritonAttentionBackend(max_model_len=max_model_len), TorchAttentionBackend()):
        # Fresh q/k each time: the Triton backend rotates them in place.
        q, k, v = (t.reshape(n, -1).clone() for t in (batch.q, batch.k_new, batch.v_new))
        ctx = forward_context(batch, backend, contexts, query_lens)
        rope_arg = (rotary, positions) if rope else None
        outs.append(backend.forward(q, k, v, 1, ctx, rope_arg, qk_norm))
        caches.append(ctx.k_caches[1])
        assert torch.equal(ctx.k_caches[0], batch.k_cache), "another layer's cache was touched"
    assert outs[0].shape == (n, heads[0] * head_dim)
    if qk_norm is None or not rope:
        assert torch.equal(caches[0], caches[1])
    else:  # the fused norm rounds as the rms_norm kernel, the torch backend's as torch's ops
        torch.testing.assert_close(caches[0], caches[1], rtol=tol, atol=tol)
    real = sum(query_lens)
    torch.testing.assert_close(outs[0][:real], outs[1][:real], rtol=tol, atol=tol)
    assert torch.equal(outs[0][real:], torch.zeros_like(outs[0][real:])), "padding must be 0"


@pytest.mark.parametrize("pad", [False, True])
def test_triton_backend_decode_matches_torch_backend(pad):
    _compare([0, 9, 40, 130], [1, 1, 1, 1], pad=pad)


@pytest.mark.parametrize(
    "contexts,query_lens",
    [
        ([5, 0, 33], [1, 20, 7]),
        # Three decode rows (the decode kernel, split) before two chunks (the extend kernel
        # from row 3), one of them a one-token chunk.
        ([9, 40, 130, 0, 33, 12], [1, 1, 1, 20, 7, 1]),
    ],
)
def test_triton_backend_mixed_batch_matches_torch_backend(contexts, query_lens):
    _compare(contexts, query_lens, pad=True)


def test_triton_backend_mixed_batch_with_one_kv_split(monkeypatch):
    # Many decode rows take one split (the decode kernel writes out itself).
    monkeypatch.setattr(TritonAttentionBackend, "num_kv_splits", lambda *_: 1)
    _compare([9, 40, 130, 0], [1, 1, 1, 20], pad=True)


@pytest.mark.parametrize("query_lens", [[1, 1, 1], [1, 20, 7]])
def test_triton_backend_rope_fused_with_the_cache_write_matches_torch_backend(query_lens):
    # RoPE and the cache write in one launch; the cached keys must equal the torch
    # backend's rotate-then-store bit for bit (checked in _compare), padding writes nothing.
    _compare([5, 0, 33], query_lens, pad=True, rope=True)


def _qk_norms(head_dim, device, eps=1e-5):
    from tokenspeed_aio.model.layers.norm import RMSNorm

    gen = torch.Generator().manual_seed(5)
    norms = (RMSNorm(head_dim, eps), RMSNorm(head_dim, eps))
    for norm in norms:
        norm.weight.data = 1 + 0.3 * torch.randn(head_dim, generator=gen)
    return tuple(norm.to(device) for norm in norms)


@pytest.mark.parametrize("query_lens", [[1, 1, 1], [1, 20, 7]])
def test_triton_backend_qk_norm_in_the_rope_launch_equals_rms_norm_then_forward(query_lens):
    # Qwen3: the backend norms each q and k head in its one RoPE + cache-write launch; that
    # equals the heads normed by the rms_norm kernel, then the forward without norms.
    from tokenspeed_kernels.rmsnorm import rms_norm

    contexts = [5, 0, 33]
    batch = make_paged_batch(contexts, query_lens, num_q_heads=4, num_kv_heads=2, head_dim=64,
                             page_size=16, dtype=torch.float32, pad=True)  # fmt: skip
    n = batch.q.shape[0]
    positions = [c + j for c, ql in zip(contexts, query_lens) for j in range(ql)] + [0]
    rope = (RotaryEmbedding(64, 4096, 10000.0).to(DEVICE), torch.tensor(positions, device=DEVICE))
    q_norm, k_norm = _qk_norms(64, DEVICE)
    backend = TritonAttentionBackend(max_model_len=4096)
    q, k, v = (t.reshape(n, -1).clone() for t in (batch.q, batch.k_new, batch.v_new))
    ctx = forward_context(batch, backend, contexts, query_lens)
    out = backend.forward(q, k, v, 1, ctx, rope, (q_norm, k_norm))

    qn = rms_norm(batch.q, q_norm.weight, q_norm.eps).flatten(1)
    kn = rms_norm(batch.k_new, k_norm.weight, k_norm.eps).flatten(1)
    ref_ctx = forward_context(batch, backend, contexts, query_lens)
    want = backend.forward(qn, kn, v, 1, ref_ctx, rope)
    assert_equal_unless_normed_on_gpu(out, want, True)
    assert_equal_unless_normed_on_gpu(ctx.k_caches[1], ref_ctx.k_caches[1], True)
    assert torch.equal(ctx.v_caches[1], ref_ctx.v_caches[1])


@pytest.mark.parametrize("rope", [True, False], ids=["rope", "no_rope"])
def test_triton_backend_with_qk_norm_matches_torch_backend(rope):
    # With rope: the fused launch; without: the norm layers, then the cache write.
    _compare([5, 0, 33], [1, 20, 7], pad=True, rope=rope, qk_norm=_qk_norms(64, DEVICE))


@pytest.mark.parametrize("qk_norm", [False, True], ids=["rope", "qk_norm"])
def test_triton_backend_decode_stores_the_new_tokens_inside_the_attention_launch(
    qk_norm, monkeypatch
):
    # A decode-only forward with RoPE over whole heads launches no rotary kernel: the decode
    # kernel norms, rotates and stores the new tokens itself, to the same bits as the store
    # launch followed by ``attend``. The last token is padding (slot -1).
    from tokenspeed_aio.model.attention import kv_store

    contexts = [5, 0, 33, 70]
    batch = make_paged_batch(contexts, [1] * 4, num_q_heads=8, num_kv_heads=2, head_dim=64,
                             page_size=16, dtype=torch.bfloat16, pad=True)  # fmt: skip
    n = batch.q.shape[0]
    positions = torch.tensor([*contexts, 0], device=DEVICE)
    rope = (RotaryEmbedding(64, 4096, 10000.0).to(DEVICE), positions)
    norms = _qk_norms(64, DEVICE) if qk_norm else None
    backend = TritonAttentionBackend(max_model_len=4096)

    def run(forward):
        q, k, v = (t.reshape(n, -1).clone() for t in (batch.q, batch.k_new, batch.v_new))
        ctx = forward_context(batch, backend, contexts, [1] * 4)
        return forward(q, k, v, 1, ctx, rope, norms), ctx

    want, want_ctx = run(lambda *args: kv_store.StoredKVBackend.forward(backend, *args))

    def no_rotary_launch(*args, **kwargs):
        raise AssertionError("the decode path launched the rotary kernel")

    monkeypatch.setattr(kv_store, "apply_rotary", no_rotary_launch)
    out, ctx = run(backend.forward)
    assert_equal_unless_normed_on_gpu(out, want, qk_norm)
    assert torch.equal(out[-1], torch.zeros_like(out[-1])), "padding must be 0"
    assert_equal_unless_normed_on_gpu(ctx.k_caches[1], want_ctx.k_caches[1], qk_norm)
    assert torch.equal(ctx.v_caches[1], want_ctx.v_caches[1])


@gpu_test
@pytest.mark.parametrize("rope", [False, True], ids=["no_rope", "rope"])
def test_triton_backend_decode_replays_in_a_cuda_graph_gpu(rope):
    # With rope the decode kernel rotates and stores the new tokens itself, reading their
    # positions and slots from the graph's buffers.
    # Blocks for two decode steps: step 1 writes position c, step 2 position c + 1.
    contexts = [0, 100, 1000, 4000] * 4
    n = len(contexts)
    batch = make_paged_batch([c + 1 for c in contexts], [1] * n, num_q_heads=32, num_kv_heads=8,
                             head_dim=128, page_size=16, dtype=torch.bfloat16, pad=False)  # fmt: skip
    ctx = forward_context(batch, None, [c + 1 for c in contexts], [1] * n)
    attn = ctx.attn
    positions = torch.zeros(n, dtype=torch.int64, device="cuda")
    rope_arg = (RotaryEmbedding(128, 8192, 10000.0).to("cuda"), positions) if rope else None

    def step(position_offset: int) -> None:
        attn.seq_lens.copy_(torch.tensor(contexts, device="cuda") + 1 + position_offset)
        positions.copy_(torch.tensor(contexts, device="cuda") + position_offset)
        slots = [_slot(batch, b, c + position_offset) for b, c in enumerate(contexts)]
        attn.slot_mapping.copy_(torch.tensor(slots, device="cuda"))
        for t in (q, k, v):
            t.copy_(torch.randn_like(t))

    q, k, v = (t.reshape(n, -1) for t in (batch.q, batch.k_new, batch.v_new))
    backend = TritonAttentionBackend(max_model_len=8192)
    step(0)
    backend.forward(q, k, v, 0, ctx, rope_arg)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(q, k, v, 0, ctx, rope_arg)
    for offset in (0, 1):  # replay on new values in the same buffers, no Python
        step(offset)
        graph.replay()
        k_cache = ctx.k_caches[0].clone()
        # With rope it rotates as the graph does (apply_rotary on CUDA), so stores the same k.
        expected = TorchAttentionBackend().forward(q, k, v, 0, ctx, rope_arg)
        assert torch.equal(ctx.k_caches[0], k_cache), "the graph must have written k already"
        torch.testing.assert_close(out.float(), expected.float(), rtol=2e-2, atol=2e-2)


def _slot(batch, row, position):
    page_size = batch.k_cache.shape[1]
    return int(batch.block_tables[row, position // page_size]) * page_size + position % page_size
