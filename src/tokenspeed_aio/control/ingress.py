"""Admission: the round's received messages become scheduler requests, aborts and
refusals, following the design's request-identity rules.

* A rid repeated within one round, or still owned by the output processor, is
  discarded with a warning: answering it would end the original's stream, since
  the wire identifies a stream by rid alone. The original is untouched.
* A rid the scheduler still holds after its output completed (its last forwards
  are draining) is refused with 409 before any data-plane admission.

The request itself was validated once, by the frontend (prompt, vocabulary, context
length, sampling limits): the rank checks only what it alone knows.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tokenspeed_aio.control.output import refusal
from tokenspeed_aio.scheduler.request import Request
from tokenspeed_aio.wire.messages import (
    AbortRequest,
    ControlCall,
    GenerateRequest,
    InboundMessage,
    StopEngine,
    TokenOutput,
)

logger = logging.getLogger(__name__)


@dataclass
class Admission:
    requests: list[Request] = field(default_factory=list)  # to submit, arrival order
    constrained: list[Request] = field(default_factory=list)  # to the grammar queue first
    aborted: list[str] = field(default_factory=list)  # owned rids the clients aborted
    refusals: list[TokenOutput] = field(default_factory=list)  # final outputs to send
    stop: bool = False
    # Control calls with their position among the round's messages, and each request's
    # position: a call and the requests before it keep their order (control/control.py).
    calls: list[tuple[int, ControlCall]] = field(default_factory=list)
    positions: dict[str, int] = field(default_factory=dict)


class Ingress:
    def __init__(self, *, max_model_len: int, role: str = "plain") -> None:
        self.max_model_len = max_model_len  # caps a request's outputs (max_output)
        # A prefill engine samples one token of a disaggregated request: the decode
        # engine samples the rest.
        self.sends_kv = role == "prefill"

    def admit(
        self,
        messages: Sequence[InboundMessage],
        *,
        owned: Callable[[str], bool],
        held: Callable[[str], bool],
    ) -> Admission:
        adm = Admission()
        batch: dict[str, Request] = {}
        for index, msg in enumerate(messages):
            if isinstance(msg, GenerateRequest):
                self._admit_one(msg, adm, batch, owned, held)
                adm.positions[msg.rid] = index
            elif isinstance(msg, AbortRequest):
                if msg.rid in batch:  # aborted in the round it arrived: never submitted
                    del batch[msg.rid]
                    adm.refusals.append(refusal(msg.rid, 0, None, reason="abort"))
                elif owned(msg.rid):
                    adm.aborted.append(msg.rid)
            elif isinstance(msg, StopEngine):
                adm.stop = True
            elif isinstance(msg, ControlCall):
                adm.calls.append((index, msg))
        for req in batch.values():
            (adm.constrained if req.params.has_grammar else adm.requests).append(req)
        return adm

    def _admit_one(
        self,
        msg: GenerateRequest,
        adm: Admission,
        batch: dict[str, Request],
        owned: Callable[[str], bool],
        held: Callable[[str], bool],
    ) -> None:
        rid = msg.rid
        if rid in batch or owned(rid):
            logger.warning("discarding a duplicate submission of request %r", rid)
            return
        if held(rid):
            adm.refusals.append(
                refusal(rid, 409, f"request id {rid!r} is still held by the engine; use a new id")
            )
            return
        prompt_len = len(msg.prompt_token_ids)
        room = self.max_model_len - prompt_len
        max_tokens = msg.params.max_tokens
        if msg.bootstrap is not None and self.sends_kv:
            max_tokens = 1
        req = Request(
            rid,
            msg.prompt_token_ids,
            msg.params,
            seed=msg.seed,
            max_output=room if max_tokens is None else min(max_tokens, room),
            bootstrap=msg.bootstrap,
            group=msg.group,
        )
        batch[rid] = req
