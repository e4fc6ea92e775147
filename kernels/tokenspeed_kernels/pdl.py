"""Programmatic dependent launch (PDL) for a decode step's products and the norms and
activations between them: a kernel's programs are resident and waiting while the kernel before
it in the stream finishes, instead of being launched after it ends.

On Hopper (sm_90) and later a kernel launched with the programmatic stream serialization
attribute (Triton's ``launch_pdl=True``) may be scheduled once every program of the kernel
before it has signalled ``gdc_launch_dependents`` (or exited); its programs block in
``gdc_wait`` until that kernel has completed and its writes are visible. CUDA graphs keep the
launches' programmatic edges, so a captured decode step gets the same overlap. What it saves
is the gap between two products and the next one's start-up, and a program may start reading
what no kernel writes (its weight, ``gemv.py``, ``skinny_gemm.py``) before it waits: a decode
step is mostly products, most of them right after another or after a norm (a Qwen3 layer's
o_proj, norm, gate_up, down and the next layer's norm and qkv). Who takes part: ``gemv``,
``skinny_gemm`` (and its split-K sum), ``rmsnorm`` and ``activation``; attention launches
ordinarily (with PDL it lost at batch 1, docs/performance.md).

The rule a kernel that takes part keeps, so that any sequence of kernels -- these and others,
whose launches are ordinary -- stays ordered as a plain stream orders it:

- ``wait_prior`` (the wait, then the signal) comes before the first store and before the
  first load of anything the kernel right ahead in the stream may write; only what no
  kernel writes (a weight) is read before it.
- The signal follows the wait, so at most one kernel waits behind a running one: the next
  kernel's programs become resident, the one after it does not until the next is running.
  It also means that when a kernel's programs start, every kernel before the one right
  ahead of it has completed.

A kernel after an ordinary one gains nothing and loses nothing (it is scheduled when that
kernel exits, as without PDL); an ordinary kernel after one of these waits for it to end.

A launch passes ``**launch_args()``: the ``PDL`` constexpr for ``wait_prior`` and the launch
attribute. PDL is off under Triton's interpreter (it has no grid dependency control), below
sm_90, and with ``TOKENSPEED_PDL=0`` (every launch then ordinary).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl


@functools.cache
def enabled() -> bool:
    """Whether launches use PDL (module doc); decided once, on first use, so importing the
    kernels does not initialize CUDA."""
    if os.environ.get("TRITON_INTERPRET") == "1" or os.environ.get("TOKENSPEED_PDL") == "0":
        return False
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


def launch_args() -> dict[str, bool]:
    """A launch's keyword arguments for PDL: the kernel's ``PDL`` constexpr and Triton's
    ``launch_pdl`` launch option."""
    on = enabled()
    return {"PDL": on, "launch_pdl": on}


@triton.jit
def wait_prior(PDL: tl.constexpr):
    """Wait for the previous kernel in the stream to complete (its writes visible), then let
    the next one's programs be scheduled (module doc). Nothing without PDL."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
