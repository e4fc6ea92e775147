"""The local address a process is reached at by a peer on ``peer_host``: loopback for a
peer on this machine (or one whose name does not resolve), else the address of the
interface that routes to it -- so a socket bound there serves that peer and no other
interface."""

from __future__ import annotations

import ipaddress
import socket


def local_address(peer_host: str) -> str:
    try:
        if ipaddress.ip_address(socket.gethostbyname(peer_host)).is_loopback:
            return "127.0.0.1"
    except (OSError, ValueError):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((peer_host, 1))  # a UDP connect sends nothing: it picks the route
        return s.getsockname()[0]
