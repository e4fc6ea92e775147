"""The sampler: logits of the rows that sample -> next tokens (+ logprobs).

Stages, in order (each skipped when the batch's host flags say no row needs it;
a skipped stage would have left every row unchanged, so skipping never changes
a result):

0. a batch of greedy rows that needs nothing else (no logprobs, penalties, min_tokens or
   grammar): the argmax of the logits as the model returned them, in its dtype;
1. raw ``log_softmax`` for logprobs (the model's own distribution, as vLLM reports);
2. repetition, frequency and presence penalties; logit_bias; the min_tokens ban;
3. greedy rows: argmax;
4. sampled rows (on CUDA without top-k/top-p/min-p: one Triton pass that draws the same
   tokens, ``tokenspeed_kernels.sampling``): temperature, top-k / top-p, min-p, then the Gumbel-max draw
   ``argmax(logits / T + g)``, which picks token i with probability
   ``softmax(logits / T)[i]``; ``g`` is counter-based Gumbel noise keyed by
   (seed, output_index, token_id), so a seeded row's token is independent of
   the batch it runs in and of its row position.

No stage reads the device from the host: the whole call is enqueue-only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tokenspeed_kernels.noise import gumbel_noise

from tokenspeed_aio.model.sampling.batch import SamplingBatch
from tokenspeed_aio.model.sampling.filters import apply_min_p, apply_top_k_top_p
from tokenspeed_aio.model.sampling.logit_bias import apply_logit_bias
from tokenspeed_aio.model.sampling.penalties import apply_min_tokens_ban, apply_penalties

# Rows per noise chunk are chosen so one chunk's int64 hash stays near 128 MiB
# (B=1024 rows of a 128k vocabulary would otherwise need GiBs of temporaries).
_NOISE_CHUNK_ELEMENTS = 1 << 24


@dataclass(frozen=True, slots=True)
class SamplerOutput:
    """Device tensors of one round's sampling, in row order."""

    tokens: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None  # [B] float32: raw logprob of each sampled token
    top_ids: torch.Tensor | None  # [B, N] int64, N = batch.max_num_logprobs (None if N <= 0)
    top_logprobs: torch.Tensor | None  # [B, N] float32, descending


