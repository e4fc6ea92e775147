"""HTTP errors: every error the server answers has OpenAI's body,
``{"error": {"message", "type", "param", "code"}}``, with a message that names the
field and the limit. Engine errors keep their own status (400, 409, 503)."""

from __future__ import annotations

import msgspec
from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException
from starlette.responses import Response

from tokenspeed_aio.errors import EngineError
from tokenspeed_aio.protocol.openai import ErrorDetail, ErrorResponse

# OpenAI's error types by status; anything else is a server_error.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
}


class ApiError(Exception):
    """An error the HTTP layer answers itself (body, auth, size, unknown model)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers  # e.g. Retry-After


def error_payload(
    status: int, message: str, *, param: str | None = None, code: str | None = None
) -> ErrorResponse:
    kind = ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    code = None if code == kind else code  # the engine's 400 code repeats the type
    return ErrorResponse(ErrorDetail(message=message, type=kind, param=param, code=code))


def error_response(
    status: int,
    message: str,
    *,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> Response:
    body = msgspec.json.encode(error_payload(status, message, param=param, code=code))
    return Response(body, status_code=status, media_type="application/json", headers=headers)


def payload_for(exc: BaseException) -> tuple[int, ErrorResponse]:
    """The status and body for an error raised while serving a request (also used for
    the error event of a stream that fails after its headers went out)."""
    if isinstance(exc, ApiError):
        return exc.status, error_payload(exc.status, exc.message, param=exc.param, code=exc.code)
    if isinstance(exc, EngineError):
        return exc.status, error_payload(exc.status, exc.message, param=exc.param, code=exc.code)
    raise TypeError(f"not an API error: {exc!r}")


def install_error_handlers(app: FastAPI) -> None:
    """Answer ApiError, EngineError and Starlette's own HTTP errors (unknown route,
    wrong method) with OpenAI bodies. Unexpected exceptions are the guard
    middleware's (500 with a request id)."""

    async def api_error(request: Request, exc: Exception) -> Response:
        status, payload = payload_for(exc)
        return Response(
            msgspec.json.encode(payload),
            status_code=status,
            media_type="application/json",
            headers=getattr(exc, "headers", None),
        )

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404:
            message = f"{request.method} {request.url.path}: no such route"
        return error_response(exc.status_code, message, headers=exc.headers)

    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(EngineError, api_error)
    app.add_exception_handler(HTTPException, http_error)
