"""Weight updates on the forward thread (the only code touching the model), in the halves
the control plane's gate agrees on between them:

    stage   check the update on this rank and keep what the load needs -- the checkpoint's
            files, this rank's decoded payload, a distributed update's tensors received by
            broadcast from the trainer's rank 0 -- loading nothing: every name must be a
            parameter of the model and every shape right (checked by the same loaders on
            the model's meta-device twin). A trainer lost mid-broadcast fails the stage, so
            the gate refuses the update everywhere and the old weights serve on (the
            received tensors are held until the load: one copy of the updated tensors)
    load    copy the staged tensors into the parameters
    commit  the replica's outcome: usable, or -- some rank failed, this one may hold part
            of the new weights -- invalid; nothing runs on invalid weights again

Each half runs with host syncs allowed, including where staged tensors are dropped: the
storage of a tensor received by CUDA IPC synchronizes its stream in its deleter, and
torch's sync-debug check raising there (inside a C++ destructor) would abort the process.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from tokenspeed_aio.data_plane.tensor_payload import deserialize_named_tensors
from tokenspeed_aio.data_plane.weight_group import WeightGroup, init_weights_update_group
from tokenspeed_aio.guards.host_sync import allow_host_sync
from tokenspeed_aio.model.config import ModelConfig
from tokenspeed_aio.model.loader import (
    iter_safetensors,
    meta_model,
    safetensors_files,
    safetensors_shapes,
)
from tokenspeed_aio.wire.control import (
    BROADCAST_FAILED,
    InitWeightsGroup,
    UpdateWeightsFromDisk,
    UpdateWeightsFromDistributed,
    UpdateWeightsFromTensor,
)

logger = logging.getLogger(__name__)

Staged = Callable[[], Iterable[tuple[str, torch.Tensor]]]


class WeightUpdater:
    def __init__(
        self,
        model: torch.nn.Module,
        config: ModelConfig,
        device: torch.device,
        *,
        engine_rank: int,
        tp_rank: int,
    ) -> None:
        self.model = model
        self.config = config
        self.device = device
        self.engine_rank = engine_rank  # its rank in a trainer group is rank_offset + this
        self.tp_rank = tp_rank  # picks this rank's payload of a tensor update
        self.groups: dict[str, WeightGroup] = {}
        self.invalid = False
        self._staged: Staged | None = None
        self._meta: torch.nn.Module | None = None

    # -- the trainer group ---------------------------------------------------------------
    def init_group(self, op: InitWeightsGroup) -> None:
        if op.group_name in self.groups:
            raise ValueError(f"group_name: {op.group_name!r} is already initialized")
        backend = op.backend or ("nccl" if self.device.type == "cuda" else "gloo")
        rank = op.rank_offset + self.engine_rank
        logger.info(
            "joining weight update group %r as rank %d of %d at %s:%d (%s)",
            op.group_name, rank, op.world_size, op.master_address, op.master_port, backend,
        )  # fmt: skip
        with allow_host_sync():  # a low-rate op off the per-round path: it may wait
            self.groups[op.group_name] = init_weights_update_group(
                op.master_address,
                op.master_port,
                rank,
                op.world_size,
                op.group_name,
                backend,
                op.timeout_seconds,
            )

    def destroy_group(self, group_name: str) -> None:
        if self.groups.pop(group_name, None) is None:
            raise ValueError(f"group_name: no weight update group {group_name!r}")

    # -- stage, load, commit ---------------------------------------------------------------
    def stage(self, update: object) -> str | None:
        """None when this rank can load ``update``; else why not (nothing was loaded)."""
        with allow_host_sync():
            self._staged = None
            if self.invalid:
                return "the weights are invalid after a failed update"
            return self._stage(update)

    def _stage(self, update: object) -> str | None:
        try:
            if isinstance(update, UpdateWeightsFromDisk):
                self._staged = self._stage_disk(update)
            elif isinstance(update, UpdateWeightsFromTensor):
                self._staged = self._stage_tensors(update)
            elif isinstance(update, UpdateWeightsFromDistributed):
                self._staged = self._stage_distributed(update)
            else:
                return f"not a weight update: {type(update).__name__}"
        except (ValueError, OSError) as err:
            return str(err)
        return None

    def load(self) -> str | None:
        """Load what was staged; None, or the error (the parameters may be partly written)."""
        with allow_host_sync():
            staged, self._staged = self._staged, None
            if staged is None:
                return "no weight update is staged"
            try:
                with torch.no_grad():
                    self.model.load_weights(staged())
                    if self.device.type == "cuda":
                        torch.cuda.synchronize(self.device)  # a copy's failure surfaces here
            except Exception as err:
                logger.exception("weight load failed")
                return f"{type(err).__name__}: {err}"
            finally:
                del staged  # the source tensors go while syncs are allowed (see the module)
            return None

    def commit(self, ok: bool | None) -> None:
        """True: the load is the replica's; False: a rank failed, invalid everywhere; None:
        refused before loading, drop what was staged."""
        with allow_host_sync():
            self._staged = None
        if ok is False:
            self.invalid = True

    # -- the sources -------------------------------------------------------------------------
    def _stage_disk(self, update: UpdateWeightsFromDisk) -> Staged:
        path = Path(update.model_path)
        if not path.is_dir():
            raise ValueError(f"model_path: {path} is not a directory")
        files = safetensors_files(path)
        self._check((name, shape) for name, shape in safetensors_shapes(files))
        return lambda: iter_safetensors(files, progress=False)

    def _stage_tensors(self, update: UpdateWeightsFromTensor) -> Staged:
        payloads = update.payloads
        if 1 < len(payloads) <= self.tp_rank:
            raise ValueError(f"serialized_named_tensors: no payload for TP rank {self.tp_rank}")
        payload = payloads[self.tp_rank] if len(payloads) > 1 else payloads[0]
        named = deserialize_named_tensors(payload, update.load_format)
        self._check((name, tuple(t.shape)) for name, t in named)
        return lambda: iter(named)

    def _stage_distributed(self, update: UpdateWeightsFromDistributed) -> Staged:
        group = self.groups.get(update.group_name)
        if group is None:
            raise ValueError(f"group_name: no weight update group {update.group_name!r}")
        specs = [
            (name, getattr(torch, dtype.removeprefix("torch.")), tuple(shape))
            for name, dtype, shape in zip(update.names, update.dtypes, update.shapes)
        ]
        self._check((name, shape) for name, _, shape in specs)
        where = self.device if group.backend == "nccl" else torch.device("cpu")
        received = []
        # the broadcast waits for the trainer (stage allows host syncs)
        for i, (name, dtype, shape) in enumerate(specs):
            tensor = torch.empty(shape, dtype=dtype, device=where)
            try:
                group.broadcast(tensor)
            except RuntimeError as err:  # the trainer died, or hung past the timeout
                logger.warning("weight broadcast failed at %s: %s", name, err)
                raise ValueError(
                    f"{BROADCAST_FAILED} at tensor {i + 1} of {len(specs)} ({name}) of "
                    f"group {update.group_name!r} (each broadcast waits at most "
                    f"{group.timeout_seconds:g} s): {err}; nothing was loaded, the "
                    "weights in use are unchanged; destroy the group and init a new one"
                ) from err
            received.append((name, tensor))
        return lambda: iter(received)

    def _check(self, shapes: Iterable[tuple[str, tuple[int, ...]]]) -> None:
        """Every name a parameter, every shape right: the real loaders on the meta twin."""
        if self._meta is None:
            dtype = next(self.model.parameters()).dtype
            self._meta = meta_model(self.config, dtype)
        meta = self._meta
        empty = [(name, torch.empty(shape, device="meta")) for name, shape in shapes]
        if not empty:
            raise ValueError("the update holds no tensor")
        meta.load_weights(empty)
