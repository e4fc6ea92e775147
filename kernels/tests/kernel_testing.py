"""Shared by the kernel tests: the device, tolerances, the GPU marker, random paged batches."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from tokenspeed_kernels import fp8, kv_layout

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def gpu_test(fn):
    """Mark a test as GPU-only (native kernels, larger shapes): skipped without CUDA."""
    skip = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
    return pytest.mark.gpu(skip(fn))


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """fp32: ~1e-4 relative; bf16/fp16: ~1e-2 (one rounding of the output, plus a little)."""
    if expected.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4)
    else:
        torch.testing.assert_close(actual.float(), expected.float(), rtol=2e-2, atol=2e-2)


def assert_close_fp8_product(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """An FP8 GPU product against its fp32 reference (``fp8.product_tolerance``)."""
    torch.testing.assert_close(actual.float(), expected.float(), **fp8.product_tolerance(expected))


def assert_equal_unless_normed_on_gpu(
    actual: torch.Tensor, expected: torch.Tensor, normed: bool
) -> None:
    """Bitwise equal; with q/k norms on a GPU only close: there a fused norm's sum of squares
    may add in another order than the unfused one's (``rotary``'s module doc), an ulp of a
    normed value and then of what is computed from it."""
    if normed and actual.is_cuda:
        assert_close(actual, expected)
    else:
        assert torch.equal(actual, expected)


@dataclass
class PagedBatch:
    q: torch.Tensor  # [num_tokens, Hq, D]; the last token is padding when pad=True
    k_new: torch.Tensor  # [num_tokens, Hkv, D]
    v_new: torch.Tensor
    k_cache: torch.Tensor  # [num_blocks, page_size, Hkv, D]; context tokens already in place
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [B, max_blocks] int32, 0 past each row's blocks
    seq_lens: torch.Tensor  # [B] int32
    context_lens: torch.Tensor  # [B] int32
    query_start_loc: torch.Tensor  # [B + 1] int32
    slot_mapping: torch.Tensor  # [num_tokens] int64, -1 on padding


def make_paged_batch(
    context_lens: list[int],
    query_lens: list[int],
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    dtype: torch.dtype,
    device: str = DEVICE,
    pad: bool = True,
    seed: int = 0,
) -> PagedBatch:
    """Rows own shuffled, non-contiguous blocks (block 0, the null block, is never used, and
    spare blocks hold garbage that must not leak in); k_new/v_new are not yet in the cache."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    blocks_per_row = [-(-s // page_size) for s in seq_lens]
    num_blocks = 1 + sum(blocks_per_row) + 3
    ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    max_blocks = max(blocks_per_row) + 1
    block_tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    for b, n in enumerate(blocks_per_row):
        block_tables[b, :n] = torch.tensor([ids.pop() for _ in range(n)], dtype=torch.int32)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    cache_shape = (num_blocks, page_size, num_kv_heads, head_dim)
    k_cache, v_cache = randn(*cache_shape), randn(*cache_shape)
    slots = []
    for b, (c, q) in enumerate(zip(context_lens, query_lens)):
        for p in range(c, c + q):
            slots.append(int(block_tables[b, p // page_size]) * page_size + p % page_size)
    if pad:
        slots.append(-1)
    num_tokens = len(slots)
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    batch = PagedBatch(
        q=randn(num_tokens, num_q_heads, head_dim),
        k_new=randn(num_tokens, num_kv_heads, head_dim),
        v_new=randn(num_tokens, num_kv_heads, head_dim),
        k_cache=k_cache,
        v_cache=v_cache,
        block_tables=block_tables,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        context_lens=torch.tensor(context_lens, dtype=torch.int32),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
    )
    for name, value in vars(batch).items():
        setattr(batch, name, value.to(device))
    return batch


def forward_context(batch: PagedBatch, backend, contexts, query_lens, num_layers: int = 2):
    """A ForwardContext over ``batch`` with ``num_layers`` copies of its cache (the backend
    writes one layer; the others must stay untouched)."""
    from tokenspeed_aio.model.forward_context import AttentionMetadata, ForwardContext

    attn = AttentionMetadata(
        num_tokens=batch.q.shape[0],
        num_rows=len(contexts),
        max_query_len=max(query_lens),
        max_seq_len=max(c + q for c, q in zip(contexts, query_lens)),
        is_decode_only=all(q == 1 for q in query_lens),
        query_start_loc=batch.query_start_loc,
        seq_lens=batch.seq_lens,
        context_lens=batch.context_lens,
        block_tables=batch.block_tables,
        slot_mapping=batch.slot_mapping,
        query_lens_host=tuple(query_lens),
        seq_lens_host=tuple(c + q for c, q in zip(contexts, query_lens)),
        # The leading one-query rows, as the runner's decode rows come first.
        num_decodes=next((i for i, q in enumerate(query_lens) if q != 1), len(query_lens)),
    )
    k_caches = tuple(batch.k_cache.clone() for _ in range(num_layers))
    v_caches = tuple(batch.v_cache.clone() for _ in range(num_layers))
    return ForwardContext(attn=attn, backend=backend, k_caches=k_caches, v_caches=v_caches)


def dim_major_copy(cache: torch.Tensor) -> torch.Tensor:
    """The same values in a dim-major cache (``kv_layout``): an FP8 pool's V order."""
    out = kv_layout.dim_major(torch.empty(cache.shape, dtype=cache.dtype, device=cache.device))
    out.copy_(cache)
    return out
