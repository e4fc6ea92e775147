"""Attention backend on FlashInfer's paged kernels (optional: the ``flashinfer-python`` package).

FlashInfer schedules its kernels on the host, so every forward is planned before it runs
(``plan``, from host arrays: page_table.py turns our block tables into FlashInfer's
compressed rows) and each layer's ``forward`` runs the planned wrapper. RoPE and the KV-cache
write are this project's Triton launch (kv_store.py), as in the triton backend.

Wrappers, all on FlashInfer's FA2 kernels (decode on tensor cores, which the GQA groups of
the served models want), so the backend JIT-compiles one module per dtype and head size:

- eager forwards (prefill chunks, mixed batches, decode batches no graph covers): one
  ``BatchPrefillWithPagedKVCacheWrapper``, causal. FlashInfer aligns a row's queries to the
  end of its KV, so query j of row i sits at ``seq_lens[i] - query_lens[i] + j``: ours.
- CUDA-graph decode: one ``BatchDecodeWithPagedKVCacheWrapper`` per captured batch size in
  FlashInfer's CUDA-graph mode (fixed index buffers the graph reads; ``plan`` refills them
  before each replay).

All wrappers share one float and one int workspace on the device: forwards run one at a time
on one stream, and each is planned just before it runs.

FlashInfer builds and loads a JIT module the first time a kernel variant is planned (here: at
startup, the memory profile's prefill and the graph captures); the compile monitor watches
those builds like Triton's, so one on the serving path is reported (or raised).

Every array handed to ``plan`` is pinned: a copy from pageable memory may wait for the stream
(CUDA's staging rule), which would stall the host behind the running forward. ``plan`` also
stages its schedule in a pinned buffer of the wrapper and copies it to the device
asynchronously; before the next ``plan`` of that wrapper overwrites the buffer, the event
recorded after the previous one must have passed (it always has in steady state: the
forward that read it ran long before; the check costs an event query).
"""

from __future__ import annotations

import flashinfer
import numpy as np
import torch

from tokenspeed_aio.guards.compile_monitor import compile_monitor
from tokenspeed_aio.guards.host_sync import allow_host_sync
from tokenspeed_aio.model.attention.kv_store import StoredKVBackend
from tokenspeed_aio.model.attention.page_table import paged_kv
from tokenspeed_aio.model.forward_context import ForwardContext

WORKSPACE_BYTES = 256 * 2**20  # FlashInfer's split-KV partials (it recommends 128 MB and up)
INT_WORKSPACE_BYTES = 8 * 2**20  # its schedules (the wrappers' own default size)


class _Planned:
    """A wrapper, its page-list buffer in CUDA-graph mode, and the event after its last
    plan's staging copies."""

    def __init__(self, wrapper, indices: torch.Tensor | None) -> None:
        self.wrapper = wrapper
        self.indices = indices
        self.staged = torch.cuda.Event()
        self.planned = False

    def plan(self, *args, **kwargs) -> None:
        if self.planned and not self.staged.query():
            with allow_host_sync():  # never seen in steady state (module doc)
                self.staged.synchronize()
        self.wrapper.plan(*args, **kwargs)
        self.staged.record()
        self.planned = True


class FlashInferAttentionBackend(StoredKVBackend):
    name = "flashinfer"
    supports_cuda_graphs = True
    plans_on_host = True

    def __init__(
        self,
        *,
        page_size: int,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        max_model_len: int,
    ) -> None:
        if device.type != "cuda":
            raise ValueError("the flashinfer attention backend needs a CUDA device")
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(
                f"the flashinfer attention backend needs float16 or bfloat16, got {dtype}"
            )
        compile_monitor().watch_builds(
            flashinfer.jit.core.JitSpec, "build_and_load", lambda spec: f"flashinfer {spec.name}"
        )
        self.page_size = page_size
        self.heads = (num_q_heads, num_kv_heads, head_dim)
        self.dtype = dtype
        self.device = device
        self.max_pages_per_row = -(-max_model_len // page_size)
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.int_workspace = torch.zeros(INT_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.eager = self._shared(
            flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD", backend="fa2")
        )
        self.graphs: dict[int, _Planned] = {}  # batch size -> its CUDA-graph decode wrapper
        self.active: _Planned | None = None  # planned for the next forward

    def plan(
        self,
        query_lens: np.ndarray,
        seq_lens: np.ndarray,
        block_tables: np.ndarray,
        graph_size: int | None = None,
    ) -> None:
        table = paged_kv(seq_lens, block_tables, self.page_size)
        pinned = [
            torch.from_numpy(a).pin_memory()
            for a in (table.indptr, table.indices, table.last_page_len, seq_lens.astype(np.int32))
        ]
        indptr, indices, last_page_len, kv_lens = pinned
        common = dict(q_data_type=self.dtype, kv_data_type=self.dtype, seq_lens=kv_lens)
        if graph_size is None:
            qo_indptr = np.zeros(len(query_lens) + 1, np.int32)
            np.cumsum(query_lens, out=qo_indptr[1:])
            self.active = self.eager
            self.eager.plan(
                torch.from_numpy(qo_indptr).pin_memory(),
                indptr,
                indices,
                last_page_len,
                *self.heads,
                self.page_size,
                causal=True,
                **common,
            )
        else:
            self.active = self._graph_wrapper(graph_size)
            # The page list goes straight into the buffer the graph reads: FlashInfer copies a
            # host list there synchronously, a device one (this same slice) not at all.
            on_device = self.active.indices[: len(indices)]
            on_device.copy_(indices, non_blocking=True)
            self.active.plan(
                indptr, on_device, last_page_len, *self.heads, self.page_size, **common
            )

    def _graph_wrapper(self, bs: int) -> _Planned:
        if bs not in self.graphs:  # first planned while capturing: before the graph exists
            i32 = dict(dtype=torch.int32, device=self.device)
            indices = torch.zeros(bs * self.max_pages_per_row, **i32)
            self.graphs[bs] = self._shared(
                flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                    self.workspace,
                    "NHD",
                    use_cuda_graph=True,
                    use_tensor_cores=True,
                    paged_kv_indptr_buffer=torch.zeros(bs + 1, **i32),
                    paged_kv_indices_buffer=indices,
                    paged_kv_last_page_len_buffer=torch.zeros(bs, **i32),
                    backend="fa2",
                ),
                indices,
            )
        return self.graphs[bs]

    def _shared(self, wrapper, indices: torch.Tensor | None = None) -> _Planned:
        wrapper.reset_workspace_buffer(self.workspace, self.int_workspace)
        return _Planned(wrapper, indices)

    def attend(self, q: torch.Tensor, layer_idx: int, ctx: ForwardContext) -> torch.Tensor:
        attn = ctx.attn
        k_cache, v_cache = ctx.k_caches[layer_idx], ctx.v_caches[layer_idx]
        num_tokens = q.shape[0]
        q3 = q.view(num_tokens, -1, k_cache.shape[3])
        if self.active is None:
            raise RuntimeError("flashinfer backend: forward before plan")
        out = torch.empty(q3.shape, dtype=q.dtype, device=q.device)
        real_tokens = sum(attn.query_lens_host) if self.active is self.eager else num_tokens
        self.active.wrapper.run(q3[:real_tokens], (k_cache, v_cache), out=out[:real_tokens])
        if real_tokens < num_tokens:
            out[real_tokens:].zero_()  # padding tokens: finite values for the layers after
        return out.view(num_tokens, -1)
