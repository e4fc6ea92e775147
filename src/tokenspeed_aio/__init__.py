"""tokenspeed_aio: an LLM inference engine whose control plane is asyncio-native."""

from tokenspeed_aio.api.engine import AsyncEngine
from tokenspeed_aio.api.outputs import RequestOutput
from tokenspeed_aio.api.sampling_params import SamplingParams
from tokenspeed_aio.args import EngineArgs

__all__ = ["AsyncEngine", "EngineArgs", "RequestOutput", "SamplingParams"]
