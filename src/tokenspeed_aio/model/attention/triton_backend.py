"""Attention backend on the Triton kernels of ``tokenspeed_kernels``.

Per layer: RoPE and the cache write (``kv_store.store_layer_kv``: one launch, or the batch-1
qkv product's epilogue) store the forward's k/v at ``slot_mapping``, then ``attend`` runs either
``decode_attention`` (every row has one query: split-KV, CUDA-graph capturable) or
``extend_attention`` (prefill chunks over a cached prefix, causal) reads everything back
from the paged cache; a mixed forward's leading decode rows (``AttentionMetadata.num_decodes``)
go to ``decode_attention`` and the rest to ``extend_attention``.

A decode-only forward whose RoPE covers whole heads (of a power-of-two head_dim, with q/k norms
of one eps if any) skips the first launch: ``decode_attention``'s new-token prologue norms and
rotates q and k and stores k/v itself (``NewToken``), so the layer's attention is the split
kernel alone. q and k then stay raw in memory; nothing reads them after the attention.

CUDA-graph contract for decode: nothing here reads a device value on the host. The launch
depends only on host ints (tensor shapes, the batch's row count) and on the number of KV
splits, a function of the batch size fixed at construction, so replaying a captured batch
size launches exactly what was captured. The split merge's counters are one buffer the backend
keeps for its lifetime (every launch leaves it zero), so captured launches find it zeroed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from tokenspeed_kernels.decode_attention import (
    NewToken,
    decode_attention,
    folds_new_token,
    num_kv_splits_for,
)
from tokenspeed_kernels.extend_attention import extend_attention

from tokenspeed_aio.model.attention.kv_store import (
    StoredKVBackend,
    joint_qk_norm,
    rotates_whole_heads,
)
from tokenspeed_aio.model.ops.determinism import batch_invariant

if TYPE_CHECKING:
    from tokenspeed_aio.model.attention.base import QKNorm, Rope
    from tokenspeed_aio.model.forward_context import ForwardContext


class TritonAttentionBackend(StoredKVBackend):
    name = "triton"
    supports_cuda_graphs = True

    def __init__(self, *, max_model_len: int = 8192) -> None:
        """``max_model_len`` bounds every row's KV length; it caps the decode split count."""
        self.max_model_len = max_model_len
        self._num_sms: int | None = None
        self._splits: dict[tuple[int, int], int] = {}  # (batch size, kv heads) -> splits
        self._counters: torch.Tensor | None = None  # decode_attention's, kept zero

    def _sm_count(self, device: torch.device) -> int:
        """The device's SM count (1 on CPU, Triton's interpreter: nothing to fill), read once."""
        if self._num_sms is None:
            self._num_sms = (
                torch.cuda.get_device_properties(device).multi_processor_count
                if device.type == "cuda"
                else 1
            )
        return self._num_sms

    def merge_counters(self, device: torch.device) -> torch.Tensor:
        """``decode_attention``'s split-merge counters: one zeroed int32 buffer that every
        launch reuses and leaves zero. A batch splits its keys only while rows * kv heads <
        2 * SMs (``num_kv_splits_for``), so that many entries serve every batch, and the
        buffer never moves under a captured graph."""
        if self._counters is None:
            entries = 2 * self._sm_count(device)
            self._counters = torch.zeros(entries, dtype=torch.int32, device=device)
        return self._counters

    def num_kv_splits(self, batch_size: int, num_kv_heads: int, device: torch.device) -> int:
        """Decode split count for a batch size (a host function of host ints, memoized)."""
        if batch_invariant():  # one program per row: a row's key sum never splits
            return 1
        key = (batch_size, num_kv_heads)
        if key not in self._splits:
            self._splits[key] = num_kv_splits_for(
                batch_size, num_kv_heads, self.max_model_len, self._sm_count(device)
            )
        return self._splits[key]

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_idx: int,
        ctx: ForwardContext,
        rope: Rope | None = None,
        qk_norm: QKNorm | None = None,
    ) -> torch.Tensor:
        num_kv_heads, head_dim = ctx.k_caches[layer_idx].shape[2:]
        norm = None if qk_norm is None else joint_qk_norm(qk_norm)
        # Batch-invariant mode stores every new token one way, decode-only forward or not.
        if batch_invariant() or not (
            ctx.attn.is_decode_only
            and rotates_whole_heads(rope, head_dim)
            and folds_new_token(head_dim)
            and (qk_norm is None or norm is not None)
        ):
            return super().forward(q, k, v, layer_idx, ctx, rope, qk_norm)
        # Tokens [0, num_rows) are the rows' new tokens (one each); any after them are
        # padding (slot -1), which store nothing and whose outputs are zeroed.
        rows, n = ctx.attn.num_rows, q.shape[0]
        rotary_emb, positions = rope
        new_token = NewToken(
            k.view(n, num_kv_heads, head_dim)[:rows],
            v.view(n, num_kv_heads, head_dim)[:rows],
            positions[:rows],
            rotary_emb.cos_sin_cache,
            ctx.attn.slot_mapping[:rows],
            norm,
        )
        return self._attention(q, layer_idx, ctx, new_token)

    def attend(self, q: torch.Tensor, layer_idx: int, ctx: ForwardContext) -> torch.Tensor:
        return self._attention(q, layer_idx, ctx)

    def _attention(
        self,
        q: torch.Tensor,
        layer_idx: int,
        ctx: ForwardContext,
        new_token: NewToken | None = None,
    ) -> torch.Tensor:
        """``attend``; with ``new_token`` (decode-only forwards), q is raw and the decode
        kernel norms, rotates and stores the new tokens first."""
        attn = ctx.attn
        k_cache, v_cache = ctx.k_caches[layer_idx], ctx.v_caches[layer_idx]
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        num_tokens = q.shape[0]
        q3 = q.view(num_tokens, -1, head_dim)
        out = torch.empty(q3.shape, dtype=q.dtype, device=q.device)
        scale = head_dim**-0.5
        # Decode rows -- every row of a decode-only forward, a mixed forward's leading
        # ``num_decodes`` -- take the decode kernel, which reads each KV head once for its
        # query group (the extend kernel would read it once per query head, in a 64-query
        # tile); tokens [0, decodes) are their queries. The other rows take the extend kernel.
        decodes = attn.num_rows if attn.is_decode_only else attn.num_decodes
        if decodes:
            decode_attention(
                q3[:decodes],
                k_cache,
                v_cache,
                attn.block_tables,
                attn.seq_lens,
                scale,
                self.num_kv_splits(decodes, num_kv_heads, q.device),
                out=out[:decodes],
                new_token=new_token,
                counters=self.merge_counters(q.device),
                kv_scales=ctx.layer_kv_scales(layer_idx),
            )
        if attn.is_decode_only:
            real_tokens = decodes
        else:
            # Batch-invariant as it is: every key comes from the cache in tiles aligned at
            # position 0, so a query sees the same tiles whatever its row's prefix or chunk.
            extend_attention(
                q3,
                k_cache,
                v_cache,
                attn.block_tables,
                attn.query_start_loc,
                attn.seq_lens,
                attn.max_query_len,
                scale,
                out=out,
                row_start=decodes,
                kv_scales=ctx.layer_kv_scales(layer_idx),
            )
            real_tokens = sum(attn.query_lens_host)
        if real_tokens < num_tokens:
            out[real_tokens:].zero_()  # padding tokens: finite values for the layers after
        return out.view(num_tokens, -1)
