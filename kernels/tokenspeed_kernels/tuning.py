"""Kernel tuning tables: tile configs measured on one kind of GPU, shipped as JSON files and
looked up by the device's name at run time (as vLLM ships its fused-MoE configs)::

    configs/<table>/device_name=<name>.json      e.g. configs/gemv/device_name=NVIDIA_H200.json

``<name>`` is ``torch.cuda.get_device_name`` with spaces as underscores. ``TABLES`` names
every table with its key and config fields; in the file a key is its fields joined by commas
(flags as ``true``/``false``) and a config the list of its fields::

    {
      "table": "gemv",
      "key": ["N", "K"],
      "config": ["BLOCK_N", "BLOCK_K", "num_warps", "num_stages"],
      "configs": {
        "4096,4096": [8, 1024, 8, 3],
        ...
      }
    }

The kernel modules read their tables through ``table`` (``gemv.configs``,
``gemv.norm_configs``, ``gemv_rope_kv.rope_kv_configs``, ``skinny_gemm.configs``). A shape
missing from a table -- and every shape of a GPU without a file, of the CPU and of the Triton
interpreter, whose name is ``cpu`` -- gets what a shape never measured gets: the engine's
products run cuBLAS, a kernel called without a config its built-in ``DEFAULT`` tiles.

``TOKENSPEED_KERNEL_DEVICE_NAME`` replaces the detected name (``NVIDIA_H200``: the H200's
tables on another GPU or on the CPU; a name without files: no tables), and
``table(..., device_name=...)`` names the device of one lookup. A device's name, override
included, is resolved at its first lookup and every file is parsed once: the engine looks
tables up on every decode step. ``clear_cache`` forgets both.

Re-tuning: on the GPU, each bench's ``--write-config`` writes the current device's file of
the table it measures, changing only the keys it measured (a winner over the baseline is
written, a shape the baseline won is removed; ``write`` formats the file, sorted by key):

- ``kernels/bench_gemv.py``: ``gemv``; with ``--silu-mul`` ``gemv_silu_mul``, ``--norm``
  ``gemv_norm``, ``--rope-kv`` ``gemv_rope_kv``;
- ``kernels/bench_skinny_gemm.py``: ``skinny_gemm``; with ``--silu-mul``
  ``skinny_gemm_silu_mul``;
- ``kernels/bench_decode_chain.py``: the 64-row keys of ``skinny_gemm`` (and of
  ``skinny_gemm_silu_mul`` for gate_up), picked in a decoder layer's chain with PDL on; run it
  after ``bench_skinny_gemm.py``, whose picks of a product alone it overrules;
- ``kernels/bench_fp8_gemm.py``: ``fp8_gemv`` and ``fp8_gemm`` (Triton tiles against
  ``torch._scaled_mm`` per shape and row bucket).
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import torch

DEVICE_NAME_ENV = "TOKENSPEED_KERNEL_DEVICE_NAME"
CPU = "cpu"  # the name of the CPU (and the interpreter): no tables
CONFIG_DIR = Path(__file__).parent / "configs"
FLAGS = frozenset(
    {"silu_mul", "two_pass", "block", "scaled_mm"}
)  # the bool fields; every other is a positive int


@dataclass(frozen=True)
class Fields:
    """What a table's keys and configs hold, field by field (a kernel unpacks them so)."""

    key: tuple[str, ...]
    config: tuple[str, ...]


_GEMV = ("BLOCK_N", "BLOCK_K", "num_warps", "num_stages")
_SKINNY = ("BLOCK_N", "BLOCK_K", "SPLIT_K", "num_warps", "num_stages")
TABLES: dict[str, Fields] = {
    "gemv": Fields(("N", "K"), _GEMV),
    "gemv_silu_mul": Fields(("N", "K"), _GEMV),
    "gemv_norm": Fields(("N", "K", "silu_mul"), (*_GEMV, "two_pass")),
    "gemv_rope_kv": Fields(
        ("N", "K"), ("BLOCK_HALF", "BLOCK_K", "num_warps", "num_stages", "two_pass")
    ),
    "skinny_gemm": Fields(("N", "K", "m_bucket"), _SKINNY),
    "skinny_gemm_silu_mul": Fields(("N", "K", "m_bucket"), _SKINNY),
    # FP8 (e4m3) weights: the batch-1 product (also with the norm prologue and the RoPE/KV
    # epilogue, BLOCK_HALF = BLOCK_N / 2), and every larger batch, Triton or torch._scaled_mm.
    "fp8_gemv": Fields(("N", "K", "block", "silu_mul"), _GEMV),
    "fp8_gemm": Fields(("N", "K", "block", "m_bucket"), ("scaled_mm", "BLOCK_M", *_SKINNY)),
    # gate/up with the SwiGLU as its epilogue (BLOCK_N: one half's features), per-row scales
    "fp8_gemm_silu_mul": Fields(
        ("N", "K", "m_bucket"), ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages")
    ),
}

