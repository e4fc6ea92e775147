"""Named tensors as bytes, for ``update_weights_from_tensor``.

Two formats:

* ``None`` (SGLang's): a pickle made by torch's multiprocessing reductions, so a CUDA
  tensor travels as a CUDA IPC handle (no copy through the host) and a CPU tensor as a
  shared-memory file (the sender uses the ``file_system`` sharing strategy). The sender
  keeps its tensors alive until the call returns.
* ``"safetensors"``: the bytes of a safetensors file (by value; any process can make it).

The pickle comes from the network, so it is read by an unpickler that resolves only the
few torch names those reductions use: anything else (a function, a module, a class of
some other library) is refused before it can run.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Iterable
from multiprocessing.reduction import ForkingPickler

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

NamedTensors = list[tuple[str, torch.Tensor]]

_TORCH_CLASSES = {"Tensor", "Size", "device"}
_STORAGE_CLASSES = {"UntypedStorage", "TypedStorage"}


class _TensorUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        allowed = (
            (module == "torch.multiprocessing.reductions" and name.startswith("rebuild_"))
            or (module == "torch.storage" and name in _STORAGE_CLASSES)
            or (module == "torch.nn.parameter" and name == "Parameter")
            or (
                module == "torch"
                and (name in _TORCH_CLASSES or isinstance(getattr(torch, name, None), torch.dtype))
            )
        )
        if not allowed:
            raise pickle.UnpicklingError(
                f"the payload names {module}.{name}: only torch tensors (their multiprocessing "
                "reductions) may travel in a weight update"
            )
        return super().find_class(module, name)


def serialize_named_tensors(
    tensors: Iterable[tuple[str, torch.Tensor]], fmt: str | None = None
) -> bytes:
    """The sender's half (a trainer): ``fmt`` None or "safetensors" (see the module)."""
    named = list(tensors)
    if fmt == "safetensors":
        return save_safetensors({name: t.detach().contiguous().cpu() for name, t in named})
    buffer = io.BytesIO()
    ForkingPickler(buffer).dump([(name, t.detach()) for name, t in named])
    return buffer.getvalue()


def deserialize_named_tensors(payload: bytes, fmt: str | None = None) -> NamedTensors:
    """The engine's half: (name, tensor) pairs, or ValueError naming what is wrong."""
    if fmt == "safetensors":
        try:
            return list(load_safetensors(payload).items())
        except Exception as err:
            raise ValueError(f"the payload is not a safetensors file: {err}") from None
    try:
        value = _TensorUnpickler(io.BytesIO(payload)).load()
    except pickle.UnpicklingError as err:
        raise ValueError(str(err)) from None
    except Exception as err:
        raise ValueError(f"the payload could not be read: {type(err).__name__}: {err}") from None
    items = list(value.items()) if isinstance(value, dict) else value
    if not isinstance(items, list) or not all(
        isinstance(item, tuple | list)
        and len(item) == 2
        and isinstance(item[0], str)
        and isinstance(item[1], torch.Tensor)
        for item in items
    ):
        raise ValueError("the payload must hold a list of (name, tensor) pairs or a dict")
    return [(name, tensor) for name, tensor in items]
