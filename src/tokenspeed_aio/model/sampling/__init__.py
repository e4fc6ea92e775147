"""Sampling on the forward thread: per-slot settings (``SamplingState``) and the ``Sampler``."""

from tokenspeed_aio.model.sampling.batch import SamplingBatch
from tokenspeed_aio.model.sampling.sampler import Sampler, SamplerOutput, compute_token_logprobs
from tokenspeed_aio.model.sampling.state import SamplingState

__all__ = ["Sampler", "SamplerOutput", "SamplingBatch", "SamplingState", "compute_token_logprobs"]
