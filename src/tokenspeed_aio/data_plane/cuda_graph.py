"""CUDA graphs for decode batches: the model forward, the logits and their argmax, replayed.

Static input buffers are sized for the largest captured batch; graphs are captured
largest first into one shared memory pool. A batch of B decodes replays the graph
of the next captured size bs >= B; rows [B, bs) are dummy slots that read the
reserved null block and write nothing (slot -1).

A replay ships its inputs in two non-blocking copies from pinned memory: one packed copy of
the per-row fields into a staging buffer the graph of each size reads at fixed offsets, and
the block table rows (2-D, only the columns the batch uses; skipped for backends that plan
on the host, which ship their own page lists). The decode tokens are gathered inside the
graph from the future-token buffer by the rows' slots, and each graph ends with the argmax
of the logits written back to that buffer at the same slots: a batch whose rows all take
the plain argmax (greedy, no logprobs, penalties or bans) needs no sampler launch outside
the graph; any other batch runs the sampler on the logits, which then overwrites the
buffer (later in stream order). The buffer's last entry is the dummy rows' slot, so their
tokens land where no request reads them::

    staging (int32) for size bs: | positions (int64 x bs) | slot_mapping (int64 x bs) |
                                 | slots (int64 x bs) | seq_lens (int32 x bs) |
    each region starts 16-byte aligned (Triton specializes on pointer alignment)
    static rows: | real rows 0..B-1 | dummy rows B..bs-1 (null block, seq_len 1, slot -1,
                                                         the buffer's last entry) |
"""

from __future__ import annotations

import logging
import time
from typing import NamedTuple

import numpy as np
import torch

from tokenspeed_aio.guards.host_sync import allow_host_sync
from tokenspeed_aio.model.forward_context import AttentionMetadata, ForwardContext
from tokenspeed_aio.model.sampling.sampler import argmax_tokens

logger = logging.getLogger(__name__)


def default_capture_sizes(max_size: int) -> list[int]:
    """1, 2, 4, 8, then steps of 8 up to 256 (32 beyond), capped at ``max_size``."""
    sizes = [1, 2, 4, 8]
    sizes += list(range(16, 257, 8))
    sizes += list(range(288, max(max_size, 256) + 1, 32))
    return sorted({s for s in sizes if s <= max_size} | {max_size})


_ALIGN = 4  # int32 elements: 16 bytes


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class _Layout(NamedTuple):
    """Where the fields of a batch of ``bs`` rows sit in the staging buffer (int32 units)."""

    positions: int
    slot_mapping: int
    slots: int
    seq_lens: int
    size: int

    @classmethod
    def of(cls, bs: int) -> _Layout:
        wide = _aligned(2 * bs)  # an int64 field
        return cls(0, wide, 2 * wide, 3 * wide, 3 * wide + _aligned(bs))


class DecodeRows(NamedTuple):
    """Host inputs of a decode batch's real rows, as the runner built them."""

    positions: np.ndarray  # [B] int64
    slot_mapping: np.ndarray  # [B] int64
    slots: np.ndarray  # [B] int64
    seq_lens: np.ndarray  # [B]
    block_tables: np.ndarray  # [B, width] int32

    @classmethod
    def empty(cls) -> DecodeRows:
        """No real rows: what a capture fills (every row a dummy)."""
        wide = np.zeros(0, np.int64)
        return cls(wide, wide, wide, np.zeros(0, np.int32), np.zeros((0, 1), np.int32))


