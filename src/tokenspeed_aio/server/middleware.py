"""The guard every HTTP request passes: request id, Host and Origin, API keys, the
drain, Content-Type, body size and read timeout, the access log, and the last word on
errors (an unexpected exception becomes a 500 naming the request id; its traceback goes
to the log only).

Access: with an API key every route needs it but /health and /metrics (health checks and
scrapers carry no key); a metrics key, when set, guards /metrics with that key; an admin
key, when set, guards the admin routes (ADMIN_PATHS, and abort-all on /abort_request,
which the route checks by ``scope["state"]["admin"]``) instead of the API key.

Browsers: a server on a loopback address answers only Host names that are loopback
(a DNS-rebinding page carries its own name); a state-changing request (POST, PUT, PATCH,
DELETE) from an Origin other than the server's own is refused unless allowed; and a
request body must be ``application/json``, which a cross-site page can send only after
a CORS preflight that names no foreign origin.

A pure ASGI middleware rather than Starlette's BaseHTTPMiddleware, which would
buffer streaming responses and hide client disconnects from the endpoint.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import re
import time
import uuid
from collections.abc import Callable
from typing import Any

from starlette.responses import Response

from tokenspeed_aio.server.body import BodyTimeout, ClientGone, receive_body
from tokenspeed_aio.server.errors import error_response
from tokenspeed_aio.server.streaming import ClientDisconnected

logger = logging.getLogger(__name__)
access_logger = logging.getLogger("tokenspeed_aio.access")

Scope = dict[str, Any]
Message = dict[str, Any]
ASGIApp = Callable[..., Any]

BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
STATE_CHANGING = BODY_METHODS | {"DELETE"}
ADMIN_PATHS = frozenset(
    {
        "/pause_generation", "/continue_generation", "/release_memory_occupation",
        "/resume_memory_occupation", "/flush_cache", "/update_weights_from_disk",
        "/update_weights_from_tensor", "/init_weights_update_group",
        "/update_weights_from_distributed", "/destroy_weights_update_group",
        "/start_profile", "/stop_profile",
    }
)  # fmt: skip
OPEN_PATHS = frozenset({"/metrics"})  # answered during a drain too (/health: 503 then)
LOOPBACK_NAMES = frozenset({"localhost", "localhost.", "127.0.0.1", "::1"})
DRAIN_RETRY_AFTER = "5"  # seconds a client is told to wait while the server stops
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
        admin_api_key: str | None = None,
        allowed_origins: tuple[str, ...] = (),
        allowed_hosts: tuple[str, ...] = (),
        draining: Callable[[], bool] = lambda: False,
        body_timeout: float = 30.0,
        access_log: bool = False,
    ) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.metrics_api_key = metrics_api_key.encode() if metrics_api_key else None
        self.admin_api_key = admin_api_key.encode() if admin_api_key else None
        self.allowed_origins = frozenset(o.rstrip("/").lower() for o in allowed_origins)
        self.allowed_hosts = frozenset(h.lower() for h in allowed_hosts)
        self.draining = draining  # True while the server stops: new requests get 503
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
            refusal = self._refusal(scope, headers)
            if refusal is not None:
                await refusal(scope, receive, guarded_send)
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

    def _refusal(self, scope: Scope, headers: dict[bytes, bytes]) -> Response | None:
        """The answer to a request refused before its body is read, or None."""
        method, path = scope["method"], scope["path"]
        host = headers.get(b"host", b"").decode("latin-1")
        if not self._host_allowed(scope, host):
            return error_response(
                421,
                f"Host header {host!r}: this server answers only its own address's names "
                "(--allowed-hosts)",
                param="Host",
                code="host_not_allowed",
            )
        origin = headers.get(b"origin", b"").decode("latin-1").rstrip("/").lower()
        if origin and method in STATE_CHANGING and not self._origin_allowed(origin, host):
            return error_response(
                403,
                f"Origin {origin!r}: requests from other sites are refused (--allowed-origins)",
                param="Origin",
                code="origin_not_allowed",
            )
        if not self._authorized(path, headers, scope):
            return error_response(
                401,
                "invalid or missing API key: send 'Authorization: Bearer <key>'",
                code="invalid_api_key",
                headers={"www-authenticate": "Bearer"},
            )
        if self.draining() and path not in OPEN_PATHS:
            return error_response(
                503,
                "the server is shutting down; retry on another replica or later",
                code="shutting_down",
                headers={"retry-after": DRAIN_RETRY_AFTER, "connection": "close"},
            )
        if method in BODY_METHODS and not _json_content(headers):
            kind = headers.get(b"content-type", b"").decode("latin-1")
            return error_response(
                415,
                f"Content-Type {kind!r}: request bodies must be 'application/json'",
                param="Content-Type",
                code="unsupported_media_type",
            )
        return None

    def _host_allowed(self, scope: Scope, host: str) -> bool:
        if "*" in self.allowed_hosts:
            return True
        name = _host_name(host)
        if not name or name in self.allowed_hosts:  # no Host: an HTTP/1.0 client
            return True
        server = scope.get("server")
        if not server or not _is_loopback(server[0]):
            return True  # bound elsewhere: names are the operator's business
        return name in LOOPBACK_NAMES or _is_loopback(name)

    def _origin_allowed(self, origin: str, host: str) -> bool:
        if "*" in self.allowed_origins or origin in self.allowed_origins:
            return True
        _, _, authority = origin.partition("://")
        return bool(host) and authority == host.lower()  # the server's own pages

    def _authorized(self, path: str, headers: dict[bytes, bytes], scope: Scope) -> bool:
        if self.admin_api_key is not None:
            admin = _bearer(headers, self.admin_api_key)
            scope["state"]["admin"] = admin
            if path in ADMIN_PATHS:
                return admin
        else:
            scope["state"]["admin"] = True
        key = self.metrics_api_key if path == "/metrics" else self.api_key
        if key is None or path == "/health" or (path == "/metrics" and not self.metrics_api_key):
            return True
        return _bearer(headers, key)

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


def _bearer(headers: dict[bytes, bytes], key: bytes) -> bool:
    scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
    return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), key)


def _json_content(headers: dict[bytes, bytes]) -> bool:
    """A JSON Content-Type, or none (a client that names no type; a browser sending a
    body without one is cross-origin only with an Origin header, refused before this)."""
    kind = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
    return (
        not kind
        or kind == b"application/json"
        or (kind.startswith(b"application/") and kind.endswith(b"+json"))
    )


def _host_name(host: str) -> str:
    """The name of a Host header, without its port ("[::1]:8000" -> "::1")."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    return host.rpartition(":")[0] if host.count(":") == 1 else host


def _is_loopback(name: str) -> bool:
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def _client(scope: Scope) -> str:
    client = scope.get("client")
    return f"{client[0]}:{client[1]}" if client else "-"
