"""Copying checkpoint tensors into parameters, with shape errors a user can act on."""

from __future__ import annotations

import torch


def check_shape(loaded: torch.Tensor, expected: tuple[int, ...] | torch.Size) -> None:
    """Raise if a checkpoint tensor does not have the full (unsharded) shape the layer expects."""
    if tuple(loaded.shape) != tuple(expected):
        raise ValueError(f"has shape {tuple(loaded.shape)} but the model expects {tuple(expected)}")


def default_weight_loader(
    param: torch.Tensor, loaded: torch.Tensor, shard_id: str | int | None = None
) -> None:
    """Loader for replicated parameters (norms): the checkpoint tensor is the whole param."""
    check_shape(loaded, param.shape)
    param.data.copy_(loaded)