Key = tuple[int | bool, ...]
Config = tuple[int | bool, ...]
# Devices that name one GPU (or the CPU) -> their names, and (table, device) -> its table.
_names: dict[object, str] = {}
_tables: dict[tuple[str, object], Mapping[Key, Config]] = {}


def device_name_of(device: torch.device | str | int | None = None) -> str:
    """The name ``device``'s tables go by: ``TOKENSPEED_KERNEL_DEVICE_NAME`` where set, else
    its GPU's name with underscores, ``cpu`` for a CPU device or without CUDA. None (or
    ``"cuda"``) is the current CUDA device; a device with an index is resolved once."""
    name = _names.get(device)
    if name is not None:
        return name
    name = os.environ.get(DEVICE_NAME_ENV) or _detected_name(device)
    if _names_one_device(device):
        _names[device] = name
    return name


def _as_device(device: torch.device | str | int | None) -> torch.device:
    if isinstance(device, int):
        return torch.device("cuda", device)
    return torch.device("cuda" if device is None else device)


def _detected_name(device) -> str:
    device = _as_device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return CPU
    return torch.cuda.get_device_name(device).replace(" ", "_")


def _names_one_device(device) -> bool:
    """Whether ``device`` means the same device every call (not "the current one")."""
    if device is None:
        return False
    device = _as_device(device)
    return device.type != "cuda" or device.index is not None


def path(kernel: str, device_name: str, directory: Path | None = None) -> Path:
    """The file of ``kernel``'s table for the device named ``device_name``."""
    _fields(kernel)
    return (directory or CONFIG_DIR) / kernel / f"device_name={device_name}.json"


def table(
    kernel: str, device: torch.device | str | int | None = None, device_name: str | None = None
) -> Mapping[Key, Config]:
    """``kernel``'s table (a key of ``TABLES``) for ``device`` (``device_name_of``), or for
    the device named ``device_name``: key tuple -> config tuple, read-only; empty where that
    device has no file."""
    if device_name is not None:
        return _load(kernel, device_name)
    found = _tables.get((kernel, device))  # the products' path: one lookup per call
    if found is None:
        found = _load(kernel, device_name_of(device))
        if _names_one_device(device):
            _tables[kernel, device] = found
    return found


@functools.cache
def _load(kernel: str, device_name: str) -> Mapping[Key, Config]:
    file = path(kernel, device_name)
    return MappingProxyType(read(kernel, file) if file.exists() else {})


def clear_cache() -> None:
    """Forget the resolved device names and the parsed tables (after setting
    ``TOKENSPEED_KERNEL_DEVICE_NAME`` or writing a file)."""
    _names.clear()
    _tables.clear()
    _load.cache_clear()


def read(kernel: str, file: Path) -> dict[Key, Config]:
    """``kernel``'s table in ``file``, checked against its ``TABLES`` fields."""
    return parse(kernel, file.read_text(), str(file))


def parse(kernel: str, text: str, source: str = "<string>") -> dict[Key, Config]:
    """The table in a file's ``text``; ValueError naming ``source`` where it is malformed."""
    fields = _fields(kernel)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{source}: not JSON ({e})") from None
    header = {"table": kernel, "key": list(fields.key), "config": list(fields.config)}
    for name, want in header.items():
        if data.get(name) != want:
            raise ValueError(f"{source}: {name!r} is {data.get(name)!r}, expected {want!r}")
    configs = {}
    for text_key, config in data["configs"].items():
        parts = text_key.split(",")
        key_fields = _zip(fields.key, parts, source)
        key = tuple(_key_field(name, part, source) for name, part in key_fields)
        if not isinstance(config, list):
            raise ValueError(f"{source}: {text_key}: the config is not a list")
        values = _zip(fields.config, config, source)
        configs[key] = tuple(_value(name, value, source, text_key) for name, value in values)
    return configs


