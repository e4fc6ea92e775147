"""GET /health, /v1/models, /metrics, /version, /server_info and /model_info (with SGLang's
older names /get_server_info and /get_model_info)."""

from __future__ import annotations

import time
from importlib import metadata

from fastapi import APIRouter, Request
from starlette.responses import Response

from tokenspeed_aio.protocol.openai import ModelCard, ModelList
from tokenspeed_aio.protocol.tokenize import ModelInfo, VersionResponse
from tokenspeed_aio.server.body import json_response
from tokenspeed_aio.server.context import ServerContext
from tokenspeed_aio.server.errors import error_response


def package_version() -> str:
    try:
        return metadata.version("tokenspeed_aio")
    except metadata.PackageNotFoundError:  # run from a source tree
        return "0.1.0"


def info_router(ctx: ServerContext) -> APIRouter:
    router = APIRouter()
    created = int(time.time())
    version = package_version()

    @router.get("/health")
    async def health() -> Response:
        """200 while the engine serves; 503 naming the reason otherwise."""
        ok, reason = ctx.healthy()
        if ok:
            return json_response({"status": "ok"})
        return error_response(503, f"unhealthy: {reason}", code="unhealthy")

    @router.get("/v1/models")
    async def models() -> Response:
        """One card per served name (vLLM's shape): its context length and, as ``root``,
        the checkpoint it serves."""
        root = ctx.model_path or ctx.served_model_name
        cards = [
            ModelCard(name, created, ctx.frontend.max_model_len, root=root)
            for name in ctx.served_model_names
        ]
        return json_response(ModelList(cards))

    @router.get("/metrics")
    async def metrics(request: Request) -> Response:
        body, headers = ctx.metrics.render(request.headers.getlist("accept"))
        return Response(body, headers=headers)

    @router.get("/version")
    async def get_version() -> Response:
        return json_response(VersionResponse(version))

    async def server_info() -> Response:
        """The engine's settings (EngineArgs), the server's, and the replicas' loads."""
        loads = {str(r): load for r, (load, _) in ctx.frontend.loads.items()}
        options = {k: v for k, v in vars(ctx.options).items() if "api_key" not in k}
        return json_response(
            {
                "version": version,
                "engine_args": ctx.engine_args,
                "server_args": options,
                "max_model_len": ctx.frontend.max_model_len,
                "num_replicas": ctx.frontend.num_replicas,
                "loads": loads,
            }
        )

    async def model_info() -> Response:
        tokenizer = ctx.engine_args.get("tokenizer") or ctx.model_path
        return json_response(
            ModelInfo(
                model_path=ctx.model_path,
                tokenizer_path=str(tokenizer),
                served_model_name=ctx.served_model_name,
                served_model_names=list(ctx.served_model_names),
                max_model_len=ctx.frontend.max_model_len,
                vocab_size=ctx.frontend.vocab_size,
            )
        )

    for path in ("/server_info", "/get_server_info"):
        router.add_api_route(path, server_info, methods=["GET"])
    for path in ("/model_info", "/get_model_info"):
        router.add_api_route(path, model_info, methods=["GET"])
    return router
