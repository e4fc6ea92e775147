"""Per-layer fences of a plan's load-backs: one load-stream event per layer, recorded once
that layer of every loaded block is in the device pool. The forward waits for layer k's
event on its own stream before attending layer k (model/layers/attention.py); a decode
graph replay, which holds no fence, waits for the last layer's before it starts."""

from __future__ import annotations

import torch


class LayerFences:
    __slots__ = ("events",)

    def __init__(self, events: list[torch.cuda.Event]) -> None:
        self.events = events

    def wait(self, layer: int) -> None:
        torch.cuda.current_stream().wait_event(self.events[layer])

    def wait_all(self) -> None:
        torch.cuda.current_stream().wait_event(self.events[-1])
