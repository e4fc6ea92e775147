"""The guard every HTTP request passes: request id, API key, body size, and the last
word on errors (an unexpected exception becomes a 500 naming the request id; its
traceback goes to the log only).

A pure ASGI middleware rather than Starlette's BaseHTTPMiddleware, which would
buffer streaming responses and hide client disconnects from the endpoint.
"""

from __future__ import annotations

import hmac
import logging
import re
import uuid
from collections.abc import Callable
from typing import Any

from tokenspeed_aio.server.errors import error_response
from tokenspeed_aio.server.streaming import ClientDisconnected

logger = logging.getLogger(__name__)

Scope = dict[str, Any]
Message = dict[str, Any]
ASGIApp = Callable[..., Any]

BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


class GuardMiddleware:
    def __init__(
        self,
        app: ASGIApp,
        *,
        api_key: str | None,
        max_body_bytes: int,
        on_client_error: Callable[[int], None],
        open_paths: frozenset[str] = frozenset({"/health"}),
    ) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes
        self.on_client_error = on_client_error  # counts 4xx answers by status
        self.open_paths = open_paths  # reachable without the API key

    async def __call__(self, scope: Scope, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        given = headers.get(b"x-request-id", b"").decode("latin-1")
        request_id = given if _REQUEST_ID.match(given) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        started = False

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message["headers"] = [
                    *message.get("headers", []),
                    (b"x-request-id", request_id.encode()),
                ]
                if 400 <= message["status"] < 500:
                    self.on_client_error(message["status"])
            await send(message)

        try:
            if not self._authorized(scope, headers):
                response = error_response(
                    401,
                    "invalid or missing API key: send 'Authorization: Bearer <key>'",
                    code="invalid_api_key",
                    headers={"www-authenticate": "Bearer"},
                )
                await response(scope, receive, guarded_send)
                return
            if scope["method"] in BODY_METHODS:
                receive = await self._read_body(scope, headers, receive, guarded_send)
                if receive is None:
                    return
            await self.app(scope, receive, guarded_send)
        except ClientDisconnected:
            logger.debug("request %s: the client disconnected", request_id)
        except Exception:
            logger.exception(
                "request %s (%s %s) failed", request_id, scope["method"], scope["path"]
            )
            if not started:  # once a stream has begun, all that is left is to cut it
                response = error_response(
                    500, f"internal server error (request id {request_id}); see the server log"
                )
                await response(scope, receive, guarded_send)

    def _authorized(self, scope: Scope, headers: dict[bytes, bytes]) -> bool:
        if self.api_key is None or scope["path"] in self.open_paths:
            return True
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.api_key)

    async def _read_body(
        self, scope: Scope, headers: dict[bytes, bytes], receive: Callable, send: Callable
    ) -> Callable | None:
        """Buffer the body up to the limit (checking Content-Length first, then the bytes
        that actually arrive) and return a receive that replays it; None when this
        already answered (413, 400) or the client left."""
        declared = headers.get(b"content-length")
        if declared is not None:
            if not declared.isdigit():
                await error_response(400, "invalid Content-Length header")(scope, receive, send)
                return None
            if int(declared) > self.max_body_bytes:
                await self._too_large(scope, receive, send, int(declared))
                return None
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                await self._too_large(scope, receive, send, size)
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()  # after the body: the client's disconnect
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        return replay

    async def _too_large(self, scope: Scope, receive: Callable, send: Callable, size: int) -> None:
        message = (
            f"the request body is too large: {size} bytes or more, the limit is "
            f"{self.max_body_bytes} bytes"
        )
        await error_response(413, message, code="request_too_large")(scope, receive, send)
