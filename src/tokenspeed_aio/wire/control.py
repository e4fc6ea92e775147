"""Control operations on the wire: what RL frameworks and operators ask of a running engine
between rollouts (SGLang's admin routes), and the reply that answers each.

The frontend sends one ``ControlCall`` per operation to every replica, under one call id and
in one order; the replica's first member relays it to its members like a request, and
answers with a ``ControlReply`` under the same id in an output batch. The operations are
low-rate, so they travel as tagged maps (field names, not positions): adding a field with a
default keeps older peers readable.
"""

from __future__ import annotations

import msgspec

PAUSE_MODES = ("abort", "wait", "keep")
MEMORY_TAGS = ("kv_cache", "weights")
DEFAULT_WEIGHT_GROUP = "weight_update_group"
# Seconds one collective of a trainer group may wait for its peers (a trainer that hangs
# fails the update after this long instead of holding the forward thread)
DEFAULT_GROUP_TIMEOUT = 60.0
# How a staging failure that is no fault of the request begins (a trainer that died or
# hung mid-broadcast): the gate answers it 502, not 400
BROADCAST_FAILED = "the trainer's broadcast failed"


class PauseGeneration(msgspec.Struct, tag=True, kw_only=True):
    """abort: end what runs; wait: let it finish; keep: freeze it (answered at once). Every
    mode holds admission until ContinueGeneration; requests that arrive meanwhile wait."""

    mode: str = "abort"


class ContinueGeneration(msgspec.Struct, tag=True, kw_only=True):
    """End the pause: frozen requests run again, held ones are admitted."""


class ReleaseMemory(msgspec.Struct, tag=True, kw_only=True):
    """Drain like a wait pause, then free these regions' device memory (every tag if empty)."""

    tags: list[str] = msgspec.field(default_factory=list)


class ResumeMemory(msgspec.Struct, tag=True, kw_only=True):
    """Map the released regions back (every released tag if empty)."""

    tags: list[str] = msgspec.field(default_factory=list)


class FlushCache(msgspec.Struct, tag=True, kw_only=True):
    """Drop the prefix cache; refused while requests hold KV blocks."""


class UpdateWeightsFromDisk(msgspec.Struct, tag=True, kw_only=True):
    model_path: str  # a checkpoint directory of the same architecture and shapes
    load_format: str | None = None  # auto | safetensors
    flush_cache: bool = True
    weight_version: str | None = None


class UpdateWeightsFromTensor(msgspec.Struct, tag=True, kw_only=True):
    """Named tensors pickled by torch's multiprocessing reductions (CUDA tensors travel as
    IPC handles), or a safetensors file's bytes: one payload per TP rank, or one for all."""

    payloads: list[bytes]
    load_format: str | None = None  # None (torch multiprocessing pickle) | "safetensors"
    flush_cache: bool = True
    weight_version: str | None = None


class InitWeightsGroup(msgspec.Struct, tag=True, kw_only=True):
    """Join a torch.distributed group with the trainer, whose rank 0 hosts the store at
    master_address:master_port; engine rank r joins as rank_offset + r."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = DEFAULT_WEIGHT_GROUP
    backend: str | None = None  # nccl on GPU, gloo on CPU when unset
    timeout_seconds: float = DEFAULT_GROUP_TIMEOUT


class UpdateWeightsFromDistributed(msgspec.Struct, tag=True, kw_only=True):
    """Receive these tensors by broadcasts from the trainer's rank 0, in this order."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = DEFAULT_WEIGHT_GROUP
    flush_cache: bool = True
    weight_version: str | None = None


class DestroyWeightsGroup(msgspec.Struct, tag=True, kw_only=True):
    group_name: str = DEFAULT_WEIGHT_GROUP


class StartProfile(msgspec.Struct, tag=True, kw_only=True):
    """The torch profiler on the forward thread; traces go to ``output_dir``."""

    output_dir: str
    num_steps: int | None = None  # stop by itself after this many forwards
    activities: list[str] = msgspec.field(default_factory=lambda: ["CPU", "GPU"])
    record_shapes: bool = False


class StopProfile(msgspec.Struct, tag=True, kw_only=True):
    """Stop the running profile and write its trace (the operation carries no field)."""


ControlOp = (
    PauseGeneration
    | ContinueGeneration
    | ReleaseMemory
    | ResumeMemory
    | FlushCache
    | UpdateWeightsFromDisk
    | UpdateWeightsFromTensor
    | InitWeightsGroup
    | UpdateWeightsFromDistributed
    | DestroyWeightsGroup
    | StartProfile
    | StopProfile
)

WEIGHT_UPDATES = (UpdateWeightsFromDisk, UpdateWeightsFromTensor, UpdateWeightsFromDistributed)
# Ops that complete only through the same-round gate: every DP rank at once.
GATED = (FlushCache, InitWeightsGroup, DestroyWeightsGroup, *WEIGHT_UPDATES)


class ControlCall(msgspec.Struct, tag=True, array_like=True):
    call_id: int  # the frontend's id: the same on every replica, answered by one reply each
    op: ControlOp


class ControlReply(msgspec.Struct, array_like=True, omit_defaults=True):
    call_id: int
    ok: bool
    message: str = ""
    status: int = 200  # HTTP-like: 400 bad argument, 409 refused in this state, 500 failed
    weight_version: str = ""  # the replica's weight version after the call
