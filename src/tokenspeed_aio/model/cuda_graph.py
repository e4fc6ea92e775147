"""CUDA graphs for decode batches: the model forward and the logits, replayed.

Static input buffers are sized for the largest captured batch; graphs are captured
largest first into one shared memory pool. A batch of B decodes replays the graph
of the next captured size bs >= B; rows [B, bs) are dummy slots that read the
reserved null block and write nothing (slot -1). Inputs reach the static buffers
by non-blocking copies from pinned host memory; the decode tokens by a device
gather from the future-token buffer.

    static rows: | real rows 0..B-1 | dummy rows B..bs-1 (null block, seq_len 1, slot -1) |
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from tokenspeed_aio.data_plane.host_sync import allow_host_sync
from tokenspeed_aio.model.forward_context import AttentionMetadata, ForwardContext

logger = logging.getLogger(__name__)


def default_capture_sizes(max_size: int) -> list[int]:
    """1, 2, 4, 8, then steps of 8 up to 256 (16 beyond), capped at ``max_size``."""
    sizes = [1, 2, 4, 8]
    sizes += list(range(16, 257, 8))
    sizes += list(range(272, max(max_size, 256) + 1, 16))
    return sorted({s for s in sizes if s <= max_size} | {max_size})


class DecodeGraphs:
    def __init__(
        self,
        model: torch.nn.Module,
        backend,
        k_caches: tuple[torch.Tensor, ...],
        v_caches: tuple[torch.Tensor, ...],
        *,
        sizes: list[int],
        max_blocks_per_seq: int,
        max_model_len: int,
        device: torch.device,
    ) -> None:
        self.sizes = sorted(sizes)
        self.max_size = self.sizes[-1]
        n = self.max_size
        self.ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.context_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device)
        self._model = model
        self._backend = backend
        self._caches = (k_caches, v_caches)
        self._max_model_len = max_model_len
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._logits: dict[int, torch.Tensor] = {}

    def _context(self, bs: int) -> ForwardContext:
        meta = AttentionMetadata(
            num_tokens=bs,
            num_rows=bs,
            max_query_len=1,
            max_seq_len=self._max_model_len,
            is_decode_only=True,
            query_start_loc=self.query_start_loc[: bs + 1],
            seq_lens=self.seq_lens[:bs],
            context_lens=self.context_lens[:bs],
            block_tables=self.block_tables[:bs],
            slot_mapping=self.slot_mapping[:bs],
            query_lens_host=(1,) * bs,
            seq_lens_host=(self._max_model_len,) * bs,
        )
        return ForwardContext(meta, self._backend, *self._caches)

    def _run(self, bs: int) -> torch.Tensor:
        hidden = self._model(self.ids[:bs], self.positions[:bs], self._context(bs))
        return self._model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        with allow_host_sync():
            for bs in reversed(self.sizes):  # largest first: later ones reuse its pool
                for _ in range(2):  # warm up: compiles and allocator state outside capture
                    self._run(bs)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._logits[bs] = self._run(bs)
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

    def replay(
        self,
        bs: int,
        batch: int,
        host: dict[str, np.ndarray],
        decode_slots: torch.Tensor,
        last_sampled: torch.Tensor,
    ) -> torch.Tensor:
        """Fill the static inputs for ``batch`` real rows (padded to ``bs``), replay, and
        return the logits of the real rows. ``host`` holds the padded host arrays."""
        width = host["block_tables"].shape[1]
        self.positions[:bs].copy_(_pinned(host["positions"]), non_blocking=True)
        self.slot_mapping[:bs].copy_(_pinned(host["slot_mapping"]), non_blocking=True)
        self.seq_lens[:bs].copy_(_pinned(host["seq_lens"]), non_blocking=True)
        self.block_tables[:bs, :width].copy_(_pinned(host["block_tables"]), non_blocking=True)
        torch.index_select(last_sampled, 0, decode_slots, out=self.ids[:batch])
        self._graphs[bs].replay()
        return self._logits[bs][:batch]


def _pinned(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(array).pin_memory()
