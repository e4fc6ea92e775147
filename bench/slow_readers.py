"""Frontend memory under clients that read their streams slowly: N raw-socket clients
(a 4 KiB receive window, reading 1 KiB a second) each stream a long completion (n=16,
as many tokens as the context allows) and start another when one ends, for a while;
the frontend's RSS is sampled every second, then measured again 15 s after they left.
Each phase is READERS:SECONDS[:BACKLOG] on a fresh server: BACKLOG is
--max-stream-backlog (default: the server's default; a huge value is the baseline,
what the frontend held before the bound); ``--repeat K`` runs each phase K times on its
server, one after the other (does the memory come back each time?). ``--logprobs K``
asks for K alternatives per token (a larger chunk per token: the output rate in bytes);
``--serve-arg`` passes a flag to ``serve`` (a float32 model, whose CPU forward is faster
than bfloat16's). The baseline is the server's RSS after it served one such stream and
then READERS short ones at once, read at full speed (the RSS after the one stream alone is
reported too).

    python bench/slow_readers.py --phase 50:120 --phase 3:120 --phase 3:120:100000000 \
        --logprobs 5 --serve-arg=--dtype=float32
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
import psutil

from tokenspeed_aio.bench.output import OUT_HELP, default_out_path

MiB = 2**20
N = 16  # choices per stream
WARM_UP_TOKENS = 128  # per choice of the warm-up's concurrent streams


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int, extra: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "tokenspeed_aio", "serve", f"--port={port}",
           "--log-level=warning", "--disable-log-requests", *extra]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"serve exited with {proc.returncode}")
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("serve did not become healthy")


async def slow_reader(port: int, body: bytes, stop: float, counts: dict) -> None:
    """Stream after stream until ``stop``, reading 1 KiB a second."""
    loop = asyncio.get_running_loop()
    while loop.time() < stop:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        await loop.sock_connect(sock, ("127.0.0.1", port))
        await loop.sock_sendall(
            sock,
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body,
        )
        tail = b""
        while loop.time() < stop:
            chunk = await loop.sock_recv(sock, 1024)
            if not chunk:
                break
            tail = (tail + chunk)[-16:]
            if tail.endswith(b"0\r\n\r\n"):
                counts["ended"] += 1
                break
            await asyncio.sleep(1.0)
        sock.close()


def aborted_choices(port: int) -> float:
    """Choices the server ended with finish reason abort (a cut stream's choices)."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith("tokenspeed:request_success_total") and '"abort"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def fast_streams(url: str, body: bytes, count: int) -> None:
    """``count`` streams of ``body`` at once, each read as fast as it comes."""
    async with httpx.AsyncClient(timeout=600) as client:

        async def one() -> None:
            headers = {"Content-Type": "application/json"}
            async with client.stream("POST", url, content=body, headers=headers) as resp:
                async for _ in resp.aiter_bytes():
                    continue

        await asyncio.gather(*(one() for _ in range(count)))


async def phase(port: int, pid: int, readers: int, seconds: float, body: bytes) -> dict:
    proc = psutil.Process(pid)
    loop = asyncio.get_running_loop()
    baseline = proc.memory_info().rss
    counts = {"ended": 0}
    stop = loop.time() + seconds
    tasks = [asyncio.create_task(slow_reader(port, body, stop, counts)) for _ in range(readers)]
    samples = []
    cut = 0.0
    while loop.time() < stop - 2:  # the last count comes before the readers leave
        await asyncio.sleep(1.0)
        samples.append(proc.memory_info().rss)
        if len(samples) % 10 == 0:
            cut = await asyncio.to_thread(aborted_choices, port) / N
    cut = await asyncio.to_thread(aborted_choices, port) / N
    await asyncio.gather(*tasks, return_exceptions=True)
    await asyncio.sleep(15)  # the readers are gone: let the aborts settle
    after = proc.memory_info().rss
    return {
        "readers": readers,
        "seconds": seconds,
        "rss_baseline_mib": round(baseline / MiB, 1),
        "rss_peak_mib": round(max(samples) / MiB, 1),
        "rss_last_under_load_mib": round(samples[-1] / MiB, 1),
        "rss_15s_after_mib": round(after / MiB, 1),
        "streams_cut_by_the_bound": cut,
        "streams_ended_while_reading": counts["ended"],
    }


def measure(
    readers: int, seconds: float, extra: list[str], logprobs: int | None, repeat: int
) -> dict:
    port = free_port()
    server = start_server(port, extra)
    try:
        info = httpx.get(f"http://127.0.0.1:{port}/model_info", timeout=10).json()
        max_tokens = int(info["max_model_len"]) - 16
        body = json.dumps(
            {
                "prompt": "The for statement",
                "max_tokens": max_tokens,
                "n": N,
                "stream": True,
                "temperature": 0,
                "ignore_eos": True,
                "logprobs": logprobs,
            }
        ).encode()
        # Warm-up: the baseline is a server that has served one such stream and then as
        # many at once as there will be readers (short ones), all read at full speed: its
        # first-use allocations (the token strings of its logprobs) and the allocator's
        # high-water for that many running choices are not the slow readers' doing. The
        # RSS after the one stream is reported too.
        url = f"http://127.0.0.1:{port}/v1/completions"
        asyncio.run(fast_streams(url, body, 1))
        time.sleep(3)
        after_one = psutil.Process(server.pid).memory_info().rss
        short = json.dumps({**json.loads(body), "max_tokens": WARM_UP_TOKENS}).encode()
        asyncio.run(fast_streams(url, short, readers))
        time.sleep(15)
        rounds = [
            asyncio.run(phase(port, server.pid, readers, seconds, body)) for _ in range(repeat)
        ]
        result = {
            "flags": extra,
            "max_tokens": max_tokens,
            "logprobs": logprobs,
            "rss_after_one_stream_mib": round(after_one / MiB, 1),
            **rounds[0],
        }
        if repeat > 1:
            result["repeats"] = rounds[1:]
        return result
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--phase", action="append", default=None, help="READERS:SECONDS[:BACKLOG]")
    ap.add_argument("--logprobs", type=int, default=None, help="alternatives per token")
    ap.add_argument("--repeat", type=int, default=1, help="runs of each phase on its server")
    ap.add_argument("--serve-arg", action="append", default=[], help="a flag for serve")
    ap.add_argument("--out", type=Path, default=None, help=OUT_HELP)
    args = ap.parse_args()
    phases = []
    for spec in args.phase or ["50:120", "3:120", "3:120:100000000"]:
        readers, seconds, *backlog = spec.split(":")
        extra = [*args.serve_arg, *([f"--max-stream-backlog={backlog[0]}"] if backlog else [])]
        phases.append(measure(int(readers), float(seconds), extra, args.logprobs, args.repeat))
        print(json.dumps(phases[-1]), flush=True)
    out = args.out or default_out_path("slow-readers-cpu")
    out.parent.mkdir(parents=True, exist_ok=True)
    machine = f"{platform.node()} {os.cpu_count()} CPUs"
    out.write_text(json.dumps({"machine": machine, "phases": phases}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
