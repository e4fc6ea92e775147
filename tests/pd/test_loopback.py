"""A prefill/decode pair started without addresses listens on loopback only: every TCP
socket of both engines' processes -- the HTTP ports, the bootstrap server, the KV
senders, the ranks' own sockets -- is on 127.0.0.1, except the Mooncake transfer engine's
two (its handshake and its TCP transport), which that build binds on every interface
whatever it is told (docs/disaggregation.md); the test names them from the engines' logs
and checks they are the only exceptions. A request through the gateway is served."""

from __future__ import annotations

import re

import pytest
from helpers.sockets import listening

from pd.harness import start_engine, start_gateway, wait_engine
from pd.workload import PROMPTS, completion

pytestmark = pytest.mark.timeout(300)

LOOPBACK = ("127.0.0.1", "::1")
VERBOSE = {"GLOG_minloglevel": "0"}  # Mooncake logs the port its TCP transport listens on


def mooncake_ports(engine) -> set[int]:
    """The ports the engine's Mooncake transfer engine listens on, from its log."""
    log = engine.log()
    ports = {int(p) for p in re.findall(r"Mooncake \w+ session [\d.]+:(\d+)", log)}
    ports |= {int(p) for p in re.findall(r"TcpTransport: listen on port (\d+)", log)}
    return ports


@pytest.fixture(scope="module")
def pair(pd_checkpoint, pd_logs):
    engines = [
        start_engine(pd_checkpoint, pd_logs, name, role=role, env=VERBOSE, log_level="info")
        for name, role in (("P-lo", "prefill"), ("D-lo", "decode"))
    ]
    try:
        for engine in engines:
            wait_engine(engine)
        gateway = start_gateway(pd_logs, "gw-lo", prefill=engines[:1], decode=engines[1:])
        try:
            yield engines, gateway
        finally:
            gateway.stop()
    finally:
        for engine in engines:
            engine.stop()


def test_a_pd_pair_listens_on_loopback_only(pair):
    engines, gateway = pair
    assert completion(gateway.url, PROMPTS[1]).status_code == 200
    prefill = engines[0]
    for engine in engines:
        sockets = listening(engine.tree())
        mooncake = mooncake_ports(engine)
        assert len(mooncake) == 2, (engine.name, mooncake)
        others = [s for s in sockets if s[0] not in LOOPBACK]
        assert {port for _, port, _ in others} <= mooncake, (engine.name, others)
        ours = [s for s in sockets if s[1] not in mooncake]
        assert ours and all(ip in LOOPBACK for ip, _, _ in ours), (engine.name, ours)
        print(
            f"reliability: {engine.name} listens on {len(ours)} loopback sockets; "
            f"Mooncake's {sorted(mooncake)} on {sorted({ip for ip, *_ in others})}"
        )
    bootstrap = [s for s in listening(prefill.tree()) if s[1] == prefill.bootstrap_port]
    assert bootstrap and all(ip == "127.0.0.1" for ip, _, _ in bootstrap), bootstrap
