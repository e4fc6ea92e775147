"""GET /health, GET /v1/models, GET /metrics."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from starlette.responses import Response

from tokenspeed_aio.protocol.openai import ModelCard, ModelList
from tokenspeed_aio.server.body import json_response
from tokenspeed_aio.server.context import ServerContext
from tokenspeed_aio.server.errors import error_response


def info_router(ctx: ServerContext) -> APIRouter:
    router = APIRouter()
    created = int(time.time())

    @router.get("/health")
    async def health() -> Response:
        """200 while the engine serves; 503 naming the reason otherwise."""
        ok, reason = ctx.healthy()
        if ok:
            return json_response({"status": "ok"})
        return error_response(503, f"unhealthy: {reason}", code="unhealthy")

    @router.get("/v1/models")
    async def models() -> Response:
        name = ctx.served_model_name
        card = ModelCard(name, created, ctx.frontend.max_model_len, root=name)
        return json_response(ModelList([card]))

    @router.get("/metrics")
    async def metrics(request: Request) -> Response:
        body, headers = ctx.metrics.render(request.headers.getlist("accept"))
        return Response(body, headers=headers)

    return router
