import pytest
import torch
from kernel_testing import forward_context, gpu_test, make_paged_batch

from tokenspeed_aio.model.attention.torch_backend import TorchAttentionBackend
from tokenspeed_aio.model.attention.triton_backend import TritonAttentionBackend
from tokenspeed_aio.model.layers.rotary import RotaryEmbedding


def _compare(contexts, query_lens, *, pad, dtype=torch.float32, heads=(4, 2), head_dim=64,
             page_size=16, tol=1e-4, max_model_len=4096, rope=False):  # fmt: skip
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
        outs.append(backend.forward(q, k, v, 1, ctx, (rotary, positions) if rope else None))
        caches.append(ctx.k_caches[1])
        assert torch.equal(ctx.k_caches[0], batch.k_cache), "another layer's cache was touched"
    assert outs[0].shape == (n, heads[0] * head_dim)
    assert torch.equal(caches[0], caches[1])
    real = sum(query_lens)
    torch.testing.assert_close(outs[0][:real], outs[1][:real], rtol=tol, atol=tol)
    assert torch.equal(outs[0][real:], torch.zeros_like(outs[0][real:])), "padding must be 0"


@pytest.mark.parametrize("pad", [False, True])
def test_triton_backend_decode_matches_torch_backend(pad):
    _compare([0, 9, 40, 130], [1, 1, 1, 1], pad=pad)


def test_triton_backend_mixed_batch_matches_torch_backend():
    _compare([5, 0, 33], [1, 20, 7], pad=True)


@pytest.mark.parametrize("query_lens", [[1, 1, 1], [1, 20, 7]])
def test_triton_backend_rope_fused_with_the_cache_write_matches_torch_backend(query_lens):
    # RoPE and the cache write in one launch; the cached keys must equal the torch
    # backend's rotate-then-store bit for bit (checked in _compare), padding writes nothing.
    _compare([5, 0, 33], query_lens, pad=True, rope=True)


@gpu_test
def test_triton_backend_decode_replays_in_a_cuda_graph_gpu():
    # Blocks for two decode steps: step 1 writes position c, step 2 position c + 1.
    contexts = [0, 100, 1000, 4000] * 4
    n = len(contexts)
    batch = make_paged_batch([c + 1 for c in contexts], [1] * n, num_q_heads=32, num_kv_heads=8,
                             head_dim=128, page_size=16, dtype=torch.bfloat16, pad=False)  # fmt: skip
    ctx = forward_context(batch, None, [c + 1 for c in contexts], [1] * n)
    attn = ctx.attn

    def step(position_offset: int) -> None:
        attn.seq_lens.copy_(torch.tensor(contexts, device="cuda") + 1 + position_offset)
        slots = [_slot(batch, b, c + position_offset) for b, c in enumerate(contexts)]
        attn.slot_mapping.copy_(torch.tensor(slots, device="cuda"))
        for t in (q, k, v):
            t.copy_(torch.randn_like(t))

    q, k, v = (t.reshape(n, -1) for t in (batch.q, batch.k_new, batch.v_new))
    backend = TritonAttentionBackend(max_model_len=8192)
    step(0)
    backend.forward(q, k, v, 0, ctx)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(q, k, v, 0, ctx)
    for offset in (0, 1):  # replay on new values in the same buffers, no Python
        step(offset)
        graph.replay()
        k_cache = ctx.k_caches[0].clone()
        expected = TorchAttentionBackend().forward(q, k, v, 0, ctx)
        assert torch.equal(ctx.k_caches[0], k_cache), "the graph must have written k already"
        torch.testing.assert_close(out.float(), expected.float(), rtol=2e-2, atol=2e-2)


def _slot(batch, row, position):
    page_size = batch.k_cache.shape[1]
    return int(batch.block_tables[row, position // page_size]) * page_size + position % page_size
