"""Pure-torch references for every kernel of this package: slow, obvious, and the spec.

Each function takes the same arguments and layouts as its kernel (see the kernel modules) and
computes in fp32 where the kernel accumulates in fp32.
"""

from __future__ import annotations

import torch

from tokenspeed_kernels import kv_layout


def kv_write_reference(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter k/v [T, Hkv, D] into the caches at ``slot_mapping`` (-1: skip)."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    block, offset = kv_layout.slots(k_cache, slots)  # either order
    k_cache[block, offset] = k[keep].to(k_cache.dtype)
    v_cache[block, offset] = v[keep].to(v_cache.dtype)


def paged_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention of q [T, Hq, D] over the paged cache, row by row.

    Row ``b`` owns query tokens ``query_start_loc[b]:query_start_loc[b+1]``, the last ones of its
    ``seq_lens[b]`` positions; decode is the case of one query per row. Tokens past
    ``query_start_loc[-1]`` (padding) get zeros.
    """
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    out = torch.zeros_like(q)
    for b in range(block_tables.shape[0]):
        q0, q1 = int(query_start_loc[b]), int(query_start_loc[b + 1])
        seq_len = int(seq_lens[b])
        if q1 == q0 or seq_len == 0:
            continue
        pos = torch.arange(seq_len, device=q.device)
        blocks = block_tables[b, pos // page_size].long()
        k = k_cache[blocks, pos % page_size].float().repeat_interleave(group, dim=1)
        v = v_cache[blocks, pos % page_size].float().repeat_interleave(group, dim=1)
        qb = q[q0:q1].float()
        scores = torch.einsum("qhd,khd->hqk", qb, k) * scale
        q_pos = seq_len - (q1 - q0) + torch.arange(q1 - q0, device=q.device)
        scores.masked_fill_(pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        out[q0:q1] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(q.dtype)
    return out


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF Llama/Qwen RMSNorm: normalize in fp32, round to x's dtype, then scale by weight."""
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (weight * normed).to(x.dtype)


def fused_add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual = x + residual`` (in x's dtype, as HF adds) then RMSNorm of the sum."""
    new_residual = x + residual
    return rms_norm_reference(new_residual, weight, eps), new_residual


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """HF's SwiGLU gate: ``silu(gate) * up`` in x's dtype, gate and up the halves of x."""
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def rotary_reference(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style rotary (rotate halves) on the first ``rotary_dim`` dims; returns new q, k."""
    half = cos_sin_cache.shape[1] // 2
    cos = cos_sin_cache[positions, :half].float()[:, None, :]
    sin = cos_sin_cache[positions, half:].float()[:, None, :]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        x1, x2 = xf[..., :half], xf[..., half : 2 * half]
        out = xf.clone()
        out[..., :half] = x1 * cos - x2 * sin
        out[..., half : 2 * half] = x2 * cos + x1 * sin
        return out.to(x.dtype)

    return rotate(q), rotate(k)


def sample_reference(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    seeds: torch.Tensor,
    output_indices: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(greedy ids, sampled ids), int64 [B], as the engine's sampler draws them: the Gumbel-max
    ``argmax(logits / T + g)`` with the counter-based noise of ``tokenspeed_kernels/noise.py``
    (the spec the kernel follows); rows with temperature <= 0 sample greedily."""
    from tokenspeed_kernels.noise import gumbel_noise

    logits = logits.float()
    greedy = logits.argmax(-1)
    safe_t = torch.where(temperatures > 0, temperatures, 1.0).float()
    token_ids = torch.arange(logits.shape[1], device=logits.device)
    noise = gumbel_noise(seeds, output_indices, token_ids)
    sampled = (logits / safe_t[:, None] + noise).argmax(-1)
    return greedy, torch.where(temperatures > 0, sampled, greedy)
