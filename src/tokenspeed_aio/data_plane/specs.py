"""DeviceSpecs: the plain values the control plane plans with. Torch-free."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DeviceSpecs:
    num_blocks: int  # KV pool size, including the null block
    page_size: int
    max_num_seqs: int  # request-pool slots
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    device: str  # "cpu" | "cuda:N"
    dtype: str
    attention_backend: str
    kv_bytes_per_block: int
    # The rank's role (DeviceRole): "plain", or one side of prefill/decode disaggregation.
    # A value, not a class: only the transfer peer and a request's room depend on it.
    role: str = "plain"
    host_blocks: int = 0  # L2 host pool blocks (0: the host tier is off)
    snapshot_pages: int = 0  # snapshot pool pages (retraction victims' tail pages)
    snapshot_states: int = 0  # snapshot pool slot-state entries
    storage: bool = False  # the L3 storage tier is on (its executor is the handle's)

    @property
    def max_concurrent_tokens(self) -> int:
        return (self.num_blocks - 1) * self.page_size


@dataclass(frozen=True)
class RankInfo:
    """Where this rank sits: its tensor-parallel position and the torch.distributed
    rendezvous its forward thread joins (tp > 1 only)."""

    tp_rank: int = 0
    tp_size: int = 1
    dp_rank: int = 0
    dist_init_method: str | None = None  # e.g. tcp://127.0.0.1:PORT for the TP group
    local_device_index: int = 0
