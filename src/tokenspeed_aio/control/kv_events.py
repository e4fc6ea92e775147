"""Publishing the scheduler's KV-cache events: once per round, after the round's last
scheduler mutation (Principle 5). Subscribers (a router, tests) get each round's net
batch in order; publishing never blocks the round."""

from __future__ import annotations

from collections.abc import Callable

from tokenspeed_aio.scheduler.kv_events import KVEvent

Subscriber = Callable[[list[KVEvent]], None]


class KVEventPublisher:
    def __init__(self) -> None:
        self._subscribers: list[Subscriber] = []

    def subscribe(self, fn: Subscriber) -> None:
        self._subscribers.append(fn)

    def publish(self, events: list[KVEvent]) -> None:
        if not events:
            return
        for fn in self._subscribers:
            fn(events)
