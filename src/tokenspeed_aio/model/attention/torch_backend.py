"""Reference attention backend in pure torch: runs on CPU and CUDA, exact rather than fast.

Per layer it gathers every row's keys/values from the paged cache into a padded
[B, max_seq_len, Hkv, D] tensor and runs one masked ``scaled_dot_product_attention``
over padded queries [B, max_query_len, Hq, D], in float32. Memory grows with
B * max_seq_len, so it suits tests and small batches; production uses a kernel backend.
An FP8 cache stores ``fp8.quantize(k, k_scale)`` per head and is read back as
``float(q) * scale`` (``tokenspeed_kernels.fp8``, the kernels' numerics).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from tokenspeed_kernels import fp8, kv_layout

from tokenspeed_aio.model.attention.base import AttentionBackend
from tokenspeed_aio.model.attention.invariant import invariant_attention
from tokenspeed_aio.model.forward_context import AttentionMetadata, ForwardContext
from tokenspeed_aio.model.ops.determinism import batch_invariant

if TYPE_CHECKING:
    from tokenspeed_aio.model.attention.base import QKNorm, Rope


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Write k/v [num_tokens, Hkv, D] to their slots; tokens with slot -1 write nothing; an
    FP8 cache takes the values divided by ``kv_scales``' per-head scales.

    NOTE: skipping -1 without a host sync: such tokens are pointed at slot 0 (the null
    block, never a real token's slot) and write back the value already there.
    """
    slots = kv_layout.slots(k_cache, slot_mapping.clamp(min=0))  # either order of kv_layout
    valid = (slot_mapping >= 0)[:, None, None]
    if k_cache.dtype == fp8.FP8:  # where() has no e4m3 kernel: select the bytes
        k_scale, v_scale = kv_scales
        k = fp8.quantize(k, k_scale[None, :, None]).view(torch.uint8)
        v = fp8.quantize(v, v_scale[None, :, None]).view(torch.uint8)
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    k_cache[slots] = torch.where(valid, k.to(k_cache.dtype), k_cache[slots])
    v_cache[slots] = torch.where(valid, v.to(v_cache.dtype), v_cache[slots])


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

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
        attn = ctx.attn
        k_cache, v_cache = ctx.k_caches[layer_idx], ctx.v_caches[layer_idx]
        num_kv_heads, head_dim = k_cache.shape[2:]
        num_tokens = q.shape[0]
        if qk_norm is not None:
            q_norm, k_norm = qk_norm
            q = q_norm(q.view(num_tokens, -1, head_dim)).flatten(1)
            k = k_norm(k.view(num_tokens, num_kv_heads, head_dim)).flatten(1)
        if rope is not None:
            rotary_emb, positions = rope
            q, k = rotary_emb(positions, q, k)
        store_kv(
            k.reshape(num_tokens, num_kv_heads, head_dim),
            v.reshape(num_tokens, num_kv_heads, head_dim),
            k_cache,
            v_cache,
            attn.slot_mapping,
            ctx.layer_kv_scales(layer_idx),
        )
        return paged_attention(q, k_cache, v_cache, attn, ctx.layer_kv_scales(layer_idx))


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    attn: AttentionMetadata,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None,
) -> torch.Tensor:
    """Every row's queries against its keys in the paged cache (the new tokens' already
    stored): [num_tokens, Hq * D] in q's dtype; the batch-invariant tiles in that mode."""
    page_size, _, head_dim = k_cache.shape[1:]
    num_tokens = q.shape[0]
    device = q.device

    # Keys/values of every row at positions [0, max_seq_len), through its block table.
    key_pos = torch.arange(attn.max_seq_len, device=device)
    blocks = attn.block_tables[:, key_pos // page_size].long()
    offsets = (key_pos % page_size).expand_as(blocks)  # [B, S]
    keys = k_cache[blocks, offsets].float()  # [B, S, Hkv, D]
    values = v_cache[blocks, offsets].float()
    if k_cache.dtype == fp8.FP8:
        k_scale, v_scale = kv_scales
        keys, values = keys * k_scale[:, None], values * v_scale[:, None]

    # Queries padded to [B, max_query_len]; pad rows read some real token, are masked
    # like any query and never copied back.
    q_off = torch.arange(attn.max_query_len, device=device)
    starts = attn.query_start_loc[:-1].long()
    q_idx = (starts[:, None] + q_off).clamp(max=num_tokens - 1)
    queries = q.reshape(num_tokens, -1, head_dim)[q_idx].float()  # [B, Q, Hq, D]
    q_pos = attn.context_lens.long()[:, None] + q_off  # absolute positions [B, Q]
    mask = (key_pos <= q_pos[:, :, None]) & (key_pos < attn.seq_lens.long()[:, None, None])

    if batch_invariant():
        out = invariant_attention(queries, keys, values, mask, head_dim**-0.5)
    else:
        out = F.scaled_dot_product_attention(
            queries.transpose(1, 2),
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=mask[:, None],
            scale=head_dim**-0.5,
            enable_gqa=True,
        ).transpose(1, 2)  # [B, Q, Hq, D]

    # Back to token order: token t is query (t - starts[row]) of the row holding it.
    # Tokens past the last row (CUDA-graph padding) land on the last row; never read.
    token = torch.arange(num_tokens, device=device, dtype=attn.query_start_loc.dtype)
    row = torch.searchsorted(attn.query_start_loc[1:], token, right=True)
    row = row.clamp(max=attn.num_rows - 1)
    offset = (token.long() - starts[row]).clamp(0, attn.max_query_len - 1)
    return out[row, offset].to(q.dtype).flatten(1)
