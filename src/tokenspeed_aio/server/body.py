"""JSON in and out. Request bodies are decoded and type-checked into a protocol
Struct in one pass, every failure a 400 that names the field (``max_tokens:
expected int, got str``); responses are msgspec-encoded Structs.

A body's Content-Type, when it names one, is application/json (the guard middleware
refuses others with 415, so a cross-site page must preflight); its size was bounded
there too.
"""

from __future__ import annotations

import asyncio
import re
from typing import TypeVar

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from tokenspeed_aio.server.errors import ApiError

T = TypeVar("T")

THREAD_DECODE_BYTES = 256 * 1024  # larger bodies are decoded off the event loop


class BodyTimeout(Exception):
    """The client did not send its whole body in time (slow or never-ending upload)."""


class ClientGone(Exception):
    """The client disconnected before its body was complete."""


async def receive_body(receive, max_bytes: int, timeout: float) -> bytes:
    """The whole request body from an ASGI ``receive``, within ``timeout`` seconds in all
    (not per chunk: a client trickling a byte a second is cut off too). Raises
    BodyTimeout, ClientGone, or OverflowError(size) past ``max_bytes``."""
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout):
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise ClientGone
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > max_bytes:
                    raise OverflowError(size)
                chunks.append(chunk)
                if not message.get("more_body", False):
                    return b"".join(chunks)
    except TimeoutError:
        raise BodyTimeout from None


# msgspec's messages end with " - at `$.path`" when the error is inside the document.
_AT = re.compile(r"^(?P<what>.*?)(?: - at `\$\.?(?P<path>[^`]*)`)?$", re.DOTALL)
_MISSING = re.compile(r"Object missing required field `(?P<field>[^`]+)`")
_UNKNOWN = re.compile(r"Object contains unknown field `(?P<field>[^`]+)`")


async def parse_body(request: Request, kind: type[T]) -> T:
    """Decode the request's JSON body as ``kind``; ApiError(400) on any failure."""
    body = await request.body()
    if not body.strip():
        raise ApiError(400, "the request body is empty; send a JSON object", code="empty_body")
    try:
        if len(body) > THREAD_DECODE_BYTES:
            return await asyncio.to_thread(msgspec.json.decode, body, type=kind)
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        raise validation_error(str(exc)) from None
    except msgspec.DecodeError as exc:
        raise decode_error(body, str(exc)) from None
    except RecursionError:
        raise ApiError(400, "the request body is nested too deeply", code="invalid_json") from None


def validation_error(message: str) -> ApiError:
    """msgspec's "Expected `int`, got `str` - at `$.n`" as "n: expected int, got str"."""
    match = _AT.match(message)
    what, path = (match["what"], match["path"] or "") if match else (message, "")
    missing = _MISSING.match(what)
    unknown = _UNKNOWN.match(what)
    if missing:
        path = f"{path}.{missing['field']}" if path else missing["field"]
        what = "this field is required"
    elif unknown:
        path = f"{path}.{unknown['field']}" if path else unknown["field"]
        what = "this field is not supported by this server (docs/api.md lists the fields)"
    else:
        what = what.replace("`", "")
        what = what[:1].lower() + what[1:]
    param = path or None
    return ApiError(400, f"{path}: {what}" if path else f"request body: {what}", param=param)


def decode_error(body: bytes, message: str) -> ApiError:
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as exc:
        return ApiError(
            400, f"the request body is not valid UTF-8 (byte {exc.start})", code="invalid_utf8"
        )
    return ApiError(400, f"malformed JSON in the request body: {message}", code="invalid_json")


def json_response(payload: object, status: int = 200) -> Response:
    return Response(msgspec.json.encode(payload), status_code=status, media_type="application/json")
