"""The scheduler's view of one request: counters, not phases.

``num_computed`` catches up with ``num_tokens``; chunked prefill, prefix hits, decode
and retraction are all that one rule. ``num_pending`` counts tokens already being
sampled by dispatched forwards but not committed yet (at in-flight depth >= 1 the
next round is planned before they land).
"""

from __future__ import annotations

import enum

from tokenspeed_aio.sampling_params import SamplingParams
from tokenspeed_aio.wire.messages import Bootstrap


class Status(enum.Enum):
    WAITING = "waiting"  # submitted or retracted: holds no blocks, no slot
    RUNNING = "running"  # resident: holds blocks and a slot
    RESTORING = "restoring"  # holds blocks and a slot its retraction image is copied into
    # L3: out of the waiting queue while the store is asked for its prefix and the pages
    # found are fetched into L2 (scheduler/storage.py); holds no device block, no slot
    PREPARING = "preparing"
    # Prefill/decode disaggregation: holds its pages (and on a decode engine its slot) and
    # is planned no forward while its KV transfer runs or retires (scheduler/transfers.py)
    TRANSFERRING = "transferring"
    FINISHED = "finished"  # ended; held only while dispatched forwards still read it


class Request:
    __slots__ = (
        "block_hashes",
        "block_ids",
        "bootstrap",
        "grammar",
        "group",
        "image",
        "max_output",
        "num_blocks_sent",
        "num_cached_blocks",
        "num_cached_tokens",
        "num_computed",
        "num_inflight",
        "num_pending",
        "num_prompt_logprobs",
        "params",
        "prompt_len",
        "queue_seconds",
        "rid",
        "room",
        "sampled_on_slot",
        "seed",
        "slot",
        "status",
        "storage",
        "storage_settled",
        "submitted_at",
        "token_ids",
        "turn",
        "wants_prompt_logprobs",
    )

    def __init__(
        self,
        rid: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        seed: int,
        max_output: int,
        bootstrap: Bootstrap | None = None,
        group: str = "",
    ) -> None:
        self.rid = rid
        self.group = group or rid  # the client request it belongs to (fair admission)
        self.turn = (0, 0)  # its place in the waiting queue: (round of its group, arrival)
        self.token_ids = list(prompt_token_ids)  # prompt + committed outputs
        self.prompt_len = len(prompt_token_ids)
        self.params = params
        self.wants_prompt_logprobs = params.prompt_logprobs is not None
        self.num_prompt_logprobs = params.prompt_logprobs or 0  # top-N, read by every row
        self.seed = seed
        self.max_output = max_output  # max_tokens capped by the context length
        self.status = Status.WAITING
        self.num_computed = 0
        self.num_pending = 0
        self.num_inflight = 0  # dispatched, uncommitted forwards that include this request
        self.block_ids: list[int] = []
        self.num_blocks_sent = 0  # prefix of block_ids the slot's device table already has
        # (hash, parent hash, tokens) of each full block of known tokens, computed lazily.
        self.block_hashes: list[tuple[int, int | None, tuple[int, ...]]] = []
        self.num_cached_blocks = 0  # prefix of block_ids published in the prefix cache
        self.num_cached_tokens = 0  # prefix-cache hit at first admission (reported)
        self.slot = -1
        self.submitted_at = 0.0  # monotonic time it entered the waiting queue
        self.queue_seconds = 0.0  # waiting until its first forward (a metric; once)
        # The grammar matcher of a constrained request (attached when its grammar compiled):
        # advanced by the commit, read by the data plane to mask the next token.
        self.grammar = None
        self.sampled_on_slot = False  # the slot's device state holds this request's last token
        # Its retraction image (host_tier.RetractionImage) while it waits to be restored,
        # and until the restore landed; None otherwise.
        self.image = None
        # The KV transfer room of a disaggregated request while its transfer is tracked:
        # a prefill engine sends its prompt's KV out, a decode engine receives it. None
        # for a plain request, and once the transfer ended (a landed request decodes as
        # a plain one from then on).
        self.room = None if bootstrap is None else bootstrap.room
        # L3: its storage transaction (storage.Preparation) while it prepares and until it
        # is admitted; and whether it was prepared already (it is prepared once)
        self.storage = None
        self.storage_settled = False
        self.bootstrap = bootstrap  # where the other half runs (the transfer peer's)

    @property
    def num_tokens(self) -> int:
        """Known plus pending tokens: the sequence as the next forward sees it."""
        return len(self.token_ids) + self.num_pending

    @property
    def num_output(self) -> int:
        """Outputs committed or being sampled."""
        return self.num_tokens - self.prompt_len

    def __repr__(self) -> str:
        return (
            f"Request({self.rid!r}, {self.status.value}, computed={self.num_computed}/"
            f"{self.num_tokens}, pending={self.num_pending}, blocks={len(self.block_ids)})"
        )