class DecodeGraphs:
    def __init__(
        self,
        model: torch.nn.Module,
        backend,
        k_caches: tuple[torch.Tensor, ...],
        v_caches: tuple[torch.Tensor, ...],
        kv_scales: tuple[tuple[torch.Tensor, torch.Tensor], ...] | None,
        last_sampled: torch.Tensor,
        *,
        sizes: list[int],
        max_blocks_per_seq: int,
        max_model_len: int,
        device: torch.device,
    ) -> None:
        self.sizes = sorted(sizes)
        self.max_size = self.sizes[-1]
        n = self.max_size
        self.staging = torch.zeros(_Layout.of(n).size, dtype=torch.int32, device=device)
        self.context_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device)
        self._model = model
        self._backend = backend
        self._caches = (k_caches, v_caches, kv_scales)
        self._last_sampled = last_sampled  # [max_num_seqs + 1]: the last is the dummies'
        self._max_model_len = max_model_len
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def _run(self, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
        positions, slot_mapping, slots, seq_lens = staged_fields(self.staging, bs)
        meta = AttentionMetadata(
            num_tokens=bs,
            num_rows=bs,
            max_query_len=1,
            max_seq_len=self._max_model_len,
            is_decode_only=True,
            query_start_loc=self.query_start_loc[: bs + 1],
            seq_lens=seq_lens,
            context_lens=self.context_lens[:bs],
            block_tables=self.block_tables[:bs],
            slot_mapping=slot_mapping,
            query_lens_host=(1,) * bs,
            seq_lens_host=(self._max_model_len,) * bs,
        )
        ids = torch.index_select(self._last_sampled, 0, slots)  # the future tokens
        hidden = self._model(ids, positions, ForwardContext(meta, self._backend, *self._caches))
        logits = self._model.compute_logits(hidden)
        tokens = argmax_tokens(logits)
        self._last_sampled.index_copy_(0, slots, tokens)
        return logits, tokens

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        with allow_host_sync():
            for bs in reversed(self.sizes):  # largest first: later ones reuse its pool
                self._fill(bs, DecodeRows.empty())
                for _ in range(2):  # warm up: compiles and allocator state outside capture
                    self._run(bs)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._outputs[bs] = self._run(bs)
                self._graphs[bs] = graph
            torch.cuda.synchronize()
        logger.info(
            "captured %d decode CUDA graphs (batch sizes %d..%d) in %.1f s",
            len(self.sizes),
            self.sizes[0],
            self.max_size,
            time.perf_counter() - start,
        )

    def graph_size(self, batch: int) -> int | None:
        """The captured size a decode batch of ``batch`` rows replays, or None (eager)."""
        if batch > self.max_size:
            return None
        return self.sizes[int(np.searchsorted(self.sizes, batch))]

    def replay(self, bs: int, rows: DecodeRows) -> tuple[torch.Tensor, torch.Tensor]:
        """Ship the host arrays of the batch's real rows (padded here to ``bs``), replay,
        and return the real rows' logits and their argmax (already the slots' future
        tokens)."""
        self._fill(bs, rows)
        self._graphs[bs].replay()
        n = len(rows.slots)
        logits, tokens = self._outputs[bs]
        return logits[:n], tokens[:n]

    def _fill(self, bs: int, rows: DecodeRows) -> None:
        packed = pack_rows(bs, rows, dummy_slot=len(self._last_sampled) - 1)
        self.staging[: len(packed)].copy_(_pinned(packed), non_blocking=True)
        at = _Layout.of(bs)
        padded_lens = packed[at.seq_lens : at.seq_lens + bs]
        tables = np.pad(rows.block_tables, ((0, bs - len(rows.slots)), (0, 0)))
        if self._backend.plans_on_host:
            self._backend.plan(np.ones(bs, np.int32), padded_lens, tables, graph_size=bs)
        else:
            width = tables.shape[1]
            self.block_tables[:bs, :width].copy_(_pinned(tables), non_blocking=True)


def pack_rows(bs: int, rows: DecodeRows, dummy_slot: int) -> np.ndarray:
    """The staging words of a batch padded to ``bs`` rows (layout: module doc); dummy rows
    read and write the future-token buffer at ``dummy_slot``."""
    n = len(rows.slots)
    at = _Layout.of(bs)
    packed = np.zeros(at.size, np.int32)
    wide = packed[: at.seq_lens].view(np.int64)  # the three int64 fields
    o_smap, o_slots = at.slot_mapping // 2, at.slots // 2
    wide[:n] = rows.positions
    wide[o_smap : o_smap + bs] = -1  # dummy rows write nothing
    wide[o_smap : o_smap + n] = rows.slot_mapping
    wide[o_slots : o_slots + n] = rows.slots
    wide[o_slots + n : o_slots + bs] = dummy_slot
    packed[at.seq_lens : at.seq_lens + bs] = 1  # dummy rows: one key on the null block
    packed[at.seq_lens : at.seq_lens + n] = rows.seq_lens
    return packed


def staged_fields(staging: torch.Tensor, bs: int) -> tuple[torch.Tensor, ...]:
    """Views of an int32 staging buffer for size ``bs``: positions, slot_mapping, slots
    (int64) and seq_lens (int32)."""
    at = _Layout.of(bs)
    wide = [staging[o : o + 2 * bs].view(torch.int64) for o in at[:3]]
    return (*wide, staging[at.seq_lens : at.seq_lens + bs])


def _pinned(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(array).pin_memory()