def dumps(kernel: str, configs: Mapping[Key, Config]) -> str:
    """The file of ``kernel``'s ``configs``: sorted by key, a config a line."""
    fields = _fields(kernel)
    for key, config in configs.items():
        _check(kernel, key, config)
    entries = [
        f"    {json.dumps(_key_text(key))}: {json.dumps(list(configs[key]))}"
        for key in sorted(configs)
    ]
    body = "{\n" + ",\n".join(entries) + "\n  }" if entries else "{}"
    return (
        "{\n"
        f'  "table": {json.dumps(kernel)},\n'
        f'  "key": {json.dumps(list(fields.key))},\n'
        f'  "config": {json.dumps(list(fields.config))},\n'
        f'  "configs": {body}\n'
        "}\n"
    )


def write(
    kernel: str,
    configs: Mapping[Key, Config],
    device_name: str | None = None,
    directory: Path | None = None,
) -> Path:
    """Write ``configs`` as ``kernel``'s table of the device named ``device_name`` (default:
    the current device's, ``device_name_of``); returns the file."""
    device_name = device_name or device_name_of()
    if device_name == CPU:
        raise ValueError("tables are measured on a GPU: name one with device_name=")
    text = dumps(kernel, configs)
    assert parse(kernel, text) == dict(configs), "the file would not read back as written"
    file = path(kernel, device_name, directory)
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_text(text)
    clear_cache()
    return file


def update(
    kernel: str,
    picks: Mapping[Key, Config | None],
    device_name: str | None = None,
    directory: Path | None = None,
) -> Path:
    """Merge a bench's ``picks`` into the device's file of ``kernel``'s table: a config is
    written at its key, None removes the key (the baseline won there); other keys stay."""
    device_name = device_name or device_name_of()
    file = path(kernel, device_name, directory)
    configs = read(kernel, file) if file.exists() else {}
    for key, config in picks.items():
        if config is None:
            configs.pop(tuple(key), None)
        else:
            configs[tuple(key)] = tuple(config)
    return write(kernel, configs, device_name, directory)


def _fields(kernel: str) -> Fields:
    if kernel not in TABLES:
        raise KeyError(f"no tuning table {kernel!r}; the tables are {sorted(TABLES)}")
    return TABLES[kernel]


def _zip(names: tuple[str, ...], values: list, source: str) -> zip:
    if len(names) != len(values):
        raise ValueError(f"{source}: {values!r} has {len(values)} fields, expected {names}")
    return zip(names, values)


def _key_field(name: str, part: str, source: str) -> int | bool:
    if name in FLAGS:
        if part not in ("true", "false"):
            raise ValueError(f"{source}: key field {name} is {part!r}, expected true or false")
        return part == "true"
    if not part.isdigit() or int(part) <= 0:
        raise ValueError(f"{source}: key field {name} is {part!r}, expected a positive int")
    return int(part)


def _value(name: str, value: object, source: str, key: str) -> int | bool:
    flag = name in FLAGS
    ok = isinstance(value, bool) if flag else type(value) is int and value > 0
    if not ok:
        want = "a bool" if flag else "a positive int"
        raise ValueError(f"{source}: {key}: {name} is {value!r}, expected {want}")
    return value


def _key_text(key: Key) -> str:
    return ",".join(("true" if p else "false") if isinstance(p, bool) else str(p) for p in key)


def _check(kernel: str, key: Key, config: Config) -> None:
    """ValueError unless ``key`` and ``config`` have ``kernel``'s fields' arity and types."""
    fields = _fields(kernel)
    text = _key_text(tuple(key))
    for name, part in _zip(fields.key, list(key), kernel):
        _value(name, part, kernel, text)
    for name, value in _zip(fields.config, list(config), kernel):
        _value(name, value, kernel, text)
