"""Free loopback ports for the tests that start listeners or servers."""

from __future__ import annotations

import contextlib
import random
import socket

HOST = "127.0.0.1"


def free_port() -> int:
    """A port nothing listens on right now (the OS's pick)."""
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def free_port_block(count: int) -> int:
    """The first of ``count`` consecutive free ports, below the ephemeral range, as an operator
    picks a base port: in that range any bind to port 0 or outgoing connection, the engine's
    own included, may take one of them before it is bound."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral_low = int(f.read().split()[0])
    for _ in range(100):
        base = random.randrange(10_000, ephemeral_low - count)
        with contextlib.ExitStack() as stack:
            try:
                for port in range(base, base + count):
                    stack.enter_context(socket.socket()).bind((HOST, port))
            except OSError:
                continue
        return base
    raise RuntimeError(f"no {count} consecutive free ports below {ephemeral_low}")
