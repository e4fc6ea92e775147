"""The forward's inputs built on the host from a plan's rows: numpy, vectorized over
the batch, no device access. The runner ships them eagerly (two packed copies) or
into the static buffers of a CUDA graph (cuda_graph.py pads them to the graph's batch size).

    tokens:  | d0 | d1 | ... | p0 p0 p0 p0 | p1 p1 | ...
    row:       0    1          D             D+1
    decode inputs come from the device (future tokens); prefill inputs from the plan.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tokenspeed_aio.scheduler.plan import ScheduledRow


@dataclass(slots=True)
class HostBatch:
    num_rows: int
    num_tokens: int
    num_decodes: int  # leading rows whose one input token is read on the device
    slots: np.ndarray  # [B] int64
    query_lens: np.ndarray  # [B]
    context_lens: np.ndarray  # [B] KV length before this forward
    seq_lens: np.ndarray  # [B] KV length after it
    query_start_loc: np.ndarray  # [B + 1]
    positions: np.ndarray  # [T] int64
    slot_mapping: np.ndarray  # [T] int64
    input_ids: np.ndarray  # [T] int64; decode entries hold the slot to gather from
    logits_index: np.ndarray  # sampling rows' last tokens, then prompt-logprob positions
    block_tables: np.ndarray  # [B, max_blocks] int32

    @property
    def decode_only(self) -> bool:
        return self.num_decodes == self.num_rows


def build_host_batch(
    rows: Sequence[ScheduledRow], block_table: np.ndarray, page_size: int
) -> HostBatch:
    b = len(rows)
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
    blocks = block_table[slots[row_of], positions // page_size]
    slot_mapping = blocks.astype(np.int64) * page_size + positions % page_size
    input_ids = np.empty(t, np.int64)
    input_ids[:n_decodes] = slots[:n_decodes]
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
    max_blocks = -(-int(seq_lens.max()) // page_size)
    return HostBatch(
        num_rows=b,
        num_tokens=t,
        num_decodes=n_decodes,
        slots=slots,
        query_lens=qlens,
        context_lens=starts,
        seq_lens=seq_lens,
        query_start_loc=qsl,
        positions=positions,
        slot_mapping=slot_mapping,
        input_ids=input_ids,
        logits_index=np.asarray(logits_index, np.int64),
        block_tables=block_table[slots, :max_blocks],
    )
