"""Messages between the frontend and the engine's ranks (msgspec, msgpack-encoded).

The same Structs travel in-process (AsyncEngine with one rank passes them as
objects) and over ZMQ. ``WIRE_VERSION`` names the field order of the positional
(array_like) structs; the handshake refuses a peer with another version.
"""

from __future__ import annotations

import msgspec

from tokenspeed_aio.sampling_params import SamplingParams
from tokenspeed_aio.wire.control import ControlCall, ControlReply

WIRE_VERSION = 9


# -- frontend -> engine -------------------------------------------------------
class Bootstrap(msgspec.Struct, array_like=True, frozen=True):
    """Where a disaggregated request's other half runs, as the gateway named it: the
    prefill engine's bootstrap server and the room both engines know the transfer by."""

    host: str
    port: int
    room: int


class GenerateRequest(msgspec.Struct, tag=True, array_like=True):
    rid: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # resolved by the frontend so every rank samples alike
    bootstrap: Bootstrap | None = None  # a prefill/decode engine's half of a PD request
    group: str = ""  # the client request it belongs to (fair admission); "" = its own


class AbortRequest(msgspec.Struct, tag=True, array_like=True):
    rid: str


class StopEngine(msgspec.Struct, tag=True, array_like=True):
    """Every rank stops after the same round (the stop rides the relay)."""


class Wake(msgspec.Struct, tag=True, array_like=True):
    """Attention DP: another replica got work; an idle replica stops waiting for
    messages so the replicas' rounds (and their DP exchange) run in step at once."""


# A ControlCall (wire/control.py: pause, memory release, a weight update, ...) is answered
# by a ControlReply under its call id, in an OutputBatch's replies.
InboundMessage = GenerateRequest | AbortRequest | StopEngine | Wake | ControlCall


# -- engine -> frontend -------------------------------------------------------
class TokenLogprobs(msgspec.Struct, array_like=True):
    """Logprob of a chosen token and the top-N alternatives (raw model distribution)."""

    logprob: float
    top: list[tuple[int, float]]


class CacheLoad(msgspec.Struct, array_like=True, frozen=True):
    """The host KV tiers (L2 host pool, snapshot pool) of a replica: the pool's state now,
    and counts since start. The scheduler fills the pool and its own counts; the bytes and
    latencies (a cache op's dispatch to its replica-agreed ACK) are the control plane's
    cache-op subsystem's, filled in before the report is sent."""

    host_total_blocks: int
    host_resident_blocks: int  # holding (or being written with) a block
    host_active_blocks: int  # referenced by an open cache op or a retraction image
    l2_hit_tokens: int = 0  # prompt tokens admitted from L2 (loaded back, not computed)
    images: int = 0  # retraction victims imaged (stored, restored later)
    restores: int = 0  # images restored into a slot
    load_backs: int = 0  # acknowledged L2 load-backs
    load_back_bytes: int = 0
    load_back_seconds: float = 0.0  # summed over those load-backs
    write_backs: int = 0  # acknowledged L2 write-backs
    write_back_bytes: int = 0
    write_back_seconds: float = 0.0
    # the L3 storage tier (zero without it): the scheduler's counts ...
    l3_queries: int = 0  # requests whose prefix was queried in the store
    l3_query_hit_tokens: int = 0  # prompt tokens the store was found holding
    l3_fetched_tokens: int = 0  # prompt tokens fetched into L2
    l3_recomputed_tokens: int = 0  # found but not fetched (a failed GET, L2 full)
    l3_preparing: int = 0  # requests preparing now
    # ... and the control plane's, from the agreed reports
    l3_get_bytes: int = 0  # fetched, all ranks
    l3_put_bytes: int = 0  # published, all ranks
    l3_failures: int = 0  # operations failed (timeouts included, cancels not)
    l3_timeouts: int = 0
    l3_queue_depth: int = 0  # operations in the worst member's executor now


# Upper bounds of the tokens-per-round histogram (vLLM's for vllm:iteration_tokens_total).
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class Load(msgspec.Struct, array_like=True, frozen=True):
    """The scheduler's load, sent with every output batch and as the idle heartbeat; the
    JIT counts (the data plane's) and the iteration buckets are filled in by the load
    reporter."""

    running: int
    waiting: int
    resident_blocks: int
    active_blocks: int
    total_blocks: int
    jit_compiles: int = 0  # JIT compilations on the forward thread since serving began
    jit_compile_seconds: float = 0.0
    # Prefill/decode disaggregation: transfers the replica tracks, rooms its peer keeps
    # waiting for a request or a claim, landing pages held until a peer proves it stopped.
    pd_in_flight: int = 0
    pd_unclaimed_rooms: int = 0
    pd_quarantined_pages: int = 0
    forward_rounds: int = 0  # rounds that forwarded a batch, since start (cumulative)
    forward_tokens: int = 0  # tokens those rounds forwarded (prefill + decode, cumulative)
    # Those rounds by their token count: one count per ITERATION_TOKEN_BUCKETS bound (a
    # round counts in the first bound at or above its tokens) and one above the last.
    iteration_buckets: tuple[int, ...] = ()
    num_preemptions: int = 0  # capacity retractions since start (imaged or recomputed)
    cache: CacheLoad | None = None  # None: the host tier is off


class TransferRecord(msgspec.Struct, array_like=True, frozen=True):
    """One KV transfer that ended, for the metrics: the side that reports it, how it ended
    (ok | failed | cancelled), the bytes every rank moved and the seconds it took. An L3
    storage operation is reported the same way, its role ``l3_query``, ``l3_get`` or
    ``l3_put`` (outcome ok | failed | timeout | cancelled)."""

    role: str
    outcome: str
    num_bytes: int
    seconds: float


class TokenOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """New tokens of one request this round; ``finished`` ends its stream."""

    rid: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None  # stop | length | abort | error
    stop_reason: int | None = None  # the stop token id that ended it, if any
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # first output only
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    queue_seconds: float = 0.0  # first output only: scheduler submission -> first forward
    error_status: int = 0  # HTTP-like status of a refusal/failure (400, 409, 503, 500)
    error_message: str | None = None


class OutputBatch(msgspec.Struct, tag=True, array_like=True):
    outputs: list[TokenOutput]
    load: Load
    replica: int = 0  # which attention-DP replica sent it
    replies: list[ControlReply] = msgspec.field(default_factory=list)  # control calls answered
    transfers: list[TransferRecord] = []  # PD transfers that ended since the last batch


OutboundMessage = OutputBatch


# -- handshake ----------------------------------------------------------------
class EngineRegistration(msgspec.Struct, tag=True, frozen=True):
    """What a replica's first member tells the frontend it serves, sent first on the
    input connection. A frontend refuses an engine of another wire version."""

    wire_version: int
    replica: int  # attention-DP replica index
    request_types: tuple[str, ...]  # message kinds it takes ("generate", "abort", "control")
    role: str  # "plain", "prefill" or "decode"
    model: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    num_blocks: int
    page_size: int
    tp: int
    dp: int
    bootstrap_port: int = 0  # a prefill engine's bootstrap server (0: none)


class RegistrationReply(msgspec.Struct, tag=True, frozen=True):
    accepted: bool
    reason: str = ""


HandshakeMessage = EngineRegistration | RegistrationReply
