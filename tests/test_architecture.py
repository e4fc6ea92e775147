"""Structural rules of the design, checked mechanically."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tokenspeed_aio.data_plane.device import DeviceHandle

TORCH_FREE = [
    "tokenspeed_aio.control",
    "tokenspeed_aio.scheduler",
    "tokenspeed_aio.collective",
    "tokenspeed_aio.wire",
    "tokenspeed_aio.api",
    "tokenspeed_aio.api.engine",
    "tokenspeed_aio.server",
    "tokenspeed_aio.client",
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


def test_device_handle_exposes_only_named_operations():
    """The handle is the complete list of what the control plane may ask of the
    device; widening it is a design change, so this list changes with it."""
    public = sorted(n for n in vars(DeviceHandle) if not n.startswith("_"))
    assert public == ["enter_serving", "execute", "forward_timeline", "idle_forward", "shutdown"]
