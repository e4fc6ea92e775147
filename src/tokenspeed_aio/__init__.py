"""tokenspeed_aio: an LLM inference engine whose control plane is asyncio-native."""
