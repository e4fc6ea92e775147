"""No JIT compilation while serving.

A Triton compilation on the forward thread stalls the round for 100 ms to seconds.
Startup compiles on purpose (graph capture, warm-up); ``install`` hooks Triton's
compiler before anything is built, and ``mark_serving`` (entering serving) closes
the window: from then on each compilation is logged with its kernel and duration,
and counted (exported as tokenspeed:jit_serving_compiles / _compile_seconds).
``TOKENSPEED_JIT_COMPILE_CHECK=error`` raises at the compiling call instead.

A kernel parameter that keeps taking new values from one call site (a per-batch
value passed as tl.constexpr) shows as the same kernel compiling again and again;
the log names the kernel and its specialization so the culprit is found fast.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass

logger = logging.getLogger(__name__)

CHECK_ENV = "TOKENSPEED_JIT_COMPILE_CHECK"


class JitCompileError(RuntimeError):
    """A kernel compiled after the serving mark under TOKENSPEED_JIT_COMPILE_CHECK=error."""


@dataclass
class CompileStats:
    serving_compiles: int = 0
    serving_compile_seconds: float = 0.0


class CompileMonitor:
    def __init__(self, mode: str | None = None) -> None:
        mode = (mode or os.environ.get(CHECK_ENV, "warn")).lower()
        if mode not in ("warn", "error"):
            raise ValueError(f"{CHECK_ENV} must be 'warn' or 'error', got {mode!r}")
        self.mode = mode
        self.stats = CompileStats()
        self.serving = False
        self._started: dict[int, float] = {}  # thread id -> compile start
        self._seen: dict[str, int] = {}  # kernel name -> serving compiles

    def install(self) -> bool:
        """Hook Triton's JIT (no-op without Triton). True when installed."""
        try:
            from triton import knobs
        except ImportError:
            return False
        knobs.runtime.jit_cache_hook = self._before_compile
        knobs.runtime.jit_post_compile_hook = self._after_compile
        return True

    def begin_startup(self) -> None:
        """A device build starts: its compilations are startup's."""
        self.serving = False

    def mark_serving(self) -> None:
        self.serving = True

    def _before_compile(self, *args, **kwargs) -> bool:
        self._started[threading.get_ident()] = time.perf_counter()
        return False  # never skip the compilation

    def _after_compile(self, *args, **kwargs) -> bool:
        start = self._started.pop(threading.get_ident(), time.perf_counter())
        seconds = time.perf_counter() - start
        if not self.serving:
            return False  # startup compiles on purpose
        fn = kwargs.get("fn")
        name = getattr(getattr(fn, "jit_function", fn), "__name__", None) or kwargs.get("repr", "?")
        self.stats.serving_compiles += 1
        self.stats.serving_compile_seconds += seconds
        count = self._seen[name] = self._seen.get(name, 0) + 1
        message = (
            f"JIT compile while serving: {kwargs.get('repr', name)} took {seconds * 1e3:.0f} ms"
            f" ({count} serving compiles of {name}; a per-batch constexpr recompiles every "
            "new value)"
        )
        if self.mode == "error":
            raise JitCompileError(message)
        logger.warning(message)
        return False


_monitor: CompileMonitor | None = None


def compile_monitor() -> CompileMonitor:
    """The process's monitor, installed on first use (before anything is compiled)."""
    global _monitor
    if _monitor is None:
        _monitor = CompileMonitor()
        _monitor.install()
    return _monitor
