"""The guard every HTTP request passes: request id, API key, body size and read timeout,
the access log, and the last word on errors (an unexpected exception becomes a 500
naming the request id; its traceback goes to the log only).

Access: with an API key every route needs it but /health and /metrics (health checks and
scrapers carry no key); a metrics key, when set, guards /metrics with that key.

A pure ASGI middleware rather than Starlette's BaseHTTPMiddleware, which would
buffer streaming responses and hide client disconnects from the endpoint.
"""

from __future__ import annotations

import hmac
import logging
import re
import time
import uuid
from collections.abc import Callable
from typing import Any

from tokenspeed_aio.server.body import BodyTimeout, ClientGone, receive_body
from tokenspeed_aio.server.errors import error_response
from tokenspeed_aio.server.streaming import ClientDisconnected

logger = logging.getLogger(__name__)
access_logger = logging.getLogger("tokenspeed_aio.access")

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
        metrics_api_key: str | None = None,
        body_timeout: float = 30.0,
        access_log: bool = False,
    ) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.metrics_api_key = metrics_api_key.encode() if metrics_api_key else None
        self.max_body_bytes = max_body_bytes
        self.body_timeout = body_timeout
        self.access_log = access_log
        self.on_client_error = on_client_error  # counts 4xx answers by status

    async def __call__(self, scope: Scope, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        given = headers.get(b"x-request-id", b"").decode("latin-1")
        request_id = given if _REQUEST_ID.match(given) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        started = False
        status = 0
        begin = time.monotonic()

        async def guarded_send(message: Message) -> None:
            nonlocal started, status
            if message["type"] == "http.response.start":
                started, status = True, message["status"]
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
        finally:
            if self.access_log:
                access_logger.info(
                    '%s "%s %s" %d %.1f ms %s',
                    _client(scope), scope["method"], scope["path"], status,
                    (time.monotonic() - begin) * 1e3, request_id,
                )  # fmt: skip

    def _authorized(self, scope: Scope, headers: dict[bytes, bytes]) -> bool:
        path = scope["path"]
        key = self.metrics_api_key if path == "/metrics" else self.api_key
        if key is None or path == "/health" or (path == "/metrics" and not self.metrics_api_key):
            return True
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), key)

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
        try:
            body = await receive_body(receive, self.max_body_bytes, self.body_timeout)
        except ClientGone:
            return None
        except BodyTimeout:
            message = f"the request body did not arrive within {self.body_timeout:g} s"
            await error_response(408, message, code="request_timeout")(scope, receive, send)
            return None
        except OverflowError as err:
            await self._too_large(scope, receive, send, int(str(err)))
            return None
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


def _client(scope: Scope) -> str:
    client = scope.get("client")
    return f"{client[0]}:{client[1]}" if client else "-"
