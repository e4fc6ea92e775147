"""The OpenAPI document (GET /openapi.json): FastAPI's, plus the request bodies it
cannot see -- the routes decode their bodies with msgspec, so FastAPI knows no body
type -- written from the protocol Structs by msgspec, so clients, docs and fuzzers
see the schema the server actually validates against."""

from __future__ import annotations

from typing import Any

import msgspec
from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from tokenspeed_aio.protocol import openai, sglang

# POST route -> the Struct its body is decoded as.
REQUEST_BODIES: dict[str, type] = {
    "/v1/completions": openai.CompletionRequest,
    "/v1/chat/completions": openai.ChatCompletionRequest,
    "/generate": sglang.GenerateRequest,
    "/abort_request": sglang.AbortRequest,
}


def install_openapi(app: FastAPI) -> None:
    """Make ``app.openapi()`` include the request-body schemas (built once, cached)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(
                title=app.title, version=app.version, summary=app.summary, routes=app.routes
            )
            refs, components = msgspec.json.schema_components(
                list(REQUEST_BODIES.values()), ref_template="#/components/schemas/{name}"
            )
            schema.setdefault("components", {}).setdefault("schemas", {}).update(components)
            for (path, _), ref in zip(REQUEST_BODIES.items(), refs):
                operation = schema["paths"][path]["post"]
                operation["requestBody"] = {
                    "required": True,
                    "content": {"application/json": {"schema": ref}},
                }
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
