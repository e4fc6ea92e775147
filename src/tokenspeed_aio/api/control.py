"""AsyncEngine's control operations: what an RL framework (slime, verl, OpenRLHF) or an
operator asks of a running engine between rollouts. Each awaits every replica's answer and
returns the combined ControlResult; a refusal or failure raises EngineControlError (its
``status`` 400, 409, 500 or 503, its message naming the reason and the replica).

    await engine.pause_generation("wait")          # or "abort", "keep"
    await engine.release_memory_occupation(["weights", "kv_cache"])
    ...                                             # the trainer steps
    await engine.resume_memory_occupation(["weights"])
    await engine.update_weights_from_distributed(names, dtypes, shapes, weight_version="v2")
    await engine.resume_memory_occupation(["kv_cache"])
    await engine.continue_generation()
"""

from __future__ import annotations

import asyncio
import time
import uuid

from tokenspeed_aio.api.control_calls import ControlResult
from tokenspeed_aio.api.frontend import Frontend
from tokenspeed_aio.errors import EngineError
from tokenspeed_aio.sampling_params import SamplingParams
from tokenspeed_aio.wire.control import (
    DEFAULT_GROUP_TIMEOUT,
    DEFAULT_WEIGHT_GROUP,
    ContinueGeneration,
    ControlOp,
    DestroyWeightsGroup,
    FlushCache,
    InitWeightsGroup,
    PauseGeneration,
    ReleaseMemory,
    ResumeMemory,
    StartProfile,
    StopProfile,
    UpdateWeightsFromDisk,
    UpdateWeightsFromDistributed,
    UpdateWeightsFromTensor,
)


class EngineControlError(EngineError):
    """A control operation was refused or failed on some replica."""

    code = "control_error"

    def __init__(self, result: ControlResult) -> None:
        super().__init__(result.message)
        self.status = result.status
        self.result = result


