"""No JIT compilation while serving.

A Triton compilation on the forward thread stalls the round for 100 ms to seconds.
Startup compiles on purpose (graph capture, warm-up); ``install`` hooks Triton's
compiler before anything is built, and ``mark_serving`` (entering serving, on the
forward thread) closes the window: from then on each compilation on that thread is
logged with its kernel and duration, and counted (exported as
tokenspeed:jit_serving_compiles / _compile_seconds). ``TOKENSPEED_JIT_COMPILE_CHECK=error``
(read when a device build starts) raises at the compiling call instead. Shutting the
device side down (``end_serving``) reopens the window, so a process that embeds an
engine compiles freely again once it stopped.

A kernel parameter that keeps taking new values from one call site (a per-batch
value passed as tl.constexpr) shows as the same kernel compiling again and again;
the log names the kernel and its specialization so the culprit is found fast.

Libraries with their own JIT (FlashInfer builds and loads a CUDA module the first time a
kernel variant is planned) are watched the same way: ``watch_builds`` wraps the method
that builds, and a build on the serving thread counts as a serving compile.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger(__name__)

CHECK_ENV = "TOKENSPEED_JIT_COMPILE_CHECK"


class JitCompileError(RuntimeError):
    """A kernel compiled after the serving mark under TOKENSPEED_JIT_COMPILE_CHECK=error."""


@dataclass
class CompileStats:
    serving_compiles: int = 0
    serving_compile_seconds: float = 0.0


def check_mode() -> str:
    mode = os.environ.get(CHECK_ENV, "warn").lower()
    if mode not in ("warn", "error"):
        raise ValueError(f"{CHECK_ENV} must be 'warn' or 'error', got {mode!r}")
    return mode


class CompileMonitor:
    def __init__(self) -> None:
        self.mode = check_mode()
        self.stats = CompileStats()
        self._serving_thread: int | None = None  # the forward thread, once it serves
        self._started: dict[int, float] = {}  # thread id -> compile start
        self._seen: dict[str, int] = {}  # kernel name -> serving compiles

    @property
    def serving(self) -> bool:
        return self._serving_thread is not None

    def install(self) -> bool:
        """Hook Triton's JIT (no-op without Triton). True when installed.

        A CPU-only process never JIT-compiles (kernels there run under Triton's
        interpreter, if at all), so it is not made to import Triton for the hook: that
        import alone leaves nanobind's leak report on every interpreter exit."""
        if "triton" not in sys.modules and not _cuda_available():
            return False
        try:
            from triton import knobs
        except ImportError:
            return False
        knobs.runtime.jit_cache_hook = self._before_compile
        knobs.runtime.jit_post_compile_hook = self._after_compile
        return True

    def begin_startup(self) -> None:
        """A device build starts: its compilations are startup's."""
        self.mode = check_mode()
        self._serving_thread = None

    def mark_serving(self) -> None:
        """Called on the forward thread: its compilations from now on are serving's."""
        self._serving_thread = threading.get_ident()

    def end_serving(self) -> None:
        self._serving_thread = None

    def _before_compile(self, *args, **kwargs) -> bool:
        self._started[threading.get_ident()] = time.perf_counter()
        return False  # never skip the compilation

    def _after_compile(self, *args, **kwargs) -> bool:
        start = self._started.pop(threading.get_ident(), time.perf_counter())
        fn = kwargs.get("fn")
        name = getattr(getattr(fn, "jit_function", fn), "__name__", None) or kwargs.get("repr", "?")
        self.compiled(name, time.perf_counter() - start, kwargs.get("repr", name))
        return False

    def compiled(self, name: str, seconds: float, detail: str | None = None) -> None:
        """A compilation of ``name`` just finished on this thread: a serving compile when
        this is the serving thread (logged and counted, or raised under ``error``)."""
        if threading.get_ident() != self._serving_thread:
            return  # startup compiles on purpose; other threads are not the round's
        self.stats.serving_compiles += 1
        self.stats.serving_compile_seconds += seconds
        count = self._seen[name] = self._seen.get(name, 0) + 1
        message = (
            f"JIT compile while serving: {detail or name} took {seconds * 1e3:.0f} ms"
            f" ({count} serving compiles of {name}; a per-batch constexpr recompiles every "
            "new value)"
        )
        if self.mode == "error":
            raise JitCompileError(message)
        logger.warning(message)

    def watch_builds(self, cls: type, method: str, describe: Callable[[object], str]) -> None:
        """Report every call of ``cls.method`` (a library's JIT build) as a compilation of
        ``describe(instance)``; idempotent."""
        original = getattr(cls, method)
        if getattr(original, "_compile_monitored", False):
            return

        @functools.wraps(original)
        def build(instance, *args, **kwargs):
            start = time.perf_counter()
            result = original(instance, *args, **kwargs)
            self.compiled(describe(instance), time.perf_counter() - start)
            return result

        build._compile_monitored = True
        setattr(cls, method, build)


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


_monitor: CompileMonitor | None = None


def compile_monitor() -> CompileMonitor:
    """The process's monitor, installed on first use (before anything is compiled)."""
    global _monitor
    if _monitor is None:
        _monitor = CompileMonitor()
        _monitor.install()
    return _monitor
