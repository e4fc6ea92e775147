"""Triton kernels of tokenspeed_aio, each with a pure-torch reference in ``reference.py``.

NOTE: on a host without CUDA the kernels run under Triton's interpreter. Triton reads
``TRITON_INTERPRET`` when a kernel is decorated, so it is set here, before the kernel modules
are imported (an explicit setting in the environment wins).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tokenspeed_kernels.activation import silu_and_mul
from tokenspeed_kernels.decode_attention import decode_attention, num_kv_splits_for
from tokenspeed_kernels.extend_attention import extend_attention
from tokenspeed_kernels.kv_write import kv_write
from tokenspeed_kernels.rmsnorm import fused_add_rms_norm, rms_norm
from tokenspeed_kernels.rotary import apply_rotary
from tokenspeed_kernels.sampling import sample

__all__ = [
    "apply_rotary",
    "decode_attention",
    "extend_attention",
    "fused_add_rms_norm",
    "kv_write",
    "num_kv_splits_for",
    "rms_norm",
    "sample",
    "silu_and_mul",
]