def compute_token_logprobs(
    logprobs_or_logits: torch.Tensor, target_ids: torch.Tensor, num_top: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logprob of each target token plus the ``num_top`` best alternatives of each row.

    Accepts raw logits or logprobs ([n, V]): log_softmax is idempotent, so either
    gives the same answer (up to rounding). Used for prompt logprobs and for the
    sampled tokens. Returns ([n], [n, num_top] ids, [n, num_top] logprobs).
    """
    logprobs = torch.log_softmax(logprobs_or_logits.float(), dim=-1)
    return _gather_logprobs(logprobs, target_ids, num_top)


def _gather_logprobs(
    logprobs: torch.Tensor, target_ids: torch.Tensor, num_top: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    target = logprobs.gather(-1, target_ids.to(torch.int64).unsqueeze(-1)).squeeze(-1)
    top_logprobs, top_ids = logprobs.topk(num_top, dim=-1)
    return target, top_ids, top_logprobs


def argmax_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax (ties: the lowest id); one pass of the Triton sampler on CUDA,
    where ``torch.argmax`` of a few wide rows is a slow reduction."""
    if logits.is_cuda and logits.stride(-1) == 1:
        from tokenspeed_kernels.sampling import greedy

        return greedy(logits)
    return logits.argmax(dim=-1)


class Sampler:
    """Samples one token per row from ``[B, V]`` logits (any float dtype; stages that
    compute with them work in float32); see the module docstring.

    Holds only a cache of the token-id ramp the noise hash is keyed by.
    """

    def __init__(self) -> None:
        self._token_ids: torch.Tensor | None = None

    def __call__(
        self, logits: torch.Tensor, batch: SamplingBatch, token_bitmask=None
    ) -> SamplerOutput:
        """``token_bitmask`` (model/grammar_mask.py): constrained rows' allowed tokens,
        applied after the raw logprobs, before any choice."""
        if (
            batch.all_greedy
            and batch.max_num_logprobs < 0
            and not (batch.any_penalties or batch.any_min_tokens_ban or batch.any_logit_bias)
            and token_bitmask is None
        ):
            return SamplerOutput(argmax_tokens(logits), None, None, None)
        logits = logits.float()
        logprobs = torch.log_softmax(logits, dim=-1) if batch.max_num_logprobs >= 0 else None
        if batch.any_penalties:
            logits = apply_penalties(logits, batch)
        if batch.any_logit_bias:
            logits = apply_logit_bias(logits, batch)
        if batch.any_min_tokens_ban:
            logits = apply_min_tokens_ban(logits, batch)
        if token_bitmask is not None:
            token_bitmask.apply(logits)

        if batch.all_greedy:
            tokens = argmax_tokens(logits)
        elif logits.is_cuda and not (batch.any_top_k or batch.any_top_p or batch.any_min_p):
            # One pass over the vocabulary, no [B, V] temporaries; the same draws (a test
            # compares them bit for bit on the GPU).
            from tokenspeed_kernels.sampling import sample

            # The kernel reads contiguous [B] vectors; these two are columns of a table.
            temperature, seeds = batch.temperature.contiguous(), batch.seeds.contiguous()
            _, tokens = sample(logits, temperature, seeds, batch.output_indices)
        else:
            tokens = self._sample(logits, batch)
            if batch.any_greedy:
                tokens = torch.where(batch.temperature == 0.0, argmax_tokens(logits), tokens)
        return self._output(tokens, logprobs, batch)

    def _output(
        self, tokens: torch.Tensor, logprobs: torch.Tensor | None, batch: SamplingBatch
    ) -> SamplerOutput:
        if logprobs is None:
            return SamplerOutput(tokens, None, None, None)
        sampled, top_ids, top_logprobs = _gather_logprobs(
            logprobs, tokens, max(batch.max_num_logprobs, 0)
        )
        if batch.max_num_logprobs == 0:
            return SamplerOutput(tokens, sampled, None, None)
        return SamplerOutput(tokens, sampled, top_ids, top_logprobs)

    def _sample(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        # Greedy rows divide by 1 to stay finite; their token comes from the argmax.
        temperature = batch.temperature
        temperature = torch.where(temperature > 0.0, temperature, 1.0).unsqueeze(1)
        logits = logits / temperature
        if batch.any_top_k or batch.any_top_p:
            logits = apply_top_k_top_p(
                logits,
                batch.top_k,
                batch.top_p,
                max_top_k=batch.max_top_k,
                use_top_p=batch.any_top_p,
            )
        if batch.any_min_p:
            logits = apply_min_p(logits, batch.min_p)
        return self._gumbel_argmax(logits, batch)

    def _gumbel_argmax(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        num_rows, vocab_size = logits.shape
        token_ids = self._token_ids
        if (
            token_ids is None
            or token_ids.numel() != vocab_size
            or token_ids.device != logits.device
        ):
            token_ids = torch.arange(vocab_size, dtype=torch.int64, device=logits.device)
            self._token_ids = token_ids
        chunk = max(1, _NOISE_CHUNK_ELEMENTS // vocab_size)
        parts = []
        for start in range(0, num_rows, chunk):
            rows = slice(start, start + chunk)
            noise = gumbel_noise(batch.seeds[rows], batch.output_indices[rows], token_ids)
            parts.append(noise.add_(logits[rows]).argmax(dim=-1))
        return parts[0] if len(parts) == 1 else torch.cat(parts)


def warm_up_sampling_kernel(vocab_size: int, dtype: torch.dtype, device: torch.device) -> None:
    """Compile the one-pass Triton sampler at startup, as serving calls it (float32 logits
    of the model's vocabulary, 16-byte-aligned [B] vectors), not under the first request
    with a temperature; and its greedy variant, on the model's logits (``dtype``) and on
    float32 ones."""
    from tokenspeed_kernels.sampling import greedy, sample

    logits = torch.zeros(1, vocab_size, dtype=torch.float32, device=device)
    ones = torch.ones(1, dtype=torch.float32, device=device)
    zeros = torch.zeros(1, dtype=torch.int64, device=device)
    sample(logits, ones, zeros, zeros.clone())
    greedy(logits)
    greedy(logits.to(dtype))
