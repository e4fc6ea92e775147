"""The JIT compile monitor's window: startup compiles freely, the serving forward thread
is watched, other threads and a stopped engine are not. Drives the hooks Triton calls."""

import threading

import pytest

from tokenspeed_aio.guards.compile_monitor import CHECK_ENV, CompileMonitor, JitCompileError


def compile_on_this_thread(monitor: CompileMonitor, name: str = "_decode_kernel") -> None:
    fn = type("Fn", (), {"__name__": name})()
    monitor._before_compile(fn=fn)
    monitor._after_compile(fn=fn, repr=f"{name}[num_warps=4]")


def compile_on_another_thread(monitor: CompileMonitor) -> None:
    t = threading.Thread(target=compile_on_this_thread, args=(monitor,))
    t.start()
    t.join()


def test_only_the_serving_thread_counts_and_only_while_serving(monkeypatch):
    monkeypatch.setenv(CHECK_ENV, "warn")
    monitor = CompileMonitor()
    monitor.begin_startup()
    compile_on_this_thread(monitor)  # startup: on purpose
    assert monitor.stats.serving_compiles == 0
    monitor.mark_serving()
    compile_on_another_thread(monitor)  # not the forward thread
    assert monitor.stats.serving_compiles == 0
    compile_on_this_thread(monitor)
    compile_on_this_thread(monitor)
    assert monitor.stats.serving_compiles == 2
    monitor.end_serving()  # the engine stopped: the process compiles freely again
    compile_on_this_thread(monitor)
    assert monitor.stats.serving_compiles == 2 and not monitor.serving


def test_error_mode_is_read_when_a_build_starts(monkeypatch):
    monkeypatch.setenv(CHECK_ENV, "warn")
    monitor = CompileMonitor()
    monkeypatch.setenv(CHECK_ENV, "error")
    monitor.begin_startup()
    monitor.mark_serving()
    with pytest.raises(JitCompileError, match="_sample_kernel"):
        compile_on_this_thread(monitor, "_sample_kernel")
    monkeypatch.setenv(CHECK_ENV, "sometimes")
    with pytest.raises(ValueError, match=CHECK_ENV):
        monitor.begin_startup()


def test_a_library_jit_build_on_the_serving_thread_counts_as_a_compile(monkeypatch):
    # FlashInfer's JitSpec.build_and_load, stood in for by a class with the same shape.
    class Spec:
        built = 0

        def __init__(self, name):
            self.name = name

        def build_and_load(self):
            Spec.built += 1
            return f"module {self.name}"

    monkeypatch.setenv(CHECK_ENV, "warn")
    monitor = CompileMonitor()
    monitor.watch_builds(Spec, "build_and_load", lambda spec: f"flashinfer {spec.name}")
    monitor.watch_builds(Spec, "build_and_load", lambda spec: "wrapped twice")  # idempotent
    monitor.begin_startup()
    assert Spec("prefill").build_and_load() == "module prefill"  # startup: on purpose
    monitor.mark_serving()
    assert Spec("decode").build_and_load() == "module decode"
    assert monitor.stats.serving_compiles == 1 and Spec.built == 2
    assert monitor._seen == {"flashinfer decode": 1}
    monkeypatch.setenv(CHECK_ENV, "error")
    monitor.begin_startup()
    monitor.mark_serving()
    with pytest.raises(JitCompileError, match="flashinfer sampling"):
        Spec("sampling").build_and_load()
