"""Rank processes: start, readiness, watching, shutdown (design: "Startup process
ownership").

* Every local rank is started before any readiness is awaited.
* Ready channels and process exits are watched together; readiness detection only
  reports failure, it never joins or terminates ranks.
* EOF on a ready channel is a failure until every rank has reported.
* Failure, termination and constructor-error cleanup share one shutdown latch; once
  cleanup started, later notifications cannot interrupt it.
* Signal callbacks only set a flag; cleanup runs outside the callback.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import signal
from collections.abc import Sequence
from multiprocessing.connection import Connection

from tokenspeed_aio.rank_process import RankLaunch, rank_main

logger = logging.getLogger(__name__)

TERMINATE_GRACE_SECONDS = 5.0


class RankFailure(RuntimeError):
    """A rank process failed (at startup or while serving)."""


class ShutdownLatch:
    """One process-local latch shared by every way of stopping."""

    def __init__(self) -> None:
        self.requested = asyncio.Event()
        self.reason = ""
        self._cleanup_started = False

    def request(self, reason: str) -> None:
        if not self.requested.is_set():
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


class Launcher:
    def __init__(self, launches: Sequence[RankLaunch], latch: ShutdownLatch | None = None) -> None:
        self.launches = list(launches)
        self.latch = latch or ShutdownLatch()
        self._ctx = mp.get_context("spawn")
        self.processes: list[mp.process.BaseProcess] = []
        self._ready: list[Connection] = []
        self.failure: str | None = None

    def start(self) -> None:
        """Start every rank before waiting for any."""
        for launch in self.launches:
            parent, child = self._ctx.Pipe(duplex=False)
            proc = self._ctx.Process(
                target=rank_main, args=(launch, child), name=f"ts-rank-{launch.rank}", daemon=False
            )
            proc.start()
            child.close()
            self.processes.append(proc)
            self._ready.append(parent)

    async def wait_ready(self) -> None:
        """Wait until every rank reported ready; raise RankFailure on the first failure
        report, on EOF of any channel before all reported, or on a rank's exit."""
        loop = asyncio.get_running_loop()
        pending = set(range(len(self.processes)))
        events: asyncio.Queue[tuple[int, str, object]] = asyncio.Queue()
        for i, (proc, conn) in enumerate(zip(self.processes, self._ready)):
            loop.add_reader(conn.fileno(), self._on_ready_channel, i, conn, events)
            loop.add_reader(proc.sentinel, events.put_nowait, (i, "exit", None))
        try:
            while pending:
                i, kind, value = await events.get()
                if kind == "ready":
                    pending.discard(i)
                    continue
                rank = self.launches[i].rank
                if kind != "failed":  # an exit or EOF: prefer the rank's own report
                    value = self._late_report(i) or value
                    kind = "failed" if value else kind
                if kind == "failed":
                    raise RankFailure(f"rank {rank} failed at startup: {value}")
                if kind == "eof":
                    raise RankFailure(
                        f"rank {rank} closed its ready channel before all ranks were ready"
                    )
                await asyncio.to_thread(self.processes[i].join, 1.0)
                code = self.processes[i].exitcode
                raise RankFailure(f"rank {rank} exited with code {code} during startup")
        finally:
            for proc, conn in zip(self.processes, self._ready):
                loop.remove_reader(conn.fileno())
                loop.remove_reader(proc.sentinel)

    def _late_report(self, i: int) -> str | None:
        """A failure report that was written just before the rank exited."""
        conn = self._ready[i]
        try:
            if conn.poll(0.5):
                kind, value = conn.recv()
                return value if kind == "failed" else None
        except (EOFError, OSError):
            return None
        return None

    @staticmethod
    def _on_ready_channel(i: int, conn: Connection, events: asyncio.Queue) -> None:
        try:
            kind, value = conn.recv()
        except (EOFError, OSError):
            asyncio.get_running_loop().remove_reader(conn.fileno())
            events.put_nowait((i, "eof", None))
            return
        events.put_nowait((i, kind, value))

    async def watch(self) -> str:
        """After startup: return a description of the first rank that exits."""
        loop = asyncio.get_running_loop()
        exited: asyncio.Future[int] = loop.create_future()
        for i, proc in enumerate(self.processes):
            loop.add_reader(proc.sentinel, lambda i=i: exited.done() or exited.set_result(i))
        try:
            i = await exited
        finally:
            for proc in self.processes:
                loop.remove_reader(proc.sentinel)
        proc = self.processes[i]
        await asyncio.to_thread(proc.join, 1.0)
        return f"rank {self.launches[i].rank} exited with code {proc.exitcode}"

    async def shutdown(self, grace: float = TERMINATE_GRACE_SECONDS) -> None:
        """Stop the whole process tree (idempotent: the latch runs cleanup once).

        Ranks that were asked to stop (a StopEngine on the wire) get ``grace`` seconds to
        exit on their own; the rest are terminated, then killed."""
        if not self.latch.begin_cleanup():
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        for proc in self.processes:
            await asyncio.to_thread(proc.join, max(0.0, deadline - loop.time()))
        for proc in self.processes:
            if proc.is_alive():
                proc.terminate()
        for proc in self.processes:
            await asyncio.to_thread(proc.join, 2.0)
            if proc.is_alive():
                proc.kill()
                await asyncio.to_thread(proc.join, 2.0)
        for conn in self._ready:
            conn.close()

    def exit_codes(self) -> list[int | None]:
        return [p.exitcode for p in self.processes]
