"""The model runner: one ExecutionPlan -> one launched forward, on the forward thread.

Per round: apply the rows' slot changes (new owners' sampling state, appended
blocks), build the inputs on the host (batch_inputs.py), run the model -- a CUDA
graph replay for decode batches it has captured, else eagerly -- then the sampler;
write each sampling row's token into the slot's future-token buffer (the next
decode reads it there), and start the result copies (landing.py). A graph replay
also takes the argmax and writes the future tokens itself (cuda_graph.py): when
every row takes the plain argmax, the sampler is skipped.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import torch

from tokenspeed_aio.data_plane.batch_inputs import HostBatch, build_host_batch
from tokenspeed_aio.data_plane.cuda_graph import DecodeGraphs, DecodeRows
from tokenspeed_aio.data_plane.forward_timeline import ForwardTimeline
from tokenspeed_aio.data_plane.grammar_mask import fill_token_bitmask
from tokenspeed_aio.data_plane.landing import Landing, LaunchedForward, to_host
from tokenspeed_aio.guards.compile_monitor import compile_monitor
from tokenspeed_aio.guards.host_sync import host_to_device
from tokenspeed_aio.model.forward_context import AttentionMetadata, ForwardContext
from tokenspeed_aio.model.sampling.sampler import Sampler, compute_token_logprobs
from tokenspeed_aio.model.sampling.state import SamplingState
from tokenspeed_aio.scheduler.plan import ExecutionPlan, ScheduledRow

_ALIGN_BYTES = 16


def warm_up_rows(max_decodes: int) -> list[int]:
    """The decode-row counts the startup warm-up runs: one of each form a backend's decode
    kernel takes by row count -- one row (which may have tiles of its own), several rows
    split over the keys, many rows in one KV split. The split count only falls as rows
    grow, so 2 stands for every count that still splits and ``max_decodes`` for every count
    that does not."""
    return sorted({1, min(2, max_decodes), max_decodes})


def _packed(arrays: list[np.ndarray], dtype, device: torch.device) -> list[torch.Tensor]:
    """One host->device copy for several arrays, returned as device views.

    Each view starts 16-byte aligned: Triton specializes kernels on pointer alignment,
    so offsets that follow the batch's sizes would compile new variants while serving.
    """
    per = _ALIGN_BYTES // np.dtype(dtype).itemsize
    sizes = [len(a) for a in arrays]
    slots = [-(-n // per) * per for n in sizes]
    packed = np.zeros(sum(slots), dtype)
    offset = 0
    for array, slot in zip(arrays, slots):
        packed[offset : offset + len(array)] = array
        offset += slot
    views = torch.split(host_to_device(packed, device), slots)
    return [view[:n] for view, n in zip(views, sizes)]


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
        kv_scales: tuple[tuple[torch.Tensor, torch.Tensor], ...] | None = None,
        max_num_seqs: int,
        max_model_len: int,
        eos_token_ids: Sequence[int],
        device: torch.device,
    ) -> None:
        self.model = model
        self.backend = backend
        self.k_caches = k_caches
        self.v_caches = v_caches
        self.kv_scales = kv_scales  # an FP8 cache's per-layer (k, v) scales
        self.page_size = page_size
        self.device = device
        self.max_model_len = max_model_len
        self.eos_token_ids = tuple(eos_token_ids)
        self.max_blocks_per_seq = -(-max_model_len // page_size)
        # Host mirror of every slot's block table; rows ship the changes.
        self.block_table = np.zeros((max_num_seqs, self.max_blocks_per_seq), np.int32)
        # Future tokens: the token each slot sampled last, read by its next decode; one
        # entry more for the decode graphs' dummy rows.
        self.last_sampled = torch.zeros(max_num_seqs + 1, dtype=torch.int64, device=device)
        self.sampling = SamplingState(max_num_seqs, vocab_size, device)
        self.sampler = Sampler()
        self.graphs: DecodeGraphs | None = None
        self.timeline = ForwardTimeline(device)
        # (num_decodes, chunk) -> a null forward's inputs, built once (``_null_inputs``).
        self._null: dict[tuple[int, int], tuple[AttentionMetadata, torch.Tensor, torch.Tensor]] = {}

    def capture_graphs(self, sizes: list[int]) -> None:
        self.graphs = DecodeGraphs(
            self.model,
            self.backend,
            self.k_caches,
            self.v_caches,
            self.kv_scales,
            self.last_sampled,
            sizes=sizes,
            max_blocks_per_seq=self.max_blocks_per_seq,
            max_model_len=self.max_model_len,
            device=self.device,
        )
        self.graphs.capture()

    @torch.inference_mode()
    def execute(self, plan: ExecutionPlan, fences=None) -> LaunchedForward:
        """The plan's batch; ``fences`` (cache/fences.py) when its load-backs are still
        landing: the eager forward waits per layer, a graph replay for the whole load."""
        rows = plan.rows
        self.timeline.forward_started()
        self._apply_row_state(rows)
        host = build_host_batch(rows, self.block_table, self.page_size)
        bs = self.graphs.graph_size(host.num_rows) if self.graphs and host.decode_only else None
        argmax = None
        if bs is not None:
            inputs = DecodeRows(
                host.positions, host.slot_mapping, host.slots, host.seq_lens, host.block_tables
            )
            if fences is not None:
                fences.wait_all()
            logits, argmax = self.graphs.replay(bs, inputs)
        else:
            logits = self._eager(host, fences)
        sample_rows = [r for r in rows if r.sample]
        prompt_rows = [r for r in rows if r.prompt_logprob_targets]
        landing = self._sample(sample_rows, logits[: len(sample_rows)], argmax)
        if prompt_rows:
            self._prompt_logprobs(prompt_rows, logits[len(sample_rows) :], landing)
        event = self.timeline.forward_ended()
        stats = compile_monitor().stats
        jit = (stats.serving_compiles, stats.serving_compile_seconds)
        return LaunchedForward(plan, landing, prompt_rows, event, jit)

    def _eager(self, host: HostBatch, fences=None) -> torch.Tensor:
        """Ship the metadata in two packed copies (int64, int32) and run the model."""
        b, t = host.num_rows, host.num_tokens
        bt = host.block_tables
        ids, pos, smap, lidx = _packed(
            [host.input_ids, host.positions, host.slot_mapping, host.logits_index],
            np.int64,
            self.device,
        )
        qsl, seq_lens, ctx_lens, bt_dev = _packed(
            [host.query_start_loc, host.seq_lens, host.context_lens, bt.reshape(-1)],
            np.int32,
            self.device,
        )
        meta = AttentionMetadata(
            num_tokens=t,
            num_rows=b,
            max_query_len=int(host.query_lens.max()),
            max_seq_len=int(host.seq_lens.max()),
            is_decode_only=host.decode_only,
            query_start_loc=qsl,
            seq_lens=seq_lens,
            context_lens=ctx_lens,
            block_tables=bt_dev.view(bt.shape),
            slot_mapping=smap,
            query_lens_host=tuple(host.query_lens.tolist()),
            seq_lens_host=tuple(host.seq_lens.tolist()),
            num_decodes=host.num_decodes,
        )
        if self.backend.plans_on_host:
            self.backend.plan(host.query_lens, host.seq_lens, bt)
        n = host.num_decodes
        if n:  # future tokens: decode inputs are the slots' last sampled tokens
            ids[:n] = self.last_sampled[ids[:n]]
        ctx = self._context(meta, fences)
        hidden = self.model(ids, pos, ctx)
        return self.model.compute_logits(hidden[lidx])

    def idle_forward(self) -> None:
        """One dummy token on the null block that writes no KV (slot -1): the rank
        enters every collective of a forward without touching any request's state."""
        self._null_forward(num_decodes=1, chunk=0)

    def warm_up_eager(self, max_decodes: int) -> None:
        """Compile, at startup, what an eager forward launches: decode rows alone (a batch
        no captured graph holds) and beside a prefill chunk, at each of ``warm_up_rows``'
        decode-row counts."""
        for decodes in warm_up_rows(max_decodes):
            for chunk in (0, 2):
                self._null_forward(num_decodes=decodes, chunk=chunk)

    @torch.inference_mode()
    def _null_forward(self, num_decodes: int, chunk: int) -> None:
        """A forward of ``num_decodes`` one-token decode rows and, if ``chunk``, a prefill
        row of that many tokens, which read only the null block and write nothing (slot -1)."""
        key = (num_decodes, chunk)
        if key not in self._null:
            self._null[key] = self._null_inputs(num_decodes, chunk)
        meta, ids, positions = self._null[key]
        if self.backend.plans_on_host:
            lens = np.asarray(meta.query_lens_host, np.int32)
            self.backend.plan(lens, lens, np.zeros((meta.num_rows, 1), np.int32))
        self.model(ids, positions, self._context(meta))

    def _context(self, meta: AttentionMetadata, fences=None) -> ForwardContext:
        return ForwardContext(
            meta, self.backend, self.k_caches, self.v_caches, self.kv_scales, fences
        )

    def _null_inputs(
        self, num_decodes: int, chunk: int
    ) -> tuple[AttentionMetadata, torch.Tensor, torch.Tensor]:
        """``_null_forward``'s metadata, input ids and positions, built on the device alone:
        no host copy, so they may be built while serving. Nothing writes them."""
        rows = num_decodes + (1 if chunk else 0)
        t = num_decodes + chunk
        i32 = dict(dtype=torch.int32, device=self.device)
        seq_lens = torch.cat(
            [torch.ones(num_decodes, **i32), torch.full((rows - num_decodes,), chunk, **i32)]
        )
        qsl = torch.cat(
            [torch.arange(num_decodes + 1, **i32), torch.full((rows - num_decodes,), t, **i32)]
        )
        lens = (1,) * num_decodes + ((chunk,) if chunk else ())
        meta = AttentionMetadata(
            num_tokens=t,
            num_rows=rows,
            max_query_len=max(lens),
            max_seq_len=max(lens),
            is_decode_only=not chunk,
            query_start_loc=qsl,
            seq_lens=seq_lens,
            context_lens=torch.zeros(rows, **i32),
            block_tables=torch.zeros(rows, 1, **i32),
            slot_mapping=torch.full((t,), -1, dtype=torch.int64, device=self.device),
            query_lens_host=lens,
            seq_lens_host=lens,
            num_decodes=num_decodes,
        )
        i64 = dict(dtype=torch.int64, device=self.device)
        positions = torch.cat([torch.zeros(num_decodes, **i64), torch.arange(chunk, **i64)])
        return meta, torch.zeros(t, **i64), positions

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

    def _sample(
        self, rows: Sequence[ScheduledRow], logits: torch.Tensor, argmax: torch.Tensor | None
    ) -> Landing:
        """Sample the rows (``argmax``: the logits' argmax a graph replay already wrote to
        the future-token buffer, or None)."""
        if not rows:
            return Landing(tokens=torch.empty(0, dtype=torch.int64))
        slots, steps = [r.slot for r in rows], [r.output_index for r in rows]
        mask = fill_token_bitmask(rows, self.sampling.vocab_size, self.device)
        host = self.sampling.host_rows(slots, steps)
        if argmax is not None and mask is None and host.plain_greedy:
            return Landing(tokens=to_host(argmax))
        batch = self.sampling.prepare_rows(host)
        out = self.sampler(logits, batch, mask)
        self.sampling.record(batch, out.tokens)
        self.last_sampled.index_copy_(0, batch.slots, out.tokens)
        return Landing(
            tokens=to_host(out.tokens),
            logprobs=to_host(out.logprobs),
            top_ids=to_host(out.top_ids),
            top_logprobs=to_host(out.top_logprobs),
        )

    def _prompt_logprobs(
        self, rows: Sequence[ScheduledRow], logits: torch.Tensor, landing: Landing
    ) -> None:
        targets = np.fromiter(
            itertools.chain.from_iterable(r.prompt_logprob_targets for r in rows), np.int64
        )
        num_top = max(r.prompt_logprobs for r in rows)
        lps, top_ids, top_lps = compute_token_logprobs(
            logits, host_to_device(targets, self.device), num_top
        )
        landing.prompt_logprobs = to_host(lps)
        landing.prompt_top_ids = to_host(top_ids) if num_top else None
        landing.prompt_top_logprobs = to_host(top_lps) if num_top else None
