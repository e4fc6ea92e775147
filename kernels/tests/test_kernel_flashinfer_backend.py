"""The FlashInfer backend against the torch reference: eager (decode, prefill over a cached
prefix, mixed) and CUDA-graph decode replayed on new lengths. GPU-only, and only where the
optional ``flashinfer`` package is installed."""

import importlib.util

import numpy as np
import pytest
import torch
from kernel_testing import assert_close, forward_context, gpu_test, make_paged_batch

from tokenspeed_aio.model.attention.torch_backend import TorchAttentionBackend
from tokenspeed_aio.model.forward_context import AttentionMetadata, ForwardContext
from tokenspeed_aio.model.layers.rotary import RotaryEmbedding

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("flashinfer") is None,
    reason="the optional flashinfer package is not installed",
)
HEADS, HEAD_DIM, PAGE = (32, 8), 128, 16


def _backend():
    from tokenspeed_aio.model.attention.flashinfer_backend import FlashInferAttentionBackend

    return FlashInferAttentionBackend(
        page_size=PAGE, num_q_heads=HEADS[0], num_kv_heads=HEADS[1], head_dim=HEAD_DIM,
        dtype=torch.bfloat16, device=torch.device("cuda"), max_model_len=8192,
    )  # fmt: skip


def _batch(contexts, query_lens, pad):
    return make_paged_batch(contexts, query_lens, num_q_heads=HEADS[0], num_kv_heads=HEADS[1],
                            head_dim=HEAD_DIM, page_size=PAGE, dtype=torch.bfloat16, pad=pad)  # fmt: skip


def _host(batch):
    return (batch.seq_lens.cpu().numpy(), batch.block_tables.cpu().numpy())


@gpu_test
@pytest.mark.parametrize(
    "contexts, query_lens", [([0, 9, 40, 1300], [1, 1, 1, 1]), ([5, 0, 33, 700], [1, 20, 7, 130])]
)
@pytest.mark.parametrize("rope", [False, True])
def test_flashinfer_backend_matches_torch_backend_gpu(contexts, query_lens, rope):
    batch = _batch(contexts, query_lens, pad=True)
    n = batch.q.shape[0]
    positions = [c + j for c, ql in zip(contexts, query_lens) for j in range(ql)]
    positions = torch.tensor(positions + [0] * (n - len(positions)), device="cuda")
    rotary = RotaryEmbedding(HEAD_DIM, 8192, 500000.0).to("cuda")
    flashinfer = _backend()
    seq_lens, tables = _host(batch)
    outs, caches = [], []
    for backend in (flashinfer, TorchAttentionBackend()):
        q, k, v = (t.reshape(n, -1).clone() for t in (batch.q, batch.k_new, batch.v_new))
        ctx = forward_context(batch, backend, contexts, query_lens)
        if backend.plans_on_host:
            backend.plan(np.array(query_lens), seq_lens, tables)
        outs.append(backend.forward(q, k, v, 1, ctx, (rotary, positions) if rope else None))
        caches.append(ctx.k_caches[1])
        assert torch.equal(ctx.k_caches[0], batch.k_cache), "another layer's cache was touched"
    real = sum(query_lens)
    assert torch.equal(caches[0], caches[1])
    assert_close(outs[0][:real], outs[1][:real])
    assert torch.equal(outs[0][real:], torch.zeros_like(outs[0][real:])), "padding must be 0"


@gpu_test
def test_flashinfer_backend_decode_replays_in_a_cuda_graph_gpu():
    # The graph of 16 rows serves 13 real rows and 3 dummy ones (null block, seq_len 1);
    # each replay is planned for new lengths and slots first, as the runner does.
    contexts = [0, 100, 1000, 4000] * 3 + [17]
    n, bs = len(contexts), 16
    batch = _batch([c + 2 for c in contexts], [1] * n, pad=False)  # blocks for two steps
    tables = np.zeros((bs, batch.block_tables.shape[1]), np.int32)
    tables[:n] = batch.block_tables.cpu().numpy()
    backend = _backend()
    caches = ((batch.k_cache,), (batch.v_cache,))
    q = torch.zeros(bs, HEADS[0] * HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    k, v = (torch.zeros(bs, HEADS[1] * HEAD_DIM, dtype=torch.bfloat16, device="cuda") for _ in "kv")
    slot_mapping = torch.full((bs,), -1, dtype=torch.int64, device="cuda")
    ctx = ForwardContext(_meta(bs, slot_mapping), backend, *caches)

    def plan(lens):
        padded = np.ones(bs, np.int32)
        padded[:n] = lens
        backend.plan(np.ones(bs, np.int32), padded, tables, graph_size=bs)

    plan(np.array(contexts) + 1)
    backend.forward(q, k, v, 0, ctx)  # JIT and workspace outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(q, k, v, 0, ctx)
    for offset in (0, 1):  # the new token of row b sits at position contexts[b] + offset
        lens = np.array(contexts) + 1 + offset
        slots = [_slot(batch, b, c + offset) for b, c in enumerate(contexts)]
        slot_mapping[:n].copy_(torch.tensor(slots, device="cuda"))
        for t in (q, k, v):
            t.copy_(torch.randn_like(t))
        plan(lens)
        graph.replay()
        # The reference reads the cache as the replay left it (k/v written, slot -1 here).
        seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
        ref_meta = _meta(n, torch.full((n,), -1, dtype=torch.int64, device="cuda"),
                         seq_lens=seq_lens, block_tables=batch.block_tables)  # fmt: skip
        ref_ctx = ForwardContext(ref_meta, None, *caches)
        expected = TorchAttentionBackend().forward(q[:n].clone(), k[:n], v[:n], 0, ref_ctx)
        assert_close(out[:n], expected)


def _meta(n, slot_mapping, seq_lens=None, block_tables=None):
    """Decode metadata of ``n`` rows; the FlashInfer backend reads only the slots (its page
    lists come from ``plan``), the torch reference the lengths and tables too."""
    i32 = dict(dtype=torch.int32, device="cuda")
    lens = seq_lens if seq_lens is not None else torch.ones(n, **i32)
    return AttentionMetadata(
        num_tokens=n,
        num_rows=n,
        max_query_len=1,
        max_seq_len=int(lens.max()),
        is_decode_only=True,
        query_start_loc=torch.arange(n + 1, **i32),
        seq_lens=lens,
        context_lens=lens - 1,
        block_tables=block_tables if block_tables is not None else torch.zeros(n, 1, **i32),
        slot_mapping=slot_mapping,
        query_lens_host=(1,) * n,
        seq_lens_host=tuple(lens.tolist()),
    )


def _slot(batch, row, position):
    return int(batch.block_tables[row, position // PAGE]) * PAGE + position % PAGE
