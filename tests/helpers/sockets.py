"""The TCP sockets a set of processes listens on (the loopback-binding tests)."""

from __future__ import annotations

from collections.abc import Iterable

import psutil


def listening(processes: Iterable[psutil.Process]) -> list[tuple[str, int, int]]:
    """(address, port, pid) of every TCP socket ``processes`` listen on."""
    found = []
    for proc in processes:
        for conn in proc.net_connections(kind="inet"):
            if conn.status == psutil.CONN_LISTEN:
                found.append((conn.laddr.ip, conn.laddr.port, proc.pid))
    return found
