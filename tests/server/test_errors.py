"""Bad requests get a 4xx with an OpenAI error body that names the field (and the
limit), and the server keeps serving; unexpected failures are 500s naming a
request id, without the traceback."""

from __future__ import annotations

import asyncio
import socket

import httpx
import pytest
from server.conftest import scrape

from tokenspeed_aio.server.app import build_app

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
USER = [{"role": "user", "content": "hi"}]

# (id, path, body: dict (JSON) or bytes (raw), status, words the message must contain)
BAD_REQUESTS = [
    ("malformed-json", COMP, b'{"prompt": "a", "max_tokens": ', 400, ["malformed JSON"]),
    ("not-an-object", COMP, b"[1, 2]", 400, ["expected object"]),
    ("empty-body", COMP, b"", 400, ["empty"]),
    ("non-utf8", COMP, b'{"prompt": "\xff\xfe"}', 400, ["UTF-8"]),
    ("wrong-type", COMP, {"prompt": "a", "max_tokens": "ten"}, 400, ["max_tokens", "int"]),
    ("missing-prompt", COMP, {"max_tokens": 3}, 400, ["prompt", "required"]),
    ("negative-max-tokens", COMP, {"prompt": "a", "max_tokens": -1}, 400, ["max_tokens", "1"]),
    ("temperature-below-0", COMP, {"prompt": "a", "temperature": -0.5}, 400, ["temperature"]),
    ("top-p-above-1", COMP, {"prompt": "a", "top_p": 1.5}, 400, ["top_p", "(0, 1]"]),
    ("n-too-large", COMP, {"prompt": "a", "n": 100}, 400, ["n:", "16"]),
    ("logprobs-too-large", COMP, {"prompt": "a", "logprobs": 50}, 400, ["logprobs", "20"]),
    ("empty-prompt", COMP, {"prompt": ""}, 400, ["prompt", "empty"]),
    ("empty-prompt-list", COMP, {"prompt": []}, 400, ["prompt", "empty"]),
    ("mixed-prompt-list", COMP, {"prompt": ["a", 1]}, 400, ["prompt", "mix"]),
    ("token-out-of-vocab", COMP, {"prompt": [1, 99999]}, 400, ["99999", "vocabulary"]),
    ("prompt-too-long", COMP, {"prompt": [7] * 1000, "max_tokens": 100}, 400, ["1024", "1100"]),
    ("unknown-model", COMP, {"prompt": "a", "model": "gpt-9"}, 404, ["gpt-9", "does not exist"]),
    ("bad-stop-type", COMP, {"prompt": "a", "stop": 3}, 400, ["stop"]),
    ("bad-response-format", COMP, {"prompt": "a", "response_format": {"type": "xml"}},
     400, ["response_format", "xml"]),
    ("two-grammars", COMP, {"prompt": "a", "regex": "a+", "ebnf": 'root ::= "a"'},
     400, ["one structured-output field", "regex, ebnf"]),
    ("empty-messages", CHAT, {"messages": []}, 400, ["messages", "empty"]),
    ("bad-role", CHAT, {"messages": [{"role": "robot", "content": "x"}]}, 400,
     ["messages[0].role"]),
    ("image-part", CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     400, ["messages[0].content[0]", "text"]),
    ("top-logprobs-alone", CHAT, {"messages": USER, "top_logprobs": 2}, 400, ["logprobs"]),
    ("top-logprobs-too-large", CHAT, {"messages": USER, "logprobs": True, "top_logprobs": 30},
     400, ["top_logprobs:", "20"]),
    ("max-completion-tokens-0", CHAT, {"messages": USER, "max_completion_tokens": 0}, 400,
     ["max_completion_tokens:"]),
    ("chat-too-long", CHAT, {"messages": USER, "max_tokens": 5000}, 400, ["1024", "5000"]),
    ("generate-no-input", "/generate", {"sampling_params": {}}, 400, ["text", "input_ids"]),
    ("generate-bad-param", "/generate", {"text": "a", "sampling_params": {"max_new_tokens": 0}},
     400, ["sampling_params.max_new_tokens"]),
    ("generate-logprobs-too-large", "/generate",
     {"text": "a", "return_logprob": True, "top_logprobs_num": 50}, 400, ["top_logprobs_num:"]),
    ("abort-without-rid", "/abort_request", {}, 400, ["rid"]),
    ("unknown-route", "/v1/nothing", {}, 404, ["/v1/nothing"]),
]  # fmt: skip


