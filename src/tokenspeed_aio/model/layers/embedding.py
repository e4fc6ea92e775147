"""Vocab-parallel token embedding and LM head.

Each rank holds a contiguous slice of ``ceil(vocab / tp)`` rows; the last slice is
zero-padded when the vocab does not divide evenly. Lookups all-reduce (each token's row
lives on one rank); logits all-gather to the full vocab.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenspeed_aio.model.layers.linear import linear
from tokenspeed_aio.model.layers.weights import check_shape
from tokenspeed_aio.model.parallel import tp_all_gather, tp_all_reduce, tp_rank, tp_size


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.tp_size = tp_size()
        self.rows_per_rank = -(-num_embeddings // self.tp_size)
        self.vocab_start = tp_rank() * self.rows_per_rank
        # Real (unpadded) rows on this rank.
        self.num_local_rows = max(0, min(self.rows_per_rank, num_embeddings - self.vocab_start))
        self.weight = nn.Parameter(torch.empty(self.rows_per_rank, embedding_dim))

    def weight_loader(
        self, param: torch.Tensor, loaded: torch.Tensor, shard_id: str | int | None = None
    ) -> None:
        check_shape(loaded, (self.num_embeddings, self.embedding_dim))
        n = self.num_local_rows
        param.data[:n].copy_(loaded.narrow(0, self.vocab_start, n))
        param.data[n:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local_ids = input_ids - self.vocab_start
        on_rank = (local_ids >= 0) & (local_ids < self.rows_per_rank)
        out = F.embedding(local_ids.masked_fill(~on_rank, 0), self.weight)
        return tp_all_reduce(out * on_rank.unsqueeze(-1).to(out.dtype))


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection to the vocab; may share its weight with the embedding (tied)."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[n, hidden] -> [n, vocab] logits over the full vocab, in the weights' dtype (the
        sampler widens them to float32 where it computes with them; a greedy argmax does
        not need to)."""
        logits = tp_all_gather(linear(hidden_states, self.weight), dim=-1)
        return logits[:, : self.num_embeddings]
