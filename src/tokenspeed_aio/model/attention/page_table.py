"""Block tables in the compressed-row form page-list kernels (FlashInfer's) read, on the host.

With page size P, row i's KV of ``seq_lens[i]`` tokens sits in its first
``pages[i] = cdiv(seq_lens[i], P)`` blocks::

    kv_indptr        = [0, pages[0], pages[0] + pages[1], ...]          # [B + 1]
    kv_indices       = block_tables[0, :pages[0]] ++ block_tables[1, :pages[1]] ++ ...
    kv_last_page_len = seq_lens - (pages - 1) * P                      # [B], each in 1..P

Every row holds at least one token (a forward's rows all have new tokens, and CUDA-graph
padding rows hold one token on the null block).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class PagedKV(NamedTuple):
    indptr: np.ndarray  # [B + 1] int32
    indices: np.ndarray  # [indptr[-1]] int32
    last_page_len: np.ndarray  # [B] int32


def paged_kv(seq_lens: np.ndarray, block_tables: np.ndarray, page_size: int) -> PagedKV:
    """``block_tables``: [B, W] with W >= the longest row's page count."""
    seq_lens = np.asarray(seq_lens, np.int64)
    pages = -(-seq_lens // page_size)
    if pages.size and (pages.min() < 1 or pages.max() > block_tables.shape[1]):
        raise ValueError(
            f"every row needs 1..{block_tables.shape[1]} pages, got seq_lens {seq_lens.tolist()}"
        )
    indptr = np.zeros(len(pages) + 1, np.int32)
    np.cumsum(pages, out=indptr[1:])
    used = np.arange(block_tables.shape[1])[None, :] < pages[:, None]
    indices = np.ascontiguousarray(block_tables[used], np.int32)  # row-major: row by row
    last = (seq_lens - (pages - 1) * page_size).astype(np.int32)
    return PagedKV(indptr, indices, last)
