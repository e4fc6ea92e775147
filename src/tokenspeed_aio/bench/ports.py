"""Free loopback ports for servers a script or test starts: picked below the ephemeral range,
as an operator picks a port. A port the OS hands out for a bind to port 0 lies in that range,
where any outgoing connection on the machine -- the started engine's own ranks included --
may take it in the seconds before the server binds it. No port is handed out twice by one
process, so two servers started together never get the same one."""

from __future__ import annotations

import contextlib
import random
import socket

HOST = "127.0.0.1"
LOWEST = 10_000
_handed_out: set[int] = set()


def free_port() -> int:
    """A port nothing listens on right now, below the ephemeral range (module doc)."""
    return free_port_block(1)


def free_port_block(count: int) -> int:
    """The first of ``count`` consecutive free ports below the ephemeral range, none handed
    out before by this process (module doc)."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral_low = int(f.read().split()[0])
    for _ in range(200):
        base = random.randrange(LOWEST, ephemeral_low - count)
        ports = range(base, base + count)
        if _handed_out.intersection(ports):
            continue
        with contextlib.ExitStack() as stack:
            try:
                for port in ports:
                    stack.enter_context(socket.socket()).bind((HOST, port))
            except OSError:
                continue
        _handed_out.update(ports)
        return base
    raise RuntimeError(f"no {count} consecutive free ports in [{LOWEST}, {ephemeral_low})")
