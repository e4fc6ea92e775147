"""Batch-invariant attention (``--enable-deterministic-inference``) for the torch backend.

A query's output must not depend on how many queries and keys share its batch: not on
the batch's longest sequence (the padding of the key axis), the other rows, or which of
its own keys came from the prefix cache. So keys are visited in fixed tiles of ``TILE``
positions from position 0, queries are grouped in tiles of ``TILE``, and every product is
a batched ``[TILE, D] @ [D, TILE]`` or ``[TILE, TILE] @ [TILE, D]`` of one fixed shape
(a row's result does not depend on its tile neighbours or on the batch count: measured,
docs/design/determinism.md). The softmax is online across key tiles, in tile order:
masked keys add exact zeros, so a query sees the same sums whether the keys past its
position are another row's padding, its own later tokens, or absent.
"""

from __future__ import annotations

import torch

TILE = 16


def _pad(x: torch.Tensor, dim: int, multiple: int, value=0.0) -> torch.Tensor:
    extra = (-x.shape[dim]) % multiple
    if not extra:
        return x
    shape = list(x.shape)
    shape[dim] = extra
    return torch.cat([x, x.new_full(shape, value)], dim=dim)


def invariant_attention(
    queries: torch.Tensor,  # [B, Q, Hq, D] float32
    keys: torch.Tensor,  # [B, S, Hkv, D] float32
    values: torch.Tensor,  # [B, S, Hkv, D] float32
    mask: torch.Tensor,  # [B, Q, S] bool: query may attend key
    scale: float,
) -> torch.Tensor:  # [B, Q, Hq, D] float32
    batch, num_q, num_heads, dim = queries.shape
    group = num_heads // keys.shape[2]
    q = _pad(queries, 1, TILE)
    k = _pad(keys, 1, TILE).repeat_interleave(group, dim=2)
    v = _pad(values, 1, TILE).repeat_interleave(group, dim=2)
    allowed = _pad(_pad(mask, 1, TILE, False), 2, TILE, False)
    q_tiles, k_tiles = q.shape[1] // TILE, k.shape[1] // TILE
    # [B, H, q tiles, TILE, D] and [B, H, k tiles, TILE, D]
    q = q.permute(0, 2, 1, 3).reshape(batch, num_heads, q_tiles, TILE, dim)
    k = k.permute(0, 2, 1, 3).reshape(batch, num_heads, k_tiles, TILE, dim)
    v = v.permute(0, 2, 1, 3).reshape(batch, num_heads, k_tiles, TILE, dim)
    allowed = allowed.reshape(batch, 1, q_tiles, TILE, k_tiles, TILE)
    q = q * scale
    m = torch.full((batch, num_heads, q_tiles, TILE, 1), float("-inf"), device=q.device)
    denom = torch.zeros_like(m)
    acc = torch.zeros_like(q)
    for j in range(k_tiles):
        s = torch.matmul(q, k[:, :, j].unsqueeze(2).transpose(-1, -2))  # [B,H,Qt,T,T]
        s = torch.where(allowed[:, :, :, :, j], s, float("-inf"))
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        base = torch.where(torch.isinf(m_new), 0.0, m_new)  # rows with no key yet
        p = torch.exp(s - base)
        alpha = torch.exp(m - base)
        denom = denom * alpha + p.sum(-1, keepdim=True)
        acc = acc * alpha + torch.matmul(p, v[:, :, j].unsqueeze(2))
        m = m_new
    out = acc / denom  # padding queries (no key) are 0/0 and never read
    out = out.reshape(batch, num_heads, q_tiles * TILE, dim).permute(0, 2, 1, 3)
    return out[:, :num_q]
