"""AsyncClient: a typed asyncio client for a running tokenspeed_aio server (OpenAI
and SGLang routes), over one pooled httpx.AsyncClient.

    async with AsyncClient("http://127.0.0.1:8000") as client:
        out = await client.completions("Hello", max_tokens=16)
        async with await client.chat(messages, stream=True) as stream:
            async for chunk in stream:
                ...

Only what is safe to repeat is retried, with exponential backoff and jitter: a
connection that could not be made (the request never left), and answers 502/503
(a proxy without a backend, an engine not ready). Never a 4xx, never a request
the server may already be running.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any, Literal, TypeVar, overload

import httpx
import msgspec

from tokenspeed_aio.client.errors import APIConnectionError, status_error
from tokenspeed_aio.client.stream import Stream
from tokenspeed_aio.protocol.openai import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    ModelList,
)
from tokenspeed_aio.protocol.sglang import (
    AbortRequest,
    AbortResult,
    GenerateRequest,
    GenerateResult,
)

T = TypeVar("T")

RETRY_STATUSES = frozenset({502, 503})


class Health(msgspec.Struct):
    ok: bool
    status: int
    message: str  # "ok", or the server's reason


class AsyncClient:
    """``base_url``: the server's root (``http://host:port``). ``api_key``: sent as a
    bearer token. ``timeout``: seconds for a whole non-streamed response (and
    between two chunks of a stream). ``max_retries``: extra attempts after a
    refused connection or a 502/503. ``http_client``: your own httpx client
    (proxies, TLS); it is not closed by ``aclose()``."""

    def __init__(
        self,
        base_url: str = "http://127.0.0.1:8000",
        api_key: str | None = None,
        *,
        timeout: float = 600.0,
        max_retries: int = 3,
        backoff: float = 0.25,
        max_backoff: float = 8.0,
        http_client: httpx.AsyncClient | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.max_retries = max_retries
        self.backoff = backoff
        self.max_backoff = max_backoff
        self._headers = {"content-type": "application/json"}
        if api_key:
            self._headers["authorization"] = f"Bearer {api_key}"
        self._owns_http = http_client is None
        self._http = http_client or httpx.AsyncClient(
            timeout=httpx.Timeout(timeout, connect=min(timeout, 10.0)),
            limits=httpx.Limits(max_connections=512, max_keepalive_connections=128),
        )

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._owns_http:
            await self._http.aclose()

    # -- OpenAI routes ----------------------------------------------------------
    @overload
    async def completions(
        self, prompt: Any, *, stream: Literal[False] = ..., **params: Any
    ) -> Completion: ...
    @overload
    async def completions(
        self, prompt: Any, *, stream: Literal[True], **params: Any
    ) -> Stream[Completion]: ...
    async def completions(
        self, prompt: Any, *, stream: bool = False, **params: Any
    ) -> Completion | Stream[Completion]:
        """POST /v1/completions. ``prompt``: a string, token ids, or a list of either.
        ``params``: the request's other fields (max_tokens, temperature, n, logprobs,
        echo, stop, ...; a misspelt one raises TypeError here)."""
        body = CompletionRequest(prompt=prompt, stream=stream, **params)
        if stream:
            return await self._stream("/v1/completions", body, Completion)
        return await self._call("POST", "/v1/completions", body, Completion)

    @overload
    async def chat(
        self, messages: list[Any], *, stream: Literal[False] = ..., **params: Any
    ) -> ChatCompletion: ...
    @overload
    async def chat(
        self, messages: list[Any], *, stream: Literal[True], **params: Any
    ) -> Stream[ChatCompletionChunk]: ...
    async def chat(
        self, messages: list[Any], *, stream: bool = False, **params: Any
    ) -> ChatCompletion | Stream[ChatCompletionChunk]:
        """POST /v1/chat/completions. ``messages``: dicts ({"role", "content"}) or
        ChatMessage; ``params`` as for completions (plus logprobs=True,
        top_logprobs, max_completion_tokens, chat_template_kwargs)."""
        body = ChatCompletionRequest(messages=messages, stream=stream, **params)
        if stream:
            return await self._stream("/v1/chat/completions", body, ChatCompletionChunk)
        return await self._call("POST", "/v1/chat/completions", body, ChatCompletion)

    async def models(self) -> ModelList:
        return await self._call("GET", "/v1/models", None, ModelList)

    # -- SGLang routes ------------------------------------------------------------
    async def generate(
        self,
        text: str | list[str] | None = None,
        *,
        input_ids: list[int] | list[list[int]] | None = None,
        sampling_params: dict[str, Any] | None = None,
        rid: str | list[str] | None = None,
        stream: bool = False,
        **extra: Any,
    ) -> GenerateResult | list[GenerateResult] | Stream[GenerateResult]:
        """POST /generate (SGLang). One result, a list for a batch, or a stream of
        results (text and ids so far) with ``stream=True``."""
        body = GenerateRequest(
            text=text,
            input_ids=input_ids,
            sampling_params=sampling_params,  # encoded as given
            rid=rid,
            stream=stream,
            **extra,
        )
        if stream:
            return await self._stream("/generate", body, GenerateResult)
        batch = isinstance(text, list) or bool(input_ids and isinstance(input_ids[0], list))
        kind: Any = list[GenerateResult] if batch else GenerateResult
        return await self._call("POST", "/generate", body, kind)

    async def abort(self, rid: str) -> list[str]:
        """Abort a running request (its rid, or an OpenAI response id); returns the
        engine requests that were still running."""
        result = await self._call("POST", "/abort_request", AbortRequest(rid=rid), AbortResult)
        return result.aborted

    async def health(self) -> Health:
        """GET /health, once (no retries: a 503 is the answer)."""
        response = await self._send("GET", "/health", None, stream=False, retries=0)
        await response.aread()
        if response.is_success:
            return Health(True, response.status_code, "ok")
        error = status_error(response.status_code, response.content, response.reason_phrase)
        return Health(False, response.status_code, error.message)

    # -- transport ----------------------------------------------------------------
    async def _call(self, method: str, path: str, body: Any, kind: type[T]) -> T:
        response = await self._send(method, path, body, stream=False)
        if not response.is_success:
            raise status_error(response.status_code, response.content, response.reason_phrase)
        return msgspec.json.decode(response.content, type=kind)

    async def _stream(self, path: str, body: Any, kind: type[T]) -> Stream[T]:
        response = await self._send("POST", path, body, stream=True)
        if not response.is_success:
            await response.aread()
            await response.aclose()
            raise status_error(response.status_code, response.content, response.reason_phrase)
        return Stream(response, kind)

    async def _send(
        self, method: str, path: str, body: Any, *, stream: bool, retries: int | None = None
    ) -> httpx.Response:
        retries = self.max_retries if retries is None else retries
        content = msgspec.json.encode(body) if body is not None else None
        url = self.base_url + path
        attempt = 0
        while True:
            request = self._http.build_request(method, url, content=content, headers=self._headers)
            try:
                response = await self._http.send(request, stream=stream)
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                if attempt == retries:
                    raise APIConnectionError(f"cannot reach {url}: {exc}") from exc
                delay = self._delay(attempt, None)
            else:
                if response.status_code not in RETRY_STATUSES or attempt == retries:
                    return response
                await response.aclose()
                delay = self._delay(attempt, response.headers.get("retry-after"))
            attempt += 1
            await asyncio.sleep(delay)

    def _delay(self, attempt: int, retry_after: str | None) -> float:
        """Exponential backoff with jitter; a server's Retry-After (seconds) wins,
        within max_backoff."""
        if retry_after is not None and retry_after.isdigit():
            return min(float(retry_after), self.max_backoff)
        return min(self.max_backoff, self.backoff * 2**attempt) * random.uniform(0.5, 1.0)
