"""The model runner: one ExecutionPlan -> one launched forward, on the forward thread.

Per round it turns the plan's rows into the forward's inputs on the host (numpy,
vectorized over the batch), copies them to the device without a host wait, runs
the model and the sampler, writes each sampling row's token into the slot's
future-token buffer (the next decode reads it there), and starts the result
copies. ``LaunchedForward.collect`` reads them once they landed.

Layout of one forward (decodes first, then prefill chunks):

    tokens:  | d0 | d1 | ... | p0 p0 p0 p0 | p1 p1 | ...
    row:       0    1          D             D+1
    decode inputs come from last_sampled[slot] on the device; prefill inputs from
    the plan's token lists.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from tokenspeed_aio.data_plane.host_sync import host_to_device
from tokenspeed_aio.model.forward_context import AttentionMetadata, ForwardContext
from tokenspeed_aio.model.sampling.sampler import Sampler, compute_token_logprobs
from tokenspeed_aio.model.sampling.state import SamplingState
from tokenspeed_aio.scheduler.plan import (
    ExecutionPlan,
    ForwardResult,
    ScheduledRow,
    TokenLogprobs,
)


@dataclass(slots=True)
class _Landing:
    """Host-side tensors of one forward's results (pinned on CUDA)."""

    tokens: torch.Tensor
    logprobs: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None
    prompt_logprobs: torch.Tensor | None = None
    prompt_top_ids: torch.Tensor | None = None
    prompt_top_logprobs: torch.Tensor | None = None


class LaunchedForward:
    __slots__ = ("_landing", "_plan", "_prompt_rows", "event")

    def __init__(self, plan, landing, prompt_rows, event) -> None:
        self._plan = plan
        self._landing = landing
        self._prompt_rows = prompt_rows
        self.event = event  # torch.cuda.Event after the result copies, None on CPU

    def collect(self) -> ForwardResult:
        """Plain-Python results, read from the landed host copies."""
        land = self._landing
        result = ForwardResult(
            plan_id=self._plan.plan_id, tokens=land.tokens.tolist(), logprobs=None
        )
        if land.logprobs is not None:
            result.logprobs = _token_logprobs(land.logprobs, land.top_ids, land.top_logprobs)
        if self._prompt_rows:
            flat = _token_logprobs(
                land.prompt_logprobs, land.prompt_top_ids, land.prompt_top_logprobs
            )
            result.prompt_logprobs = {}
            i = 0
            for row in self._prompt_rows:
                n = len(row.prompt_logprob_targets)
                result.prompt_logprobs[row.rid] = [
                    TokenLogprobs(lp.logprob, lp.top[: row.prompt_logprobs])
                    for lp in flat[i : i + n]
                ]
                i += n
        return result


def _token_logprobs(
    logprobs: torch.Tensor, top_ids: torch.Tensor | None, top_logprobs: torch.Tensor | None
) -> list[TokenLogprobs]:
    lps = logprobs.tolist()
    if top_ids is None:
        return [TokenLogprobs(lp, []) for lp in lps]
    return [
        TokenLogprobs(lp, list(zip(ids, tops)))
        for lp, ids, tops in zip(lps, top_ids.tolist(), top_logprobs.tolist())
    ]


