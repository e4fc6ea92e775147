"""Per-slot sampling settings: host mirrors for flags, device tables for the sampler.

A request's settings are written once, when its slot gets a new owner
(``set_slot``); each round ``prepare`` gathers them for the rows that sample.
Everything here runs on the forward thread.

Device writes are batched: ``set_slot`` only writes the host mirrors and marks
the slot dirty; ``prepare`` flushes the dirty rows with one copy per table
(pinned, non-blocking on CUDA) before it gathers. The staging buffers are fresh
pinned tensors, so a later host write can never race a copy still in flight.

Penalty state (output token counts and prompt presence, [max_slots, V] each)
costs over 100 MB for a 128k vocabulary, so it is allocated the first time a
slot with a penalty is set.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from tokenspeed_aio.model.sampling.batch import SamplingBatch
from tokenspeed_aio.model.sampling.logit_bias import LogitBiasTable
from tokenspeed_aio.sampling_params import MAX_BANNED_IDS, SamplingParams

logger = logging.getLogger(__name__)

# A temperature this small is greedy: dividing by it would overflow (vLLM's rule).
GREEDY_TEMPERATURE = 1e-5

# Columns of the float32 table.
_TEMPERATURE, _TOP_P, _MIN_P, _REPETITION, _FREQUENCY, _PRESENCE = range(6)
_FLOAT_DEFAULTS = (0.0, 1.0, 0.0, 1.0, 0.0, 0.0)
# Columns of the int64 table; banned ids fill the columns from _BANNED on.
_SEED, _TOP_K, _MIN_TOKENS, _NUM_LOGPROBS, _BANNED = range(5)


def _to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    host = torch.from_numpy(np.ascontiguousarray(array))
    if device.type == "cuda":
        # pin_memory() copies into a fresh block of the caching host allocator, which
        # keeps it until the async copy has run: the caller may reuse `array` at once.
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device, copy=True)


def _as_int64(seed: int) -> int:
    if not -(2**63) <= seed < 2**64:
        raise ValueError(f"seed must fit in 64 bits, got {seed}")
    return seed - 2**64 if seed >= 2**63 else seed


def _has_penalty(params: SamplingParams) -> bool:
    return (
        params.repetition_penalty != 1.0
        or params.frequency_penalty != 0.0
        or params.presence_penalty != 0.0
    )


class HostRows(NamedTuple):
    """The host mirrors' settings of a round's sampling rows, and the masks the sampler's
    stages are chosen by."""

    rows: np.ndarray  # [B] slots
    steps: np.ndarray  # [B] output indices
    f32: np.ndarray  # [B, float columns]
    i64: np.ndarray  # [B, int columns]
    greedy: np.ndarray  # [B] bool
    penalized: np.ndarray
    banning: np.ndarray  # below min_tokens with ids to ban
    biased: np.ndarray  # has a logit_bias

    @property
    def plain_greedy(self) -> bool:
        """Every row's token is the plain argmax of its logits (the sampler's stage 0:
        greedy, no penalties, no min_tokens ban, no logprobs): a caller that already has
        that argmax needs no ``prepare``."""
        return bool(
            self.greedy.all()
            and not self.penalized.any()
            and not self.banning.any()
            and not self.biased.any()
            and self.i64[:, _NUM_LOGPROBS].max(initial=-1) < 0
        )


class SavedSlot(NamedTuple):
    """One slot's sampling settings as a retraction snapshot keeps them."""

    f32: np.ndarray  # the float table's row
    i64: np.ndarray  # the int table's row (seed, top-k, min_tokens, logprobs, banned ids)
    pending_penalty: tuple[np.ndarray, np.ndarray] | None  # penalty rows not rebuilt yet
    device_penalty: bool  # its device penalty rows (counts, prompt mask) hold its state