class EngineControl:
    frontend: Frontend

    async def _control(self, op: ControlOp) -> ControlResult:
        result = await self.frontend.control(op)
        if not result.ok:
            raise EngineControlError(result)
        if isinstance(op, PauseGeneration | ContinueGeneration):
            self.frontend.calls.paused = op.mode if isinstance(op, PauseGeneration) else None
        elif isinstance(op, ReleaseMemory):
            self.frontend.calls.released.update(op.tags or ("kv_cache", "weights"))
        elif isinstance(op, ResumeMemory):
            self.frontend.calls.released.difference_update(op.tags or ("kv_cache", "weights"))
        return result

    # -- pause ---------------------------------------------------------------------------
    async def pause_generation(self, mode: str = "abort") -> ControlResult:
        return await self._control(PauseGeneration(mode=mode))

    async def continue_generation(self) -> ControlResult:
        return await self._control(ContinueGeneration())

    # -- memory ------------------------------------------------------------------------------
    async def release_memory_occupation(self, tags: list[str] | None = None) -> ControlResult:
        return await self._control(ReleaseMemory(tags=list(tags or [])))

    async def resume_memory_occupation(self, tags: list[str] | None = None) -> ControlResult:
        return await self._control(ResumeMemory(tags=list(tags or [])))

    async def flush_cache(self) -> ControlResult:
        return await self._control(FlushCache())

    # -- weights -------------------------------------------------------------------------------
    @property
    def weight_version(self) -> str:
        return self.frontend.calls.weight_version

    async def update_weights_from_disk(
        self,
        model_path: str,
        load_format: str | None = None,
        *,
        flush_cache: bool = True,
        weight_version: str | None = None,
    ) -> ControlResult:
        op = UpdateWeightsFromDisk(
            model_path=str(model_path),
            load_format=load_format,
            flush_cache=flush_cache,
            weight_version=weight_version,
        )
        return await self._control(op)

    async def update_weights_from_tensor(
        self,
        serialized_named_tensors: list[bytes],
        load_format: str | None = None,
        *,
        flush_cache: bool = True,
        weight_version: str | None = None,
    ) -> ControlResult:
        """``serialized_named_tensors``: one payload per TP rank, or one for every rank
        (``data_plane.tensor_payload.serialize_named_tensors`` makes them)."""
        op = UpdateWeightsFromTensor(
            payloads=list(serialized_named_tensors),
            load_format=load_format,
            flush_cache=flush_cache,
            weight_version=weight_version,
        )
        return await self._control(op)

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = DEFAULT_WEIGHT_GROUP,
        backend: str | None = None,
        timeout_seconds: float = DEFAULT_GROUP_TIMEOUT,
    ) -> ControlResult:
        op = InitWeightsGroup(
            master_address=master_address,
            master_port=master_port,
            rank_offset=rank_offset,
            world_size=world_size,
            group_name=group_name,
            backend=backend,
            timeout_seconds=timeout_seconds,
        )
        return await self._control(op)

    async def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str = DEFAULT_WEIGHT_GROUP,
        *,
        flush_cache: bool = True,
        weight_version: str | None = None,
    ) -> ControlResult:
        op = UpdateWeightsFromDistributed(
            names=list(names),
            dtypes=[str(d).removeprefix("torch.") for d in dtypes],
            shapes=[list(s) for s in shapes],
            group_name=group_name,
            flush_cache=flush_cache,
            weight_version=weight_version,
        )
        return await self._control(op)

    async def destroy_weights_update_group(
        self, group_name: str = DEFAULT_WEIGHT_GROUP
    ) -> ControlResult:
        return await self._control(DestroyWeightsGroup(group_name=group_name))

    # -- operators ---------------------------------------------------------------------------
    async def start_profile(
        self,
        output_dir: str,
        num_steps: int | None = None,
        activities: list[str] | None = None,
        record_shapes: bool = False,
    ) -> ControlResult:
        op = StartProfile(
            output_dir=str(output_dir),
            num_steps=num_steps,
            activities=list(activities or ["CPU", "GPU"]),
            record_shapes=record_shapes,
        )
        return await self._control(op)

    async def stop_profile(self) -> ControlResult:
        return await self._control(StopProfile())

    async def health_generate(self, timeout: float = 20.0) -> float:
        """Run a one-token generation; its latency in seconds, or EngineError (503) when
        it did not finish within ``timeout``."""
        calls = self.frontend.calls
        if calls.paused or calls.released:
            why = (
                f"paused ({calls.paused})" if calls.paused else f"released {sorted(calls.released)}"
            )
            err = EngineError(f"generation is {why}")
            err.status = 503
            raise err
        start = time.monotonic()
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        stream = self.frontend.generate(
            prompt_token_ids=[0], sampling_params=params, rid=f"health-{uuid.uuid4().hex}"
        )

        async def run() -> None:
            async for out in stream:
                if out.finished and out.finish_reason not in ("length", "stop"):
                    raise EngineError(f"the health generation ended with {out.finish_reason}")

        try:
            await asyncio.wait_for(run(), timeout)
        except TimeoutError:
            err = EngineError(f"the health generation did not finish within {timeout:g} s")
            err.status = 503
            raise err from None
        return time.monotonic() - start

    def loads(self) -> list[dict]:
        """Each replica's last load report and its age (seconds)."""
        now = time.monotonic()
        out = []
        for replica in range(self.frontend.num_replicas):
            report = self.frontend.loads.get(replica)
            if report is None:
                out.append({"dp_rank": replica, "reported": False})
                continue
            load, at = report
            out.append(
                {
                    "dp_rank": replica,
                    "reported": True,
                    "age_seconds": round(now - at, 3),
                    "running": load.running,
                    "waiting": load.waiting,
                    "resident_blocks": load.resident_blocks,
                    "active_blocks": load.active_blocks,
                    "total_blocks": load.total_blocks,
                }
            )
        return out


class FrontendControl(EngineControl):
    """The control operations over a frontend (the HTTP server's routes use one)."""

    def __init__(self, frontend: Frontend) -> None:
        self.frontend = frontend
