"""The requests the PD tests send through a gateway, and how they read the answers."""

from __future__ import annotations

import json

import httpx

from pd.harness import MODEL

PROMPTS = [
    "The for statement",
    "A longer prompt, so that its KV spans several pages of the pool: for while if",
    "x",
]
CHATS = [[{"role": "user", "content": "Tell me about the with statement."}]]
GREEDY = {"temperature": 0.0, "ignore_eos": True}


def completion(url: str, prompt: str, max_tokens: int = 8, **extra) -> httpx.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, **GREEDY, **extra}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60)


def chat(url: str, messages: list[dict], max_tokens: int = 8, **extra) -> httpx.Response:
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, **GREEDY, **extra}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)


def stream_text(url: str, route: str, body: dict) -> str:
    """The concatenated text of a streamed completion or chat (one choice)."""
    text = []
    body = {"model": MODEL, **GREEDY, **body, "stream": True}
    with httpx.stream("POST", f"{url}{route}", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            event = json.loads(line[5:])
            assert "error" not in event, event
            for choice in event.get("choices", []):
                text.append(choice.get("text") or choice.get("delta", {}).get("content") or "")
    return "".join(text)