class SamplingState:
    """Sampling settings and penalty state of every slot, on the host and the device."""

    def __init__(
        self,
        max_slots: int,
        vocab_size: int,
        device: torch.device | str,
        max_stop_ids: int = MAX_BANNED_IDS,
    ):
        self.max_slots = max_slots
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.max_stop_ids = max_stop_ids
        self._host_f32 = np.tile(np.asarray(_FLOAT_DEFAULTS, np.float32), (max_slots, 1))
        self._host_i64 = np.full((max_slots, _BANNED + max_stop_ids), -1, np.int64)
        self._host_i64[:, _SEED] = 0
        self._host_i64[:, _TOP_K] = vocab_size
        self._host_i64[:, _MIN_TOKENS] = 0
        self._f32 = _to_device(self._host_f32, self.device)
        self._i64 = _to_device(self._host_i64, self.device)
        self._dirty: set[int] = set()
        # slot -> (prompt ids, output ids) whose penalty rows must be rebuilt at the flush
        self._penalty_rows: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.output_counts: torch.Tensor | None = None  # [max_slots, V] int32
        self.prompt_mask: torch.Tensor | None = None  # [max_slots, V] bool
        self.logit_bias = LogitBiasTable(max_slots, self.device)

    def set_slot(
        self,
        slot: int,
        params: SamplingParams,
        *,
        seed: int,
        eos_token_ids: Sequence[int],
        prompt_token_ids: Sequence[int],
        output_token_ids: Sequence[int],
    ) -> None:
        """Give ``slot`` a new owner (also a retracted request coming back).

        ``output_token_ids`` are the outputs already committed; they are counted so
        that frequency and presence penalties continue where they left off.
        """
        if not 0 <= slot < self.max_slots:
            raise IndexError(f"slot {slot} out of range [0, {self.max_slots})")
        temperature = params.temperature if params.temperature >= GREEDY_TEMPERATURE else 0.0
        self._host_f32[slot] = (
            temperature,
            params.top_p,
            params.min_p,
            params.repetition_penalty,
            params.frequency_penalty,
            params.presence_penalty,
        )
        row = self._host_i64[slot]
        row[_SEED] = _as_int64(seed)
        row[_TOP_K] = params.top_k if 0 < params.top_k < self.vocab_size else self.vocab_size
        row[_MIN_TOKENS] = params.min_tokens
        row[_NUM_LOGPROBS] = -1 if params.logprobs is None else params.logprobs
        row[_BANNED:] = -1
        if params.min_tokens > 0:
            banned = self._banned_ids(params, eos_token_ids)
            row[_BANNED : _BANNED + len(banned)] = banned
        self._dirty.add(slot)
        self.logit_bias.set_slot(slot, params.logit_bias)
        if _has_penalty(params):
            self._ensure_penalty_state()
            self._penalty_rows[slot] = (
                np.asarray(prompt_token_ids, np.int64),
                np.asarray(output_token_ids, np.int64),
            )
        else:
            self._penalty_rows.pop(slot, None)

    def save_slot(self, slot: int) -> SavedSlot:
        """A copy of the slot's host settings, for a retraction snapshot. Its device penalty
        rows are current unless a rebuild is still due (``pending_penalty``); the caller
        copies them when ``device_penalty`` says so."""
        pending = self._penalty_rows.get(slot)
        f32 = self._host_f32[slot].copy()
        penalized = bool(f32[_REPETITION] != 1.0 or f32[_FREQUENCY] != 0.0 or f32[_PRESENCE] != 0.0)
        return SavedSlot(
            f32,
            self._host_i64[slot].copy(),
            pending,
            device_penalty=penalized and pending is None and self.output_counts is not None,
        )

    def load_slot(self, slot: int, saved: SavedSlot) -> None:
        """Give ``slot`` a restored owner's settings (its device penalty rows, when saved,
        are copied by the caller)."""
        self._host_f32[slot] = saved.f32
        self._host_i64[slot] = saved.i64
        self._dirty.add(slot)
        if saved.pending_penalty is not None:
            self._ensure_penalty_state()
            self._penalty_rows[slot] = saved.pending_penalty
        else:
            self._penalty_rows.pop(slot, None)

    def host_rows(self, slots: Sequence[int], output_indices: Sequence[int]) -> HostRows:
        """The host settings of the rows that sample this round, in row order.

        ``output_indices[i]`` is how many output tokens row i's request already has.
        """
        rows = np.asarray(slots, np.int64)
        steps = np.asarray(output_indices, np.int64)
        host_f, host_i = self._host_f32[rows], self._host_i64[rows]
        penalized = (
            (host_f[:, _REPETITION] != 1.0)
            | (host_f[:, _FREQUENCY] != 0.0)
            | (host_f[:, _PRESENCE] != 0.0)
        )
        banning = (steps < host_i[:, _MIN_TOKENS]) & (host_i[:, _BANNED] >= 0)
        greedy = host_f[:, _TEMPERATURE] == 0.0
        biased = self.logit_bias.biased(rows)
        return HostRows(rows, steps, host_f, host_i, greedy, penalized, banning, biased)

    def prepare(self, slots: Sequence[int], output_indices: Sequence[int]) -> SamplingBatch:
        """Settings of the rows that sample this round, in row order (``host_rows``'s
        arguments)."""
        return self.prepare_rows(self.host_rows(slots, output_indices))

    def prepare_rows(self, host: HostRows) -> SamplingBatch:
        """``prepare`` from the rows' host settings a caller already read."""
        self._flush()
        rows, steps, host_f, host_i, greedy, penalized, banning, biased = host
        sampled = ~greedy
        top_k_rows = host_i[sampled, _TOP_K] < self.vocab_size
        any_penalties = bool(penalized.any())

        # [2, B] rounded up to an even B: both rows start 16-byte aligned, so a kernel that
        # reads them (Triton specializes on pointer alignment) compiles once, not per parity.
        width = len(rows) + len(rows) % 2
        index = _to_device(np.stack([np.resize(rows, width), np.resize(steps, width)]), self.device)
        index = index[:, : len(rows)]
        dev_f = self._f32.index_select(0, index[0])
        dev_i = self._i64.index_select(0, index[0])
        bias_ids, bias_values = self.logit_bias.gather(index[0]) if biased.any() else (None, None)
        return SamplingBatch(
            num_rows=len(rows),
            slots=index[0],
            output_indices=index[1],
            temperature=dev_f[:, _TEMPERATURE],
            top_k=dev_i[:, _TOP_K],
            top_p=dev_f[:, _TOP_P],
            min_p=dev_f[:, _MIN_P],
            seeds=dev_i[:, _SEED],
            repetition_penalty=dev_f[:, _REPETITION],
            frequency_penalty=dev_f[:, _FREQUENCY],
            presence_penalty=dev_f[:, _PRESENCE],
            min_tokens=dev_i[:, _MIN_TOKENS],
            banned_ids=dev_i[:, _BANNED:],
            output_counts=self.output_counts if any_penalties else None,
            prompt_mask=self.prompt_mask if any_penalties else None,
            all_greedy=bool(greedy.all()),
            any_greedy=bool(greedy.any()),
            max_top_k=int(host_i[sampled, _TOP_K].max(initial=0, where=top_k_rows)),
            any_top_p=bool((sampled & (host_f[:, _TOP_P] < 1.0)).any()),
            any_min_p=bool((sampled & (host_f[:, _MIN_P] > 0.0)).any()),
            any_penalties=any_penalties,
            any_min_tokens_ban=bool(banning.any()),
            max_num_logprobs=int(host_i[:, _NUM_LOGPROBS].max(initial=-1)),
            logit_bias_ids=bias_ids,
            logit_bias_values=bias_values,
        )

    def record(self, batch: SamplingBatch, sampled_tokens: torch.Tensor) -> None:
        """Count this round's sampled tokens for the penalized rows (device ops only)."""
        if not batch.any_penalties:
            return
        assert self.output_counts is not None
        penalized = (
            (batch.repetition_penalty != 1.0)
            | (batch.frequency_penalty != 0.0)
            | (batch.presence_penalty != 0.0)
        )
        flat = batch.slots * self.vocab_size + sampled_tokens.to(torch.int64)
        self.output_counts.view(-1).index_add_(0, flat, penalized.to(torch.int32))

    def _banned_ids(self, params: SamplingParams, eos_token_ids: Sequence[int]) -> list[int]:
        ids = [] if params.ignore_eos else list(eos_token_ids)
        ids += params.stop_token_ids
        # Ids past the vocabulary can never be sampled, so there is nothing to ban.
        banned = [i for i in dict.fromkeys(ids) if 0 <= i < self.vocab_size]
        if len(banned) > self.max_stop_ids:
            raise ValueError(
                f"min_tokens needs {len(banned)} banned ids (EOS + stop_token_ids), "
                f"at most {self.max_stop_ids} are supported"
            )
        return banned

    def _ensure_penalty_state(self) -> None:
        if self.output_counts is not None:
            return
        shape = (self.max_slots, self.vocab_size)
        self.output_counts = torch.zeros(shape, dtype=torch.int32, device=self.device)
        self.prompt_mask = torch.zeros(shape, dtype=torch.bool, device=self.device)
        logger.info(
            "allocated sampling penalty state: %d slots x %d vocab, %.1f MiB on %s",
            *shape,
            self.max_slots * self.vocab_size * 5 / 2**20,
            self.device,
        )

    def _flush(self) -> None:
        if self._dirty:
            dirty = np.fromiter(sorted(self._dirty), np.int64, len(self._dirty))
            self._dirty.clear()
            packed_i = np.concatenate([dirty[:, None], self._host_i64[dirty]], axis=1)
            dev_i = _to_device(packed_i, self.device)
            dev_f = _to_device(self._host_f32[dirty], self.device)
            self._i64.index_copy_(0, dev_i[:, 0], dev_i[:, 1:])
            self._f32.index_copy_(0, dev_i[:, 0], dev_f)
        if self._penalty_rows:
            self._rebuild_penalty_rows()

    def _rebuild_penalty_rows(self) -> None:
        assert self.output_counts is not None and self.prompt_mask is not None
        slots = list(self._penalty_rows)
        prompts = [s * self.vocab_size + p for s, (p, _) in self._penalty_rows.items()]
        outputs = [s * self.vocab_size + o for s, (_, o) in self._penalty_rows.items()]
        self._penalty_rows.clear()
        prompt_flat, output_flat = np.concatenate(prompts), np.concatenate(outputs)
        # One copy for all three index lists; sliced apart on the device.
        packed = _to_device(
            np.concatenate([np.asarray(slots, np.int64), prompt_flat, output_flat]), self.device
        )
        n_slots, n_prompt = len(slots), len(prompt_flat)
        slots_dev = packed[:n_slots]
        self.output_counts.index_fill_(0, slots_dev, 0)
        self.prompt_mask.index_fill_(0, slots_dev, False)
        self.prompt_mask.view(-1).index_fill_(0, packed[n_slots : n_slots + n_prompt], True)
        output_dev = packed[n_slots + n_prompt :]
        ones = torch.ones(len(output_flat), dtype=torch.int32, device=self.device)
        self.output_counts.view(-1).index_add_(0, output_dev, ones)
