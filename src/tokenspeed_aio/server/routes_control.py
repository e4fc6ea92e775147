"""SGLang's control routes, which RL frameworks (slime, verl, OpenRLHF) drive between
rollouts, and the operator's: pause and continue, memory release and resume, weight
updates (disk, tensors, a trainer's broadcast), the cache flush, the health generation,
the replicas' loads, profiling.

Each answers SGLang's ``{"success": bool, "message": str}`` once every replica answered:
200 on success; on a refusal or failure the replica's status (400 bad argument, 409 refused
in this state, 500 failed, 503 unavailable) with the OpenAI-style ``error`` beside it.
"""

from __future__ import annotations

import base64
import binascii
import os
import tempfile

from fastapi import APIRouter, Request
from starlette.responses import Response

from tokenspeed_aio.api.control import EngineControlError, FrontendControl
from tokenspeed_aio.api.control_calls import ControlResult
from tokenspeed_aio.errors import EngineError
from tokenspeed_aio.protocol.sglang_control import (
    ControlResponse,
    DestroyWeightsUpdateGroupRequest,
    InitWeightsUpdateGroupRequest,
    MemoryRequest,
    PauseGenerationRequest,
    StartProfileRequest,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromDistributedRequest,
    UpdateWeightsFromTensorRequest,
)
from tokenspeed_aio.server.body import json_response, parse_body
from tokenspeed_aio.server.context import ServerContext
from tokenspeed_aio.server.errors import ApiError, error_payload, error_response


def _answer(result: ControlResult, *, version: bool = False) -> Response:
    body = ControlResponse(True, result.message, result.weight_version if version else None)
    return json_response(body)


def _refused(err: EngineControlError) -> Response:
    error = error_payload(err.status, err.message, code="control_refused")
    body = ControlResponse(False, err.message, err.result.weight_version, error=error.error)
    return json_response(body, status=err.status)


async def _body(request: Request, kind):
    """An optional JSON body (the routes without required fields accept none)."""
    if not (await request.body()).strip():
        return kind()
    return await parse_body(request, kind)


def control_router(ctx: ServerContext) -> APIRouter:
    router = APIRouter()
    control = FrontendControl(ctx.frontend)

    async def run(call, *, version: bool = False) -> Response:
        try:
            return _answer(await call, version=version)
        except EngineControlError as err:
            return _refused(err)

    def abort_all() -> None:
        for rid in list(ctx.frontend.streams):
            ctx.frontend.abort(rid)

    @router.post("/pause_generation")
    async def pause_generation(request: Request) -> Response:
        req = await _body(request, PauseGenerationRequest)
        return await run(control.pause_generation(req.mode))

    @router.post("/continue_generation")
    async def continue_generation(request: Request) -> Response:
        return await run(control.continue_generation())

    @router.post("/release_memory_occupation")
    async def release_memory_occupation(request: Request) -> Response:
        req = await _body(request, MemoryRequest)
        return await run(control.release_memory_occupation(req.tags))

    @router.post("/resume_memory_occupation")
    async def resume_memory_occupation(request: Request) -> Response:
        req = await _body(request, MemoryRequest)
        return await run(control.resume_memory_occupation(req.tags))

    @router.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        return await run(control.flush_cache())

    @router.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request) -> Response:
        req = await parse_body(request, UpdateWeightsFromDiskRequest)
        if req.abort_all_requests:
            abort_all()
        call = control.update_weights_from_disk(
            req.model_path,
            req.load_format,
            flush_cache=req.flush_cache,
            weight_version=req.weight_version,
        )
        return await run(call, version=True)

    @router.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(request: Request) -> Response:
        req = await parse_body(request, UpdateWeightsFromTensorRequest)
        try:
            payloads = [base64.b64decode(p, validate=True) for p in req.serialized_named_tensors]
        except (binascii.Error, ValueError):
            raise ApiError(
                400,
                "serialized_named_tensors: each entry must be base64",
                param="serialized_named_tensors",
            ) from None
        if req.abort_all_requests:
            abort_all()
        call = control.update_weights_from_tensor(
            payloads,
            req.load_format,
            flush_cache=req.flush_cache,
            weight_version=req.weight_version,
        )
        return await run(call, version=True)

    @router.post("/init_weights_update_group")
    async def init_weights_update_group(request: Request) -> Response:
        req = await parse_body(request, InitWeightsUpdateGroupRequest)
        call = control.init_weights_update_group(
            req.master_address,
            req.master_port,
            req.rank_offset,
            req.world_size,
            req.group_name,
            req.backend,
            req.timeout_seconds,
        )
        return await run(call)

    @router.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(request: Request) -> Response:
        req = await parse_body(request, UpdateWeightsFromDistributedRequest)
        if req.abort_all_requests:
            abort_all()
        call = control.update_weights_from_distributed(
            req.names,
            req.dtypes,
            req.shapes,
            req.group_name,
            flush_cache=req.flush_cache,
            weight_version=req.weight_version,
        )
        return await run(call, version=True)

    @router.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(request: Request) -> Response:
        req = await _body(request, DestroyWeightsUpdateGroupRequest)
        return await run(control.destroy_weights_update_group(req.group_name))

    @router.get("/get_weight_version")
    async def get_weight_version() -> Response:
        return json_response({"weight_version": control.weight_version})

    @router.api_route("/health_generate", methods=["GET", "POST"])
    async def health_generate() -> Response:
        try:
            latency = await control.health_generate()
        except EngineError as err:
            return error_response(err.status, f"unhealthy: {err.message}", code="unhealthy")
        return json_response({"status": "ok", "latency_seconds": round(latency, 4)})

    @router.get("/v1/loads")
    async def loads() -> Response:
        return json_response({"loads": control.loads()})

    @router.post("/start_profile")
    async def start_profile(request: Request) -> Response:
        req = await _body(request, StartProfileRequest)
        output_dir = req.output_dir or os.environ.get(
            "TOKENSPEED_PROFILE_DIR", os.path.join(tempfile.gettempdir(), "tokenspeed-profiles")
        )
        call = control.start_profile(output_dir, req.num_steps, req.activities, req.record_shapes)
        return await run(call)

    @router.post("/stop_profile")
    async def stop_profile() -> Response:
        return await run(control.stop_profile())

    return router
