"""Releasing the engine's device memory by tag between RL rollouts, and taking it back.

    weights    the model's parameters; their values survive (a host backup)
    kv_cache   the paged KV pool; its contents are discarded (the caller flushes the prefix
               cache), and it comes back zeroed (the null block must read as zeros)

On CUDA (``--enable-memory-saver``) both live in CUDA virtual memory (cuda_vmm.py): a
release unmaps their physical pages -- the device gets the memory back -- and a resume
maps fresh pages at the same addresses, so the CUDA graphs captured over them stay valid.
The weights are copied to one pinned host buffer before the unmap and back after the map.

On CPU the tensors are really freed: the parameters are written to a safetensors file in
the backup directory and replaced by empty tensors, the KV pool is dropped; a resume reads
the file back and allocates a zeroed pool. Nothing may run a forward in between (the
control plane freezes the rounds while any region is released).
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tokenspeed_aio.data_plane.cuda_vmm import VmmBuffer
from tokenspeed_aio.errors import RequestConflictError
from tokenspeed_aio.guards.host_sync import allow_host_sync
from tokenspeed_aio.model.kv_cache import allocate_kv_pool, kv_cache_views

logger = logging.getLogger(__name__)

ALIGN = 256  # bytes: every view starts aligned for any dtype and vectorized kernel

KvCaches = tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class MemorySaver:
    def __init__(self, device: torch.device, *, vmm: bool, backup_dir: str | None = None) -> None:
        if vmm and device.type != "cuda":
            raise ValueError("enable_memory_saver: CUDA virtual memory needs a CUDA device")
        self.device = device
        self.vmm = vmm
        self.backup_dir = backup_dir or tempfile.gettempdir()
        self._model: torch.nn.Module | None = None
        self._weights: VmmBuffer | None = None
        self._host_backup: torch.Tensor | None = None  # pinned, kept once allocated
        self._file: Path | None = None  # CPU: the released parameters
        self._kv: VmmBuffer | None = None
        self._kv_shape: tuple | None = None  # allocate_kv_cache's arguments
        self._pool: torch.Tensor | None = None  # the KV pool [2, L, blocks, page, H, D]
        self._runner = None
        self.released: set[str] = set()

    @property
    def supported(self) -> bool:
        return self.device.type == "cpu" or self.vmm

    # -- build time -----------------------------------------------------------------------
    def adopt_weights(self, model: torch.nn.Module) -> None:
        """Own the parameters: with CUDA virtual memory, move them into one buffer."""
        self._model = model
        if not self.vmm:
            return
        params = list(model.parameters())
        sizes = [_aligned(p.numel() * p.element_size()) for p in params]
        buf = VmmBuffer(sum(sizes), self.device.index or 0)
        offset = 0
        with torch.no_grad():
            for p, size in zip(params, sizes):
                n = p.numel() * p.element_size()
                view = buf.tensor[offset : offset + n].view(p.dtype).view(p.shape)
                view.copy_(p.data)
                p.data = view
                offset += size
        self._weights = buf
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()  # the parameters' first homes go back to the device
        logger.info("weights in CUDA virtual memory: %.2f GiB", buf.nbytes / 2**30)

    def allocate_kv_cache(
        self,
        num_layers: int,
        num_blocks: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
    ) -> KvCaches:
        """The KV pool as one tensor (``kv_pool``; the host tiers copy blocks across all
        of its layers at once) and its per-layer views, which the model reads."""
        self._kv_shape = (num_layers, num_blocks, page_size, num_kv_heads, head_dim, dtype)
        if not self.vmm:
            self._pool = allocate_kv_pool(*self._kv_shape, self.device)
            return kv_cache_views(self._pool)
        shape = (2, num_layers, num_blocks, page_size, num_kv_heads, head_dim)
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        buf = VmmBuffer(_aligned(nbytes), self.device.index or 0)
        buf.tensor.zero_()
        # Each layer's view starts at a multiple of its own size: 16-byte aligned for any
        # head_dim that is a multiple of 8 (Triton specializes on 16).
        self._pool = buf.tensor[:nbytes].view(dtype).view(shape)
        self._kv = buf
        return kv_cache_views(self._pool)

    def kv_pool(self) -> torch.Tensor | None:
        """The KV pool now (None while a CPU release dropped it)."""
        return self._pool

    def bind_runner(self, runner) -> None:
        """The runner whose KV pool a CPU release drops and a resume gives back."""
        self._runner = runner

    # -- serving ---------------------------------------------------------------------------
    def held_bytes(self) -> dict[str, int]:
        weights = sum(p.numel() * p.element_size() for p in self._model.parameters())
        kv = 0
        if self._kv_shape is not None:
            layers, blocks, page, heads, dim, dtype = self._kv_shape
            kv = 2 * layers * blocks * page * heads * dim * dtype.itemsize
        return {"weights": weights, "kv_cache": kv}

    def release(self, tags: list[str]) -> None:
        if not self.supported:
            raise RequestConflictError(
                "release_memory_occupation on CUDA needs the engine started with "
                "--enable-memory-saver (its weights and KV cache in CUDA virtual memory, so "
                "the CUDA graphs survive a release)"
            )
        with allow_host_sync():  # a deliberate wait, off the per-round path
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # nothing still reads what goes
            for tag in tags:
                if tag in self.released:
                    continue
                if tag == "weights":
                    self._release_weights()
                else:
                    self._release_kv()
                self.released.add(tag)
            if self.device.type == "cuda":
                torch.cuda.empty_cache()  # the allocator's idle cache goes back as well
        logger.info("released %s", ", ".join(tags))

    def resume(self, tags: list[str]) -> None:
        with allow_host_sync():
            for tag in tags:
                if tag not in self.released:
                    continue
                if tag == "weights":
                    self._resume_weights()
                else:
                    self._resume_kv()
                self.released.discard(tag)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        logger.info("resumed %s", ", ".join(tags))

    def _release_weights(self) -> None:
        if self._weights is not None:
            if self._host_backup is None:
                self._host_backup = torch.empty(
                    self._weights.nbytes, dtype=torch.uint8, pin_memory=True
                )
            self._host_backup.copy_(self._weights.tensor)
            self._weights.unmap()
            return
        params = dict(self._model.named_parameters())
        fd, name = tempfile.mkstemp(
            prefix="tokenspeed-weights-", suffix=".safetensors", dir=self.backup_dir
        )
        os.close(fd)
        self._file = Path(name)
        save_file({k: p.data.contiguous() for k, p in params.items()}, str(self._file))
        for p in params.values():
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)

    def _resume_weights(self) -> None:
        if self._weights is not None:
            self._weights.map()
            self._weights.tensor.copy_(self._host_backup)
            return
        saved = load_file(str(self._file), device=str(self.device))
        for name, p in self._model.named_parameters():
            p.data = saved[name]
        self._file.unlink(missing_ok=True)
        self._file = None

    def _release_kv(self) -> None:
        if self._kv is not None:
            self._kv.unmap()
        else:
            self._runner.k_caches = self._runner.v_caches = ()
            self._pool = None

    def _resume_kv(self) -> None:
        if self._kv is not None:
            self._kv.map()
            self._kv.tensor.zero_()
        else:
            self._pool = allocate_kv_pool(*self._kv_shape, self.device)
            self._runner.k_caches, self._runner.v_caches = kv_cache_views(self._pool)

    def close(self) -> None:
        if self._file is not None:
            self._file.unlink(missing_ok=True)
