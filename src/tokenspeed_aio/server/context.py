"""What every route of one server shares: the frontend, the served model's name,
metrics, the running requests, and the token-string cache."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenspeed_aio.api.frontend import Frontend
from tokenspeed_aio.server.errors import ApiError
from tokenspeed_aio.server.generation import Fanout, Job
from tokenspeed_aio.server.idle_trim import IdleTrim
from tokenspeed_aio.server.logprobs import TokenTexts
from tokenspeed_aio.server.metrics import ServerMetrics
from tokenspeed_aio.server.options import ServerOptions
from tokenspeed_aio.server.request_registry import RequestRegistry
from tokenspeed_aio.tokenization.parsers import (
    REASONING_PARSERS,
    TOOL_PARSERS,
    ReasoningParser,
    ToolParser,
)


@dataclass
class ServerContext:
    frontend: Frontend
    served_model_name: str  # the name responses carry
    metrics: ServerMetrics
    options: ServerOptions = field(default_factory=ServerOptions)
    served_model_names: tuple[str, ...] = ()  # every name a request may use (the first's too)
    generation_defaults: dict[str, Any] = field(default_factory=dict)
    model_path: str = ""
    engine_args: dict[str, Any] = field(default_factory=dict)  # for /server_info
    # The running requests; when the last one ends the allocator's free memory goes back.
    registry: RequestRegistry = field(default_factory=lambda: RequestRegistry(IdleTrim()))
    draining: bool = False  # the server is stopping: new requests are answered 503
    token_texts: TokenTexts = field(init=False)
    tool_parser: ToolParser | None = field(init=False)
    reasoning_parser: ReasoningParser | None = field(init=False)

    def __post_init__(self) -> None:
        self.token_texts = TokenTexts(self.frontend.tokenizer)
        if self.served_model_name not in self.served_model_names:
            self.served_model_names = (self.served_model_name, *self.served_model_names)
        tool, reasoning = self.options.tool_call_parser, self.options.reasoning_parser
        self.tool_parser = TOOL_PARSERS[tool]() if tool else None
        self.reasoning_parser = REASONING_PARSERS[reasoning]() if reasoning else None

    def check_model(self, model: str | None) -> None:
        """404 for a model this server does not serve (None: the served one)."""
        if model is not None and model not in self.served_model_names:
            raise ApiError(
                404,
                f"the model {model!r} does not exist; this server serves "
                f"{', '.join(map(repr, self.served_model_names))}",
                param="model",
                code="model_not_found",
            )

    def fanout(self, request_id: str, jobs: list[Job]) -> Fanout:
        """The request's running choices, once admission allows them: at most
        ``max_sequences_per_request`` (400), and room among the sequences already
        admitted (429 with Retry-After)."""
        limit = self.options.max_sequences_per_request
        if len(jobs) > limit:
            raise ApiError(
                400,
                f"n: this request creates {len(jobs)} sequences (prompts x n); the limit is "
                f"{limit} per request (--max-sequences-per-request)",
                param="n",
                code="too_many_sequences",
            )
        cap = self.options.max_waiting_sequences
        if self.registry.sequences + len(jobs) > cap:
            raise ApiError(
                429,
                f"the server is at capacity: {self.registry.sequences} sequences are running "
                f"or waiting and this request adds {len(jobs)}; the limit is {cap} "
                "(--max-waiting-sequences); retry later",
                code="queue_full",
                headers={"retry-after": "1"},
            )
        return Fanout(
            self.frontend, self.metrics, self.registry, request_id, jobs,
            self.options.max_stream_backlog,
        )  # fmt: skip

    def healthy(self) -> tuple[bool, str]:
        """(True, "ok"), or (False, why) when the engine is dead or a replica is silent."""
        if self.frontend.dead is not None:
            return False, f"the engine is dead: {self.frontend.dead.message}"
        stale = self.frontend.stale_replicas()
        if stale:
            return False, f"no load report lately from replica(s) {stale}"
        return True, "ok"
