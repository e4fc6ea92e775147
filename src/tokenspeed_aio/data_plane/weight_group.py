"""The torch.distributed group a trainer and the engine's ranks share for weight broadcasts.

It stands apart from the engine's own tensor-parallel group (a process has one default
group, and the trainer is no member of it): a TCPStore the trainer's rank 0 hosts at
``master_address:master_port``, under the group's name as key prefix, and a gloo (CPU) or
NCCL (GPU) process group built on it directly. The trainer joins with the same function
(``rank=0``); engine rank r joins as ``rank_offset + r``::

    # trainer process
    group = init_weights_update_group("127.0.0.1", 29600, 0, 1 + engine_ranks, "wug", "gloo")
    group.broadcast(tensor)          # once per updated tensor, in the update call's order
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class WeightGroup:
    group: dist.ProcessGroup
    store: dist.TCPStore  # must outlive the group (rank 0 serves it)
    backend: str
    rank: int
    world_size: int
    timeout_seconds: float

    def broadcast(self, tensor: torch.Tensor, root: int = 0) -> None:
        """Broadcast ``tensor`` in place from ``root`` (blocks until it arrived)."""
        options = dist.BroadcastOptions()
        options.rootRank = root
        self.group.broadcast([tensor], options).wait()


def init_weights_update_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    backend: str = "gloo",
    timeout_seconds: float = 600.0,
) -> WeightGroup:
    """Join (rank 0: host) the group; returns once every rank joined (or raises on timeout)."""
    timeout = datetime.timedelta(seconds=timeout_seconds)
    store = dist.TCPStore(
        master_address, master_port, world_size, is_master=rank == 0, timeout=timeout
    )
    prefixed = dist.PrefixStore(f"{group_name}/", store)
    if backend == "gloo":
        group = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    elif backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        group = dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
    else:
        raise ValueError(f"backend: {backend!r} is not gloo or nccl")
    # A first collective: a rank that joined a different group fails here, not mid-update.
    probe = torch.zeros(
        1, device=f"cuda:{torch.cuda.current_device()}" if backend == "nccl" else "cpu"
    )
    group.allreduce([probe]).wait()
    return WeightGroup(group, store, backend, rank, world_size, timeout_seconds)
