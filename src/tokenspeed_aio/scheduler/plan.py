"""What the scheduler hands the data plane each round, and what comes back.

Every field says why it exists. A plan is frozen once dispatched (the capture
contract): lists in it are the scheduler's copies, never its live state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from tokenspeed_aio.sampling_params import SamplingParams
from tokenspeed_aio.scheduler.cache_ops import CachePlan
from tokenspeed_aio.wire.messages import TokenLogprobs


@dataclass(frozen=True, slots=True)
class NewSlotOwner:
    """Sent on the first forward after a request took a slot (admission or re-admission)
    so the data plane can reset the slot's per-request state (sampling settings,
    penalty counts, block table)."""

    params: SamplingParams
    seed: int  # resolved seed: the request's own or one drawn at admission
    prompt_token_ids: list[int]  # repetition penalty reads prompt presence
    output_token_ids: list[int]  # committed outputs (non-empty after a retraction)


class ScheduledRow(NamedTuple):
    """One request's share of a forward: ``num_tokens`` positions from ``start``.

    A NamedTuple: immutable like the rest of the plan, and built for every running request
    every round, where a frozen dataclass's field-by-field ``__init__`` costs three times
    as much (1.3 us more per row; 0.3 ms of a 256-request round).
    """

    rid: str
    slot: int  # request-pool slot: keys device state (future token, penalties, block table)
    start: int  # first position computed = KV length before this forward
    num_tokens: int  # query length (1 for a decode)
    # Input tokens when the host knows them (prefill chunks). None for a decode: its one
    # input is the token the slot's previous forward sampled, read on the device
    # (future tokens), so dispatch never waits for that forward's commit.
    token_ids: list[int] | None
    # Blocks appended to the slot's block table by this round. A tuple: most rows append
    # none, and the empty tuple is a shared constant, not one more object per row per round.
    new_block_ids: tuple[int, ...]
    block_offset: int  # index in the slot's block table of new_block_ids[0]
    sample: bool  # the row reaches the end of known tokens, so it samples the next one
    output_index: int  # outputs before the sampled one: seeded noise and min_tokens key on it
    new_owner: NewSlotOwner | None
    # Prompt logprobs: the prompt tokens each position of this chunk predicts (may be
    # one shorter than num_tokens on the chunk that ends the prompt), and top-N.
    prompt_logprob_targets: list[int] | None = None
    prompt_logprobs: int = 0
    # A constrained request's grammar matcher, read by the data plane to fill the token
    # bitmask of a sampling row. The registered exception to "plain values only": the
    # commit advances it, so a dispatch with one commits the queue first (Principle 4).
    grammar: object | None = None

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


@dataclass(frozen=True, slots=True)
class PlannedAbort:
    """A request the plan build gave up on (it cannot fit the KV pool even alone)."""

    rid: str
    message: str


@dataclass(frozen=True, slots=True)
class RemotePrefill:
    """Decode engine: a disaggregated request's landing pages, which the transfer peer
    advertises to the prefill engine's ranks (the peer's executor pulls the prompt in)."""

    rid: str
    room: int
    block_ids: tuple[int, ...]  # the pages the prompt's KV lands in, in prompt order
    num_tokens: int  # prompt tokens whose KV lands


@dataclass(frozen=True, slots=True)
class RemoteDecode:
    """Prefill engine: a prompt whose final chunk's result landed; its KV and first token
    go out to the decode engine (the prompt decodes over there)."""

    rid: str
    room: int
    block_ids: tuple[int, ...]  # the source pages, in prompt order
    num_tokens: int
    first_token: int  # the bootstrap token: the decode's first output
    first_logprobs: TokenLogprobs | None  # its logprobs, when the request asked


@dataclass(slots=True)
class ExecutionPlan:
    plan_id: int
    rows: list[ScheduledRow] = field(default_factory=list)  # decodes first, then prefills
    aborts: list[PlannedAbort] = field(default_factory=list)
    # The transfer peer's streams, beside the batch (they occupy no row and go out on
    # rounds with no batch too): landing pages to claim (a decode engine), finished
    # prompts to send (a prefill engine).
    remote_prefill: list[RemotePrefill] = field(default_factory=list)
    remote_decode: list[RemoteDecode] = field(default_factory=list)
    num_retracted: int = 0  # requests retracted to free blocks this round (preemptions)
    # Summaries the scheduler keeps while it builds the rows (each read every round):
    num_tokens: int = 0  # sum of the rows' num_tokens
    has_grammar: bool = False  # some sampling row carries a grammar matcher
    # Copies between the device pool and the host tiers (scheduler/cache_ops.py); None when
    # the plan has none, which is every plan with the host tier off.
    cache: CachePlan | None = None
    # Device-to-device block copies (src, dst) and blocks to zero before the batch runs,
    # submitted between the host-bound stores and the device-bound loads (DeviceHandle.
    # execute states the order). A plan makes neither today; they are the contract for a
    # private copy of a shared block and for a new owner's sanitization.
    pages_to_copy: tuple[tuple[int, int], ...] = ()
    pages_to_zero: tuple[int, ...] = ()

    def needs_device(self) -> bool:
        """Anything for the data plane: a batch, a cache op, a device block copy, a remote
        stream."""
        return bool(
            self.rows
            or self.cache
            or self.pages_to_copy
            or self.pages_to_zero
            or self.remote_prefill
            or self.remote_decode
        )

    @property
    def sample_rows(self) -> list[ScheduledRow]:
        return [r for r in self.rows if r.sample]


@dataclass(slots=True)
class ForwardResult:
    """Plain-Python results of one forward, built from the landed host copies."""

    plan_id: int
    tokens: list[int]  # one per sampling row, in row order
    logprobs: list[TokenLogprobs] | None  # aligned with tokens, when any row asked
    # rid -> one entry per target of that row's prompt_logprob_targets
    prompt_logprobs: dict[str, list[TokenLogprobs]] | None = None
    jit_compiles: int = 0  # JIT compilations on the forward thread since serving began
    jit_compile_seconds: float = 0.0


@dataclass(frozen=True, slots=True)
class ForwardCommitted:
    """Tail event: a dispatched forward's results were committed by the output module."""

    plan_id: int
    # One per sampling row, in row order: the token appended, or None where the request
    # had ended while the forward was in flight (its extra token is dropped).
    tokens: list[int | None]
    # The forward's logprobs, aligned with tokens (None when no row asked): a prefill
    # engine sends a prompt's first token with its logprobs.
    logprobs: list[TokenLogprobs] | None = None


@dataclass(frozen=True, slots=True)
class RequestFinished:
    """Tail event: the output module ended this request (stop, length, abort)."""

    rid: str


@dataclass(frozen=True, slots=True)
class TransferLanded:
    """Tail event (decode engine): a request's prompt KV landed on every rank of the
    replica, with its first token; the request decodes from here."""

    rid: str
    token: int


@dataclass(frozen=True, slots=True)
class TransferFailed:
    """Tail event: the replica agreed that a request's transfer failed or was cancelled.
    The request is planned nothing more but keeps its pages: remote writes may still be
    queued or executing until TransferRetired."""

    rid: str


@dataclass(frozen=True, slots=True)
class TransferRetired:
    """Tail event: every transfer job of the request retired on every rank (a prefill
    engine's send completed, or a failed transfer's writes provably stopped): its pages
    are free."""

    rid: str


TransferEvent = TransferLanded | TransferFailed | TransferRetired