class ModelRunner:
    def __init__(
        self,
        *,
        model: torch.nn.Module,
        vocab_size: int,
        k_caches: tuple[torch.Tensor, ...],
        v_caches: tuple[torch.Tensor, ...],
        backend,
        page_size: int,
        max_num_seqs: int,
        max_model_len: int,
        eos_token_ids: Sequence[int],
        device: torch.device,
    ) -> None:
        self.model = model
        self.backend = backend
        self.k_caches = k_caches
        self.v_caches = v_caches
        self.page_size = page_size
        self.device = device
        self.eos_token_ids = tuple(eos_token_ids)
        max_blocks = -(-max_model_len // page_size)
        # Host mirror of every slot's block table; rows ship the changes.
        self.block_table = np.zeros((max_num_seqs, max_blocks), np.int32)
        # Future tokens: the token each slot sampled last, read by its next decode.
        self.last_sampled = torch.zeros(max_num_seqs, dtype=torch.int64, device=device)
        self.sampling = SamplingState(max_num_seqs, vocab_size, device)
        self.sampler = Sampler()

    @torch.inference_mode()
    def execute(self, plan: ExecutionPlan) -> LaunchedForward:
        rows = plan.rows
        self._apply_row_state(rows)
        meta, ids, positions, logits_index, n_decodes = self._prepare(rows)
        ctx = ForwardContext(meta, self.backend, self.k_caches, self.v_caches)
        if n_decodes:
            ids[:n_decodes] = self.last_sampled[ids[:n_decodes]]
        hidden = self.model(ids, positions, ctx)
        logits = self.model.compute_logits(hidden[logits_index])
        sample_rows = [r for r in rows if r.sample]
        prompt_rows = [r for r in rows if r.prompt_logprob_targets]
        landing = self._sample(sample_rows, logits[: len(sample_rows)])
        if prompt_rows:
            self._prompt_logprobs(prompt_rows, logits[len(sample_rows) :], landing)
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        return LaunchedForward(plan, landing, prompt_rows, event)

    @torch.inference_mode()
    def idle_forward(self) -> None:
        """One dummy token on the null block that writes no KV (slot -1): the rank
        enters every collective of a forward without touching any request's state."""
        z32 = torch.zeros(2, dtype=torch.int32, device=self.device)
        meta = AttentionMetadata(
            num_tokens=1,
            num_rows=1,
            max_query_len=1,
            max_seq_len=1,
            is_decode_only=True,
            query_start_loc=torch.tensor([0, 1], dtype=torch.int32, device=self.device),
            seq_lens=z32[:1] + 1,
            context_lens=z32[:1],
            block_tables=z32[:1].view(1, 1),
            slot_mapping=torch.full((1,), -1, dtype=torch.int64, device=self.device),
            query_lens_host=(1,),
            seq_lens_host=(1,),
        )
        ctx = ForwardContext(meta, self.backend, self.k_caches, self.v_caches)
        zero = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.model(zero, zero, ctx)

    def _apply_row_state(self, rows: Sequence[ScheduledRow]) -> None:
        for row in rows:
            owner = row.new_owner
            if owner is not None:
                self.sampling.set_slot(
                    row.slot,
                    owner.params,
                    seed=owner.seed,
                    eos_token_ids=self.eos_token_ids,
                    prompt_token_ids=owner.prompt_token_ids,
                    output_token_ids=owner.output_token_ids,
                )
            if row.new_block_ids:
                end = row.block_offset + len(row.new_block_ids)
                self.block_table[row.slot, row.block_offset : end] = row.new_block_ids

    def _prepare(self, rows: Sequence[ScheduledRow]):
        """Host metadata for the batch, shipped in two packed copies (int64, int32)."""
        b = len(rows)
        page = self.page_size
        slots = np.fromiter((r.slot for r in rows), np.int64, b)
        starts = np.fromiter((r.start for r in rows), np.int64, b)
        qlens = np.fromiter((r.num_tokens for r in rows), np.int64, b)
        seq_lens = starts + qlens
        qsl = np.zeros(b + 1, np.int64)
        np.cumsum(qlens, out=qsl[1:])
        t = int(qsl[-1])
        n_decodes = next((i for i, r in enumerate(rows) if r.token_ids is not None), b)
        row_of = np.repeat(np.arange(b), qlens)
        positions = np.arange(t) - qsl[row_of] + starts[row_of]
        blocks = self.block_table[slots[row_of], positions // page]
        slot_mapping = blocks.astype(np.int64) * page + positions % page
        input_ids = np.empty(t, np.int64)
        input_ids[:n_decodes] = slots[:n_decodes]  # replaced on the device by future tokens
        input_ids[n_decodes:] = np.fromiter(
            itertools.chain.from_iterable(r.token_ids for r in rows[n_decodes:]),
            np.int64,
            t - n_decodes,
        )
        logits_index = [int(qsl[i + 1]) - 1 for i, r in enumerate(rows) if r.sample]
        for i, r in enumerate(rows):
            if r.prompt_logprob_targets:
                first = int(qsl[i])
                logits_index.extend(range(first, first + len(r.prompt_logprob_targets)))
        max_seq = int(seq_lens.max())
        max_blocks = -(-max_seq // page)
        n_idx = len(logits_index)
        packed64 = np.concatenate(
            [input_ids, positions, slot_mapping, np.asarray(logits_index, np.int64)]
        )
        packed32 = np.concatenate(
            [qsl, seq_lens, starts, self.block_table[slots, :max_blocks].reshape(-1)]
        ).astype(np.int32)
        dev64 = host_to_device(packed64, self.device)
        dev32 = host_to_device(packed32, self.device)
        ids, pos, smap, lidx = torch.split(dev64, [t, t, t, n_idx])
        qsl_d, seq_d, ctx_d, bt = torch.split(dev32, [b + 1, b, b, b * max_blocks])
        meta = AttentionMetadata(
            num_tokens=t,
            num_rows=b,
            max_query_len=int(qlens.max()),
            max_seq_len=max_seq,
            is_decode_only=n_decodes == b,
            query_start_loc=qsl_d,
            seq_lens=seq_d,
            context_lens=ctx_d,
            block_tables=bt.view(b, max_blocks),
            slot_mapping=smap,
            query_lens_host=tuple(qlens.tolist()),
            seq_lens_host=tuple(seq_lens.tolist()),
        )
        return meta, ids, pos, lidx, n_decodes

    def _sample(self, rows: Sequence[ScheduledRow], logits: torch.Tensor) -> _Landing:
        if not rows:
            return _Landing(tokens=torch.empty(0, dtype=torch.int64))
        batch = self.sampling.prepare([r.slot for r in rows], [r.output_index for r in rows])
        out = self.sampler(logits, batch)
        self.sampling.record(batch, out.tokens)
        self.last_sampled.index_copy_(0, batch.slots, out.tokens)
        return _Landing(
            tokens=self._to_host(out.tokens),
            logprobs=self._to_host(out.logprobs),
            top_ids=self._to_host(out.top_ids),
            top_logprobs=self._to_host(out.top_logprobs),
        )

    def _prompt_logprobs(
        self, rows: Sequence[ScheduledRow], logits: torch.Tensor, landing: _Landing
    ) -> None:
        targets = np.fromiter(
            itertools.chain.from_iterable(r.prompt_logprob_targets for r in rows), np.int64
        )
        num_top = max(r.prompt_logprobs for r in rows)
        lps, top_ids, top_lps = compute_token_logprobs(
            logits, host_to_device(targets, self.device), num_top
        )
        landing.prompt_logprobs = self._to_host(lps)
        landing.prompt_top_ids = self._to_host(top_ids) if num_top else None
        landing.prompt_top_logprobs = self._to_host(top_lps) if num_top else None

    def _to_host(self, tensor: torch.Tensor | None) -> torch.Tensor | None:
        """Start a device->host copy into pinned memory (no wait; the event fences it)."""
        if tensor is None or self.device.type == "cpu":
            return tensor
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        host.copy_(tensor, non_blocking=True)
        return host
