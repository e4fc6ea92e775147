"""tokenspeed_aio: an LLM inference engine whose control plane is asyncio-native.

The public names are exported lazily, so importing one layer of the package (``wire``, the
scheduler) does not import the layers above it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenspeed_aio.api.engine import AsyncEngine
    from tokenspeed_aio.api.outputs import RequestOutput
    from tokenspeed_aio.args import EngineArgs
    from tokenspeed_aio.sampling_params import SamplingParams

_EXPORTS = {
    "AsyncEngine": "tokenspeed_aio.api.engine",
    "EngineArgs": "tokenspeed_aio.args",
    "RequestOutput": "tokenspeed_aio.api.outputs",
    "SamplingParams": "tokenspeed_aio.sampling_params",
}

__all__ = ["AsyncEngine", "EngineArgs", "RequestOutput", "SamplingParams"]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'tokenspeed_aio' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