@pytest.mark.parametrize(
    "path, body, status, words", [c[1:] for c in BAD_REQUESTS], ids=[c[0] for c in BAD_REQUESTS]
)
async def test_bad_request_is_a_clear_4xx(http_server, path, body, status, words):
    async with httpx.AsyncClient(base_url=http_server.base_url, headers=http_server.headers) as c:
        if isinstance(body, bytes):
            response = await c.post(path, content=body)
        else:
            response = await c.post(path, json=body)
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        for word in words:
            assert word in error["message"], error["message"]
        # and the server still serves
        ok = await c.post(COMP, json={"prompt": "still there?", "max_tokens": 2})
        assert ok.status_code == 200


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "x"}])
async def test_api_key_is_required_except_for_health_and_metrics(http_server, headers):
    async with httpx.AsyncClient(base_url=http_server.base_url, headers=headers) as c:
        routes = [("GET", "/v1/models"), ("POST", COMP), ("POST", "/tokenize"),
                  ("GET", "/server_info"), ("GET", "/version")]  # fmt: skip
        for method, path in routes:
            response = await c.request(method, path, json={"prompt": "a"})
            assert response.status_code == 401, path
            assert "API key" in response.json()["error"]["message"]
        assert (await c.get("/health")).status_code == 200
        assert (await c.get("/metrics")).status_code == 200  # scrapers carry no key


async def test_rejections_are_counted_by_status(http_server):
    key = 'tokenspeed:http_requests_rejected_total{status="404"}'
    before = (await scrape(http_server.base_url)).get(key, 0)
    async with httpx.AsyncClient(base_url=http_server.base_url, headers=http_server.headers) as c:
        await c.post(COMP, json={"prompt": "a", "model": "nope"})
    assert (await scrape(http_server.base_url))[key] == before + 1


def raw_http(port: int, head: bytes, body_chunks: list[bytes] = ()) -> bytes:
    """Send a hand-written request; read back the response (headers and body)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(head)
        for chunk in body_chunks:
            s.sendall(chunk)
        response = b""
        while b"\r\n\r\n" not in response:
            response += s.recv(65536)
        headers, _, body = response.partition(b"\r\n\r\n")
        length = int(headers.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        while len(body) < length:
            body += s.recv(65536)
        return headers + b"\r\n\r\n" + body


async def test_body_over_the_limit_is_413(http_server):
    port = int(http_server.base_url.rsplit(":", 1)[1])
    auth = f"Authorization: Bearer {http_server.api_key}\r\n".encode()
    declared = (
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        + auth
        + b"Content-Length: 9000000\r\n\r\n"
    )
    response = await asyncio.to_thread(raw_http, port, declared)
    assert response.startswith(b"HTTP/1.1 413") and b"too large" in response
    # no Content-Length: the bytes that arrive are counted
    chunked = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n" + auth
    chunked += b"Transfer-Encoding: chunked\r\n\r\n"
    piece = b"x" * (1 << 20)
    chunks = [b"%x\r\n%s\r\n" % (len(piece), piece)] * 9
    response = await asyncio.to_thread(raw_http, port, chunked, chunks)
    assert response.startswith(b"HTTP/1.1 413") and b"8388608" in response


async def test_unexpected_exception_is_a_500_with_a_request_id(start_engine, caplog):
    engine = await start_engine()
    app = build_app(engine, served_model_name="m")

    async def broken() -> None:
        raise RuntimeError("secret internal detail")

    app.add_api_route("/broken", broken)  # beside the real routes, under the real middleware
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        response = await c.get("/broken", headers={"x-request-id": "req-42"})
    assert response.status_code == 500
    error = response.json()["error"]
    assert "req-42" in error["message"] and error["type"] == "server_error"
    assert "secret" not in response.text and "Traceback" not in response.text
    assert response.headers["x-request-id"] == "req-42"
    assert "secret internal detail" in caplog.text  # the traceback went to the log
