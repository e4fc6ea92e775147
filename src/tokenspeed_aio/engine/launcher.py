"""Rank processes: start, readiness, watching, shutdown (design: "Startup process
ownership").

* Every local rank is started before any readiness is awaited.
* Ready channels and process exits are watched together; readiness detection only
  reports failure, it never joins or terminates ranks.
* EOF on a ready channel is a failure until every rank has reported.
* Failure, termination and constructor-error cleanup share one shutdown latch; once
  cleanup started, later notifications cannot interrupt it.
* Signal callbacks only set a flag; cleanup runs outside the callback.

Ranks are fresh interpreters (``python -m tokenspeed_aio.engine.rank_process``), not
multiprocessing children: they never re-import the embedding program's main module.
Each gets its launch spec on stdin and a ready channel (a pipe) as an inherited fd.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import pickle
import signal
import subprocess
import sys
from collections.abc import Sequence

from tokenspeed_aio.engine.rank_process import RankLaunch

logger = logging.getLogger(__name__)

TERMINATE_GRACE_SECONDS = 5.0


class RankFailure(RuntimeError):
    """A rank process failed (at startup or while serving)."""


class ShutdownLatch:
    """One process-local latch shared by every way of stopping."""

    def __init__(self) -> None:
        self.requested = asyncio.Event()
        self.repeated = asyncio.Event()  # a second request: stop at once, no drain
        self.reason = ""
        self._cleanup_started = False

    def request(self, reason: str) -> None:
        if self.requested.is_set():
            self.repeated.set()
            return
        self.reason = reason
        self.requested.set()

    def begin_cleanup(self) -> bool:
        """True for the first caller only."""
        if self._cleanup_started:
            return False
        self._cleanup_started = True
        return True

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.request, signal.Signals(sig).name)


class _Rank:
    """One rank process, its ready channel, and an fd that becomes readable at its exit."""

    def __init__(self, launch: RankLaunch) -> None:
        self.launch = launch
        read_fd, write_fd = os.pipe()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tokenspeed_aio.engine.rank_process", str(write_fd)],
            stdin=subprocess.PIPE,
            pass_fds=(write_fd,),
            start_new_session=False,
        )
        os.close(write_fd)
        self.proc.stdin.write(pickle.dumps(launch))
        self.proc.stdin.close()
        self.ready = os.fdopen(read_fd, "rb", buffering=0)
        self.exited_fd = os.pidfd_open(self.proc.pid)
        self._buffer = b""

    def read_reports(self) -> list[dict] | None:
        """Reports now readable on the channel; None at EOF."""
        chunk = self.ready.read(65536)
        if not chunk:
            return None
        self._buffer += chunk
        *lines, self._buffer = self._buffer.split(b"\n")
        return [json.loads(line) for line in lines if line]

    def close(self) -> None:
        self.ready.close()
        os.close(self.exited_fd)


class Launcher:
    def __init__(self, launches: Sequence[RankLaunch], latch: ShutdownLatch | None = None) -> None:
        self.launches = list(launches)
        self.latch = latch or ShutdownLatch()
        self.ranks: list[_Rank] = []

    def start(self) -> None:
        """Start every rank before waiting for any."""
        self.ranks = [_Rank(launch) for launch in self.launches]

    async def wait_ready(self) -> None:
        """Wait until every rank reported ready; raise RankFailure on the first failure
        report, on EOF of any channel before all reported, or on a rank's exit."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[tuple[int, str, str | None]] = asyncio.Queue()
        pending = set(range(len(self.ranks)))
        for i, rank in enumerate(self.ranks):
            loop.add_reader(rank.ready.fileno(), self._on_channel, i, events)
            loop.add_reader(rank.exited_fd, events.put_nowait, (i, "exit", None))
        try:
            while pending:
                i, kind, value = await events.get()
                if kind == "ready":
                    pending.discard(i)
                    continue
                rank_id = self.launches[i].rank
                if kind == "failed":
                    raise RankFailure(f"rank {rank_id} failed at startup: {value}")
                if kind == "eof":
                    raise RankFailure(
                        f"rank {rank_id} closed its ready channel before all ranks were ready"
                    )
                code = await asyncio.to_thread(self.ranks[i].proc.wait)
                raise RankFailure(f"rank {rank_id} exited with code {code} during startup")
        finally:
            for rank in self.ranks:
                loop.remove_reader(rank.ready.fileno())
                loop.remove_reader(rank.exited_fd)

    def _on_channel(self, i: int, events: asyncio.Queue) -> None:
        reports = self.ranks[i].read_reports()
        if reports is None:
            asyncio.get_running_loop().remove_reader(self.ranks[i].ready.fileno())
            events.put_nowait((i, "eof", None))
            return
        for report in reports:
            events.put_nowait((i, report["kind"], report.get("value")))

    async def watch(self) -> str:
        """After startup: describe the first rank that exits."""
        loop = asyncio.get_running_loop()
        exited: asyncio.Future[int] = loop.create_future()

        def on_exit(i: int) -> None:
            if not exited.done():
                exited.set_result(i)

        for i, rank in enumerate(self.ranks):
            loop.add_reader(rank.exited_fd, on_exit, i)
        try:
            i = await exited
        finally:
            for rank in self.ranks:
                loop.remove_reader(rank.exited_fd)
        code = await asyncio.to_thread(self.ranks[i].proc.wait)
        return f"rank {self.launches[i].rank} exited with code {code}"

    async def shutdown(self, grace: float = TERMINATE_GRACE_SECONDS) -> None:
        """Stop the whole process tree (idempotent: the latch runs cleanup once).

        Ranks that were asked to stop (a StopEngine on the wire) get ``grace`` seconds to
        exit on their own; the rest are terminated, then killed."""
        if not self.latch.begin_cleanup():
            return
        await asyncio.to_thread(self._reap, grace)
        for rank in self.ranks:
            rank.close()
        codes = self.exit_codes()
        if any(codes):
            logger.warning("rank processes exited with %s", codes)
        else:
            logger.info("rank processes exited with %s", codes)

    def _reap(self, grace: float) -> None:
        for rank in self.ranks:
            try:
                rank.proc.wait(grace)
            except subprocess.TimeoutExpired:
                break
        for signal_fn in (subprocess.Popen.terminate, subprocess.Popen.kill):
            alive = [r for r in self.ranks if r.proc.poll() is None]
            for rank in alive:
                signal_fn(rank.proc)
            for rank in alive:
                try:
                    rank.proc.wait(2.0)
                except subprocess.TimeoutExpired:
                    continue

    def exit_codes(self) -> list[int | None]:
        return [r.proc.poll() for r in self.ranks]
