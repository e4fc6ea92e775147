"""Test-only driver: runs a model over a paged KV cache, building the ForwardContext by hand.

The engine's model runner does this in production; this keeps just enough bookkeeping
(per-sequence block lists and lengths) to run prefill, chunked prefill and batched decode.
Blocks are handed out in shuffled order so a sequence's blocks are never contiguous.
"""

from __future__ import annotations

import random

import torch

from tokenspeed_aio.model.attention.registry import create_backend
from tokenspeed_aio.model.config import ModelConfig
from tokenspeed_aio.model.forward_context import AttentionMetadata, ForwardContext
from tokenspeed_aio.model.kv_cache import allocate_kv_cache, local_num_kv_heads
from tokenspeed_aio.model.parallel import tp_size


class PagedRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        config: ModelConfig,
        *,
        page_size: int = 4,
        num_blocks: int = 128,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        seed: int = 0,
        kv_cache_dtype: torch.dtype | None = None,
    ) -> None:
        """``kv_cache_dtype`` (default ``dtype``): float8_e4m3fn takes the model's scales."""
        self.model, self.page_size, self.device = model, page_size, torch.device(device)
        kv_dtype = kv_cache_dtype or dtype
        self.k_caches, self.v_caches = allocate_kv_cache(
            config.num_hidden_layers,
            num_blocks,
            page_size,
            local_num_kv_heads(config.num_key_value_heads, tp_size()),
            config.head_dim,
            kv_dtype,
            self.device,
        )
        self.kv_scales = model.kv_scales() if kv_dtype == torch.float8_e4m3fn else None
        self.free_blocks = list(range(1, num_blocks))  # block 0 is the null block
        random.Random(seed).shuffle(self.free_blocks)
        self.blocks: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}
        self.backend = create_backend("torch")

    def forward(self, rows: list[tuple[int, list[int]]]) -> torch.Tensor:
        """One forward over ``rows`` = [(seq_id, new token ids)]; returns [num_tokens, vocab]."""
        input_ids, positions, ctx = self.prepare(rows)
        with torch.inference_mode():
            return self.model.compute_logits(self.model(input_ids, positions, ctx))

    def prepare(
        self, rows: list[tuple[int, list[int]]]
    ) -> tuple[torch.Tensor, torch.Tensor, ForwardContext]:
        """Allocate slots for ``rows`` and build the forward's inputs (host work + H2D copies)."""
        input_ids, positions, slots, query_lens, context_lens = [], [], [], [], []
        for seq_id, tokens in rows:
            start = self.lengths.get(seq_id, 0)
            blocks = self.blocks.setdefault(seq_id, [])
            for pos in range(start, start + len(tokens)):
                if pos // self.page_size == len(blocks):
                    blocks.append(self.free_blocks.pop())
                slots.append(blocks[pos // self.page_size] * self.page_size + pos % self.page_size)
                positions.append(pos)
            input_ids += tokens
            query_lens.append(len(tokens))
            context_lens.append(start)
            self.lengths[seq_id] = start + len(tokens)
        seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
        width = max(len(self.blocks[s]) for s, _ in rows)
        table = [self.blocks[s] + [0] * (width - len(self.blocks[s])) for s, _ in rows]
        starts = [0]
        for q in query_lens:
            starts.append(starts[-1] + q)

        def tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=self.device)

        attn = AttentionMetadata(
            num_tokens=len(input_ids),
            num_rows=len(rows),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            is_decode_only=all(q == 1 for q in query_lens),
            query_start_loc=tensor(starts, torch.int32),
            seq_lens=tensor(seq_lens, torch.int32),
            context_lens=tensor(context_lens, torch.int32),
            block_tables=tensor(table, torch.int32),
            slot_mapping=tensor(slots, torch.int64),
            query_lens_host=tuple(query_lens),
            seq_lens_host=tuple(seq_lens),
            # Leading one-token rows are decodes, as the engine's runner puts them first.
            num_decodes=next((i for i, q in enumerate(query_lens) if q != 1), len(rows)),
        )
        ctx = ForwardContext(attn, self.backend, self.k_caches, self.v_caches, self.kv_scales)
        return tensor(input_ids, torch.int64), tensor(positions, torch.int64), ctx
