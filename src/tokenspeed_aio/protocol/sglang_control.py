"""SGLang's control routes' request and response bodies (the names its RL clients send:
slime, verl, OpenRLHF), shared by the server and clients like ``protocol.sglang``."""

from __future__ import annotations

import msgspec

DEFAULT_GROUP = "weight_update_group"


class PauseGenerationRequest(msgspec.Struct, kw_only=True, omit_defaults=True):
    mode: str = "abort"  # abort | wait | keep


class MemoryRequest(msgspec.Struct, kw_only=True, omit_defaults=True):
    tags: list[str] | None = None  # kv_cache, weights; none: every region


class UpdateWeightsFromDiskRequest(msgspec.Struct, kw_only=True, omit_defaults=True):
    model_path: str
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False  # abort what runs first (else a flush needs it drained)
    weight_version: str | None = None


class UpdateWeightsFromTensorRequest(msgspec.Struct, kw_only=True, omit_defaults=True):
    serialized_named_tensors: list[str]  # base64, one per TP rank (or one for all)
    load_format: str | None = None  # null (torch multiprocessing pickle) | safetensors
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None


class InitWeightsUpdateGroupRequest(msgspec.Struct, kw_only=True, omit_defaults=True):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = DEFAULT_GROUP
    backend: str | None = None  # nccl | gloo
    timeout_seconds: float = 60.0  # one collective's bound: a hung trainer fails the update


class UpdateWeightsFromDistributedRequest(msgspec.Struct, kw_only=True, omit_defaults=True):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = DEFAULT_GROUP
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None


class DestroyWeightsUpdateGroupRequest(msgspec.Struct, kw_only=True, omit_defaults=True):
    group_name: str = DEFAULT_GROUP


class StartProfileRequest(msgspec.Struct, kw_only=True, omit_defaults=True):
    output_dir: str | None = None  # default: $TOKENSPEED_PROFILE_DIR or ./profiles
    num_steps: int | None = None
    activities: list[str] | None = None  # CPU, GPU
    record_shapes: bool = False


class ControlResponse(msgspec.Struct, omit_defaults=True):
    """SGLang's answer shape; a failure also carries the OpenAI-style ``error``."""

    success: bool
    message: str
    weight_version: str | None = None
    error: dict | None = None
