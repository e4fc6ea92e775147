"""The L3 tier resolved at startup, from the engine's flags, the model's configuration and
this rank's L2 host pages: the deployment identity, the backend and the executor."""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

import torch

from tokenspeed_aio.args import EngineArgs
from tokenspeed_aio.cache.l3.backends import (
    FileBackend,
    MooncakeBackend,
    MooncakeSettings,
    SlowBackend,
)
from tokenspeed_aio.cache.l3.executor import L3Executor
from tokenspeed_aio.cache.l3.identity import DeploymentIdentity
from tokenspeed_aio.guards.host_sync import allow_host_sync
from tokenspeed_aio.wire.addresses import local_address

logger = logging.getLogger(__name__)

WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt")
# Fault tests: every store call waits this many seconds first (unset: never)
STORAGE_DELAY_ENV = "TOKENSPEED_INJECT_STORAGE_DELAY"


def weights_identity(args: EngineArgs, dtype: torch.dtype) -> str:
    """The checkpoint's identity: its directory and, per weight file, its name, size and
    modification time (a changed file is other weights); dummy weights by their seed."""
    model = Path(args.model).resolve()
    parts = [f"dtype={str(dtype).removeprefix('torch.')}", f"quantization={args.quantization}"]
    parts.append(f"version={args.weight_version}")
    if args.load_format == "dummy":
        parts.append(
            f"dummy seed={args.seed} config={_digest((model / 'config.json').read_bytes())}"
        )
    else:
        files = sorted(f for pattern in WEIGHT_FILES for f in model.glob(pattern))
        parts.append(str(model))
        parts += [f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files]
    return _digest("\n".join(parts).encode())


def deployment_identity(
    args: EngineArgs,
    architecture: str,
    dtype: torch.dtype,
    host_pages: torch.Tensor,
    tp_rank: int,
    tp_size: int,
    kv_scales: tuple[tuple[torch.Tensor, torch.Tensor], ...] | None = None,
) -> DeploymentIdentity:
    """``kv_scales``: an FP8 cache's, part of what its bytes mean (engines whose scales
    differ, calibrated or unit, must not read each other's pages)."""
    kv_dtype = str(host_pages.dtype).removeprefix("torch.")
    if kv_scales is not None:
        with allow_host_sync():
            flat = torch.cat([t.float().reshape(-1) for pair in kv_scales for t in pair]).cpu()
        kv_dtype += f" scales={_digest(flat.numpy().tobytes())}"
    return DeploymentIdentity(
        architecture=architecture,
        weights=weights_identity(args, dtype),
        dtype=kv_dtype,
        page_size=args.page_size,
        layout=f"page{list(host_pages.shape[1:])} tp{tp_rank}/{tp_size}",
    )


def build_l3(
    args: EngineArgs,
    identity: DeploymentIdentity,
    host_pages: torch.Tensor,
) -> L3Executor:
    if args.kvstore_storage_backend == "file":
        backend = FileBackend(args.kvstore_storage_dir)
        where = args.kvstore_storage_dir
    else:
        master = args.kvstore_mooncake_master
        host = master.rpartition(":")[0]
        settings = MooncakeSettings(
            master=master,
            metadata_server=args.kvstore_mooncake_metadata_server or f"http://{host}:8080/metadata",
            segment_bytes=int(args.kvstore_mooncake_segment_gb * 2**30),
            local_hostname=local_address(host),
        )
        backend = MooncakeBackend(settings)
        where = f"master {master}"
    delay = os.environ.get(STORAGE_DELAY_ENV)
    if delay:
        backend = SlowBackend(backend, float(delay))
    # One row of bytes per host page: the workers see numpy memory, never a tensor.
    pages = host_pages.view(torch.uint8).reshape(host_pages.shape[0], -1).numpy()
    logger.info(
        "L3 storage tier: %s (%s), namespace %s, %d-byte pages, timeout %g s",
        backend.name,
        where,
        identity.namespace,
        pages.shape[1],
        args.kvstore_storage_timeout,
    )
    return L3Executor(backend, pages, identity.namespace, timeout=args.kvstore_storage_timeout)


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:32]
