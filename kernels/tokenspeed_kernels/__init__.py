"""Triton kernels of tokenspeed_aio, each with a pure-torch reference in ``reference.py``.

The kernels are exported lazily: importing the package (or its torch-only modules, such
as ``noise``) does not import Triton, so a CPU-only process that runs no kernel never
loads it -- Triton's nanobind extension otherwise reports its module-level objects as
leaked at every interpreter exit. A kernel named like its module (``decode_attention``,
``extend_attention``) is imported from the module: once any code imported the submodule,
the package attribute of that name is the module, whatever a lazy export says.

NOTE: on a host without CUDA the kernels run under Triton's interpreter. Triton reads
``TRITON_INTERPRET`` when a kernel is decorated, so it is set here, before the kernel modules
are imported (an explicit setting in the environment wins).
"""

import importlib
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

_EXPORTS = {
    "apply_rotary": "rotary",
    "fused_add_rms_norm": "rmsnorm",
    "kv_write": "kv_write",
    "num_kv_splits_for": "decode_attention",
    "rms_norm": "rmsnorm",
    "sample": "sampling",
    "silu_and_mul": "activation",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        try:  # a submodule named as an attribute (``tokenspeed_kernels.gemv``)
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
