"""The one row builder: a running request's share of the round's forward."""

from __future__ import annotations

from tokenspeed_aio.scheduler.block_pool import BlockPool
from tokenspeed_aio.scheduler.plan import ExecutionPlan, NewSlotOwner, ScheduledRow
from tokenspeed_aio.scheduler.prefix_cache import publish_full_blocks
from tokenspeed_aio.scheduler.request import Request

_make_row = ScheduledRow._make


def schedule_row(
    plan: ExecutionPlan,
    req: Request,
    n: int,
    num_tokens: int,
    new_owner: NewSlotOwner | None,
    pool: BlockPool,
) -> ScheduledRow:
    """``n`` positions of ``req`` from ``num_computed``; the row samples when it reaches the
    end of the known tokens (``num_tokens``).

    A decode (the slot sampled the request's last token) is one position whose input the
    device holds (the host may not yet, at depth >= 1): its row carries no token ids. A
    prefill chunk carries the tokens the host knows.

    NOTE: runs once per running request per round: it reads the request's fields once,
    into locals, and builds the row with _make (its fields as one tuple, in field order:
    the cheapest way to build a NamedTuple).
    """
    start = req.num_computed
    end = start + n
    sample = end == num_tokens
    token_ids = req.token_ids
    prompt_len = req.prompt_len
    block_ids = req.block_ids
    num_blocks = len(block_ids)
    sent = req.num_blocks_sent
    targets = None
    if start < prompt_len and req.wants_prompt_logprobs:
        targets = token_ids[start + 1 : min(end + 1, prompt_len)]
    grammar = req.grammar if sample else None
    if grammar is not None:
        plan.has_grammar = True
    row = _make_row(
        (
            req.rid,  # rid
            req.slot,  # slot
            start,  # start
            n,  # num_tokens
            None if req.sampled_on_slot else token_ids[start:end],  # token_ids
            () if num_blocks == sent else tuple(block_ids[sent:]),  # new_block_ids
            sent,  # block_offset
            sample,  # sample
            num_tokens - prompt_len,  # output_index
            new_owner,  # new_owner
            targets,  # prompt_logprob_targets
            req.num_prompt_logprobs,  # prompt_logprobs
            grammar,  # grammar
        )
    )
    req.num_blocks_sent = num_blocks
    req.num_computed = end
    req.num_inflight += 1
    if sample:
        req.num_pending += 1
        req.sampled_on_slot = True  # from now on its rows are decodes
    known = len(token_ids)
    if (end if end < known else known) // pool.page_size > req.num_cached_blocks:
        publish_full_blocks(pool, req)  # a block's tokens are now all dispatched
    return row
