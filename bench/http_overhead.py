"""HTTP path overhead: short completions at concurrency 64 through our server, through
AsyncEngine in-process (the gap is the frontend + wire), and through `transformers
serve` when it runs here -- same prompts, same run.

    python bench/http_overhead.py [--requests 512] [--concurrency 64] [--max-tokens 16]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

from tokenspeed_aio import AsyncEngine, EngineArgs, SamplingParams
from tokenspeed_aio.bench.output import OUT_HELP, default_out_path, git_commit
from tokenspeed_aio.model_source import DEFAULT_MODEL_DIR


def prompts(n: int) -> list[str]:
    from pydoc_data import topics

    words = " ".join(topics.topics[k] for k in sorted(topics.topics)).split()
    return [" ".join(words[i * 24 : i * 24 + 24]) for i in range(n)]


def summarize(name: str, ttfts: list[float], tokens: int, wall: float, n: int) -> dict:
    t = np.asarray(ttfts) * 1e3
    return {
        "target": name,
        "requests": n,
        "requests_per_s": n / wall,
        "output_tok_s": tokens / wall,
        "ttft_p50_ms": float(np.percentile(t, 50)),
        "ttft_p99_ms": float(np.percentile(t, 99)),
    }


async def drive(url: str, model: str, texts: list[str], conc: int, max_tokens: int, extra: dict):
    sem = asyncio.Semaphore(conc)
    ttfts: list[float] = []
    tokens = 0
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=conc)) as c:

        async def one(text: str) -> None:
            nonlocal tokens
            body = {"model": model, "prompt": text, "max_tokens": max_tokens, "stream": True,
                    "temperature": 0, **extra}  # fmt: skip
            async with sem:
                start = time.perf_counter()
                first = None
                async with c.stream("POST", f"{url}/v1/completions", json=body) as resp:
                    resp.raise_for_status()
                    async for line in resp.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        chunk = json.loads(line[6:])
                        if chunk.get("choices") and chunk["choices"][0].get("text"):
                            first = first or time.perf_counter()
                            tokens += 1
                ttfts.append((first or time.perf_counter()) - start)

        start = time.perf_counter()
        await asyncio.gather(*(one(t) for t in texts))
        return ttfts, tokens, time.perf_counter() - start


async def in_process(texts: list[str], conc: int, max_tokens: int) -> dict:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    sem = asyncio.Semaphore(conc)
    ttfts: list[float] = []
    tokens = 0
    async with await AsyncEngine.start(EngineArgs()) as engine:

        async def one(text: str) -> None:
            nonlocal tokens
            async with sem:
                start = time.perf_counter()
                first = None
                async for out in engine.generate(text, params):
                    first = first or time.perf_counter()
                    tokens += len(out.delta_token_ids)
                ttfts.append(first - start)

        await one(texts[0])  # warm up
        ttfts.clear()
        tokens = 0
        start = time.perf_counter()
        await asyncio.gather(*(one(t) for t in texts))
        wall = time.perf_counter() - start
    return summarize("AsyncEngine in-process", ttfts, tokens, wall, len(texts))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def over_http(name: str, command: list[str], port: int, model: str, texts, conc, mt, extra):
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                return {"target": name, "error": f"exited with {proc.returncode} at startup"}
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.5)
        else:
            return {"target": name, "error": "did not become healthy in 180 s"}
        try:
            await drive(url, model, texts[:1], 1, mt, extra)  # warm up (lazy model load)
            ttfts, tokens, wall = await drive(url, model, texts, conc, mt, extra)
        except httpx.HTTPError as err:
            return {"target": name, "error": repr(err)}
        return summarize(name, ttfts, tokens, wall, len(texts))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(30)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=512)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--out", help=OUT_HELP)
    ns = parser.parse_args()
    texts = prompts(ns.requests)
    conc, mt = ns.concurrency, ns.max_tokens
    rows = []
    port = free_port()
    ours = [sys.executable, "-m", "tokenspeed_aio", "serve", "--port", str(port),
            "--log-level", "warning"]  # fmt: skip
    rows.append(await over_http("tokenspeed_aio serve (HTTP)", ours, port, "tokenspeed-default",
                                texts, conc, mt, {"ignore_eos": True}))  # fmt: skip
    rows.append(await in_process(texts, conc, mt))
    port = free_port()
    peer = ["transformers", "serve", str(DEFAULT_MODEL_DIR), "--port", str(port),
            "--continuous-batching"]  # fmt: skip
    rows.append(await over_http("transformers serve --continuous-batching", peer, port,
                                str(DEFAULT_MODEL_DIR), texts, conc, mt, {}))  # fmt: skip
    result = {
        "command": "python bench/http_overhead.py " + " ".join(sys.argv[1:]),
        "machine": f"{platform.machine()} {os.cpu_count()} cores",
        "date": time.strftime("%Y-%m-%d"),
        "commit": git_commit(),
        "rows": rows,
    }
    out = Path(ns.out) if ns.out else default_out_path("http-overhead")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print("| target | req/s | output tok/s | TTFT p50 ms | TTFT p99 ms |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        if "error" in r:
            print(f"| {r['target']} | failed: {r['error']} | | | |")
        else:
            print(f"| {r['target']} | {r['requests_per_s']:.1f} | {r['output_tok_s']:.0f} | "
                  f"{r['ttft_p50_ms']:.1f} | {r['ttft_p99_ms']:.1f} |")  # fmt: skip
    print(f"wrote {out}")


if __name__ == "__main__":
    asyncio.run(main())
