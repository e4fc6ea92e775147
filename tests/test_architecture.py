"""Structural rules of the design, checked mechanically."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tokenspeed_aio.data_plane.device_handle import DeviceHandle

ROOT = Path(__file__).resolve().parents[1]
KERNELS = "tokenspeed_kernels"

# The package's layers, bottom to top: a module may import its own layer and the ones
# below it, never one above. The package root (its lazy public exports) is the top.
LAYERS: list[set[str]] = [
    # values every layer shares, the wire, and the frontend's text and protocol shapes
    {
        "sampling_params",
        "errors",
        "args",
        "engine_flags",
        "gc_policy",
        "model_source",
        "generation_config",
        "wire",
        "tokenization",
        "protocol",
    },
    {"grammar"},
    {"scheduler", "collective"},
    {"control"},
    {"guards"},  # the no-host-sync and no-JIT checks the model and the worker share
    {"model", KERNELS},
    {"cache", "pd"},  # the host KV tiers and storage backends; the PD transfer peer
    {"data_plane"},
    {"engine"},
    {"api"},
    {"server", "client"},
    {"bench", "cli", "__main__"},
    {""},  # tokenspeed_aio/__init__.py
]

TORCH_FREE = [
    "tokenspeed_aio.control",
    "tokenspeed_aio.scheduler",
    "tokenspeed_aio.collective",
    "tokenspeed_aio.wire",
    "tokenspeed_aio.tokenization",
    "tokenspeed_aio.protocol",
    "tokenspeed_aio.api",
    "tokenspeed_aio.api.engine",
    "tokenspeed_aio.server",
    "tokenspeed_aio.client",
]


def _modules(src: Path, package: str) -> dict[str, Path]:
    found = {}
    for path in sorted((src / package).rglob("*.py")):
        name = ".".join(path.relative_to(src).with_suffix("").parts)
        found[name.removesuffix(".__init__")] = path
    return found


def _imports(path: Path, known: dict[str, Path]) -> set[str]:
    """The package modules ``path`` imports, wherever the import stands (a lazy or
    TYPE_CHECKING import is a dependency too). ``from pkg import sub`` names ``pkg.sub``."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            subs = [f"{node.module}.{a.name}" for a in node.names]
            found.update(s for s in subs if s in known)
            if not all(s in known for s in subs):
                found.add(node.module)
    return {name for name in found if name in known}


def _layer(module: str) -> int:
    if module.split(".")[0] == KERNELS:
        key = KERNELS
    else:
        key = module.split(".")[1] if "." in module else ""
    for i, layer in enumerate(LAYERS):
        if key in layer:
            return i
    raise AssertionError(f"{module}: its package {key!r} is in no layer of LAYERS")


def layering_violations(src: Path, kernels: Path) -> list[str]:
    """Every import that runs up the layers (or from the kernels into the engine) and
    every import cycle, as readable lines; empty when the layering holds."""
    known = {**_modules(src, "tokenspeed_aio"), **_modules(kernels, KERNELS)}
    graph = {name: _imports(path, known) - {name} for name, path in known.items()}
    problems = []
    for name, deps in sorted(graph.items()):
        for dep in sorted(deps):
            if name.startswith(KERNELS) and dep.startswith("tokenspeed_aio"):
                problems.append(f"{name} imports {dep}: the kernels never import the engine")
            elif _layer(dep) > _layer(name):
                problems.append(f"{name} imports {dep}, a layer above it")
    problems += [f"import cycle: {' -> '.join(cycle)}" for cycle in _cycles(graph)]
    return problems


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected component of two or more modules."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                component.append(w)
            if component:
                cycles.append([v, *reversed(component), v])

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_imports_run_down_the_layers():
    problems = layering_violations(ROOT / "src", ROOT / "kernels")
    assert not problems, "\n".join(problems)


def test_the_layering_check_catches_an_upward_import_and_a_cycle(tmp_path):
    """The check itself fails where it should: a scheduler module importing the API, a
    kernel importing the engine, and two wire modules importing each other."""
    pkg = tmp_path / "src" / "tokenspeed_aio"
    kernels = tmp_path / "kernels" / KERNELS
    for d in (pkg / "scheduler", pkg / "api", pkg / "wire", kernels):
        d.mkdir(parents=True)
        (d / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "api" / "engine.py").write_text("")
    (pkg / "scheduler" / "plan.py").write_text(
        "def f():\n    from tokenspeed_aio.api.engine import AsyncEngine\n"
    )
    (pkg / "wire" / "a.py").write_text("import tokenspeed_aio.wire.b\n")
    (pkg / "wire" / "b.py").write_text("from tokenspeed_aio.wire import a\n")
    (kernels / "k.py").write_text("from tokenspeed_aio.wire import a\n")
    problems = layering_violations(tmp_path / "src", tmp_path / "kernels")
    assert problems == [
        "tokenspeed_aio.scheduler.plan imports tokenspeed_aio.api.engine, a layer above it",
        "tokenspeed_kernels.k imports tokenspeed_aio.wire.a: the kernels never import the engine",
        "import cycle: tokenspeed_aio.wire.a -> tokenspeed_aio.wire.b -> tokenspeed_aio.wire.a",
    ]


@pytest.mark.parametrize("package", TORCH_FREE)
def test_package_imports_with_torch_blocked(package):
    """control/ and scheduler/ (and the frontend side) never import torch."""
    code = (
        "import sys, pkgutil, importlib\n"
        "sys.modules['torch'] = None\n"
        f"pkg = importlib.import_module({package!r})\n"
        "for m in pkgutil.walk_packages(getattr(pkg, '__path__', []), pkg.__name__ + '.'):\n"
        "    importlib.import_module(m.name)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]


@pytest.mark.parametrize(
    "module",
    ["helpers.sim_device", "helpers.sim_data_plane", "helpers.sim_engine", "helpers.fake_group"],
)
def test_round_test_helpers_import_with_torch_blocked(module):
    """The round is tested without torch: its fake data plane and harness must not need it."""
    code = f"import sys; sys.modules['torch'] = None; import {module}"
    tests = str(ROOT / "tests")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([tests, str(ROOT / "src")])}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr[-2000:]


def test_device_handle_exposes_only_named_operations():
    """The handle is the complete list of what the control plane may ask of the
    device; widening it is a design change, so this list changes with it."""
    public = sorted(n for n in vars(DeviceHandle) if not n.startswith("_"))
    assert public == [
        "commit_weights",
        "destroy_weights_group",
        "enter_serving",
        "execute",
        "forward_timeline",
        "idle_forward",
        "init_weights_group",
        "load_staged_weights",
        "poll_cache_results",
        "release_memory",
        "resume_memory",
        "shutdown",
        "stage_weights",
        "start_profile",
        "stop_profile",
    ]
