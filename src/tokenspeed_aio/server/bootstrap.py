"""The gateway's bootstrap fields of a request, turned into each engine request's
Bootstrap: the prefill engine's bootstrap server and the room both engines of a PD
pair know one choice's transfer by.

The SGLang Model Gateway (and its mini-lb) send one host/port/room per request, or
lists: one entry per prompt of a batch (``input_ids`` lists, a ``prompt`` list) or per
choice of a chat with n > 1. Both engines of a pair get the same body, so each derives
the same room for every choice: a list as long as the choices names them; one per
prompt, or a scalar, gives choice ``i`` of a prompt the room ``room + i`` (mod 2**63).
"""

from __future__ import annotations

from tokenspeed_aio.api.frontend import Frontend
from tokenspeed_aio.server.errors import ApiError
from tokenspeed_aio.server.generation import Job
from tokenspeed_aio.wire.messages import Bootstrap

DEFAULT_BOOTSTRAP_PORT = 8998  # what a prefill engine listens on unless told otherwise


def _entry(values, index: int, name: str):
    if isinstance(values, list):
        if not values:
            raise ApiError(400, f"{name}: the list is empty", param=name)
        return values[index] if index < len(values) else values[0]
    return values


def assign_bootstrap(frontend: Frontend, jobs: list[Job], req, num_prompts: int) -> None:
    """Set each job's Bootstrap from the request's bootstrap_* fields (none: a plain
    request) and validate it against the engine (a plain engine refuses one: 400)."""
    host, port, room = req.bootstrap_host, req.bootstrap_port, req.bootstrap_room
    if room is None and host is None:
        return
    if room is None or host is None:
        raise ApiError(
            400, "bootstrap_host and bootstrap_room: give both, or neither", param="bootstrap_room"
        )
    per_choice = isinstance(room, list) and len(room) == len(jobs) > num_prompts
    seen: dict[int, int] = {}  # prompt index -> its choices so far
    for job in jobs:
        index = job.index if per_choice else job.prompt_index
        choice = 0 if per_choice else seen.get(job.prompt_index, 0)
        seen[job.prompt_index] = choice + 1
        value = _entry(room, index, "bootstrap_room")
        where = _entry(port, index, "bootstrap_port") or DEFAULT_BOOTSTRAP_PORT
        if not isinstance(value, int) or isinstance(value, bool):
            raise ApiError(400, "bootstrap_room: must be an integer", param="bootstrap_room")
        if not isinstance(where, int) or isinstance(where, bool):
            raise ApiError(400, "bootstrap_port: must be an integer", param="bootstrap_port")
        job.bootstrap = Bootstrap(
            str(_entry(host, index, "bootstrap_host")), where, (value + choice) % 2**63
        )
        frontend.validate(job.prompt_ids, job.params, job.bootstrap)
