"""dsv4_numerics.runner.cuda_context: the early CUDA primary context of a pinned xdist worker.

On CPU: the driver calls it makes, in order, and that it stops at the first failure, with a fake
driver library; when it is off. On a GPU: in a fresh process, the primary context is active after
the thread ends, before torch initialises CUDA, and torch then runs on it."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import textwrap
import threading
import time
import types

import pytest

from dsv4_numerics.runner import cuda_context


class FakeDriver:
    def __init__(self, fail_at: str | None = None):
        self.calls: list[tuple] = []
        self.fail_at = fail_at

    def _call(self, name, *args):
        self.calls.append((name, *args))
        return 999 if name == self.fail_at else 0

    def cuInit(self, flags):  # noqa: N802 - the driver's names
        return self._call("cuInit", flags)

    def cuDeviceGet(self, dev, ordinal):  # noqa: N802
        return self._call("cuDeviceGet", ordinal)

    def cuDevicePrimaryCtxRetain(self, ctx, dev):  # noqa: N802
        return self._call("cuDevicePrimaryCtxRetain")



def _driver_library(monkeypatch, cdll) -> None:
    """``cuda_context`` loads the driver through ``cdll`` -- its own ``ctypes`` name replaced by a
    copy whose ``CDLL`` is ``cdll``, not the ``ctypes`` module every other library (NVML readers,
    torch's NVML check, another thread) shares."""
    shim = types.SimpleNamespace(**{k: getattr(ctypes, k) for k in dir(ctypes) if not k.startswith("__")})
    shim.CDLL = cdll
    monkeypatch.setattr(cuda_context, "ctypes", shim)

def test_retains_the_primary_context_of_the_first_visible_device(monkeypatch):
    fake = FakeDriver()
    _driver_library(monkeypatch, lambda name: fake)
    assert cuda_context.retain_primary_context() == 0
    assert fake.calls == [("cuInit", 0), ("cuDeviceGet", 0), ("cuDevicePrimaryCtxRetain",)]


@pytest.mark.parametrize("fail_at, made", [("cuInit", 1), ("cuDeviceGet", 2)])
def test_stops_at_the_first_failing_call_and_returns_its_code(monkeypatch, fail_at, made):
    fake = FakeDriver(fail_at)
    _driver_library(monkeypatch, lambda name: fake)
    assert cuda_context.retain_primary_context() == 999
    assert len(fake.calls) == made


def test_no_driver_library_is_minus_one_and_the_thread_swallows_errors(monkeypatch):
    def missing(name):
        raise OSError(f"{name}: cannot open shared object file")

    _driver_library(monkeypatch, missing)
    assert cuda_context.retain_primary_context() == -1

    def broken(name):
        raise RuntimeError("anything")

    _driver_library(monkeypatch, broken)
    cuda_context.retain_quietly()  # an optimisation never raises


@pytest.mark.parametrize("env", [{"DSV4_WARM_CUDA": "0", "CUDA_VISIBLE_DEVICES": "0"},
                                 {"CUDA_VISIBLE_DEVICES": ""}, {"CUDA_VISIBLE_DEVICES": "-1"}])
def test_off_or_no_visible_gpu_starts_nothing(monkeypatch, env):
    monkeypatch.delenv("DSV4_WARM_CUDA", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(cuda_context, "STARTED", [])
    assert cuda_context.warm_primary_context() is None


def test_starts_once_per_process(monkeypatch):
    monkeypatch.delenv("DSV4_WARM_CUDA", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.setattr(cuda_context, "STARTED", [])
    monkeypatch.setattr(cuda_context, "retain_quietly", lambda: None)
    t = cuda_context.warm_primary_context()
    assert t is not None and t.daemon
    t.join(5)
    assert cuda_context.warm_primary_context() is None


_ON_GPU = textwrap.dedent("""
    import ctypes, sys
    from dsv4_numerics.runner import cuda_context
    t = cuda_context.warm_primary_context()
    assert t is not None
    t.join(120)
    lib = ctypes.CDLL("libcuda.so.1")
    dev, flags, active = ctypes.c_int(), ctypes.c_uint(), ctypes.c_int()
    assert lib.cuDeviceGet(ctypes.byref(dev), 0) == 0
    assert lib.cuDevicePrimaryCtxGetState(dev, ctypes.byref(flags), ctypes.byref(active)) == 0
    import torch
    assert not torch.cuda.is_initialized()
    print("active", active.value)
    x = torch.arange(4.0, device="cuda")
    print("sum", float(x.sum()))
""")


@pytest.mark.gpu
def test_on_a_gpu_the_primary_context_is_active_before_torch_initialises_cuda():
    env = dict(os.environ)
    env.pop("DSV4_WARM_CUDA", None)
    env.setdefault("CUDA_VISIBLE_DEVICES", "0")
    out = subprocess.run([sys.executable, "-c", _ON_GPU], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "active 1" in out.stdout and "sum 6.0" in out.stdout, out.stdout


_RELEASE_ON_GPU = textwrap.dedent("""
    import ctypes
    import torch
    from dsv4_numerics.runner import cuda_context
    x = torch.arange(4.0, device="cuda") * 2
    lib = ctypes.CDLL("libcuda.so.1")
    dev, flags, active = ctypes.c_int(), ctypes.c_uint(), ctypes.c_int()
    def state():
        assert lib.cuDevicePrimaryCtxGetState(dev, ctypes.byref(flags), ctypes.byref(active)) == 0
        return active.value
    assert lib.cuDeviceGet(ctypes.byref(dev), 0) == 0
    print("before", state(), float(x.sum()))
    t = cuda_context.release_primary_context_soon()
    t.join(120)
    print("after", state(), "again", cuda_context.release_primary_context_soon())
    cuda_context.exit_now(0)
""")


@pytest.mark.gpu
def test_on_a_gpu_the_early_release_destroys_the_primary_context():
    env = {k: v for k, v in os.environ.items() if k not in ("DSV4_EARLY_CUDA_RELEASE", "DSV4_FAST_EXIT")}
    env.setdefault("CUDA_VISIBLE_DEVICES", "0")
    out = subprocess.run([sys.executable, "-c", _RELEASE_ON_GPU], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "before 1 12.0" in out.stdout and "after 0 again None" in out.stdout, out.stdout


def test_early_release_needs_a_context_fast_exit_and_the_switch(monkeypatch):
    """Off the GPU there is no context to release; the switch and fast exit turn it off too."""
    calls = []
    monkeypatch.setattr(cuda_context, "reset_primary_context", lambda: calls.append(1) or 0)
    monkeypatch.setattr(cuda_context, "RELEASED", [])
    monkeypatch.setattr(cuda_context, "STARTED", [])
    monkeypatch.delenv("DSV4_FAST_EXIT", raising=False)
    monkeypatch.delenv("DSV4_EARLY_CUDA_RELEASE", raising=False)
    import torch

    if not torch.cuda.is_initialized():
        assert cuda_context.release_primary_context_soon() is None  # no context in this process
    done = threading.Thread(target=lambda: None)
    done.start()
    monkeypatch.setattr(cuda_context, "STARTED", [done])  # an early context was made
    for var, value in (("DSV4_EARLY_CUDA_RELEASE", "0"), ("DSV4_FAST_EXIT", "0")):
        monkeypatch.setenv(var, value)
        assert cuda_context.release_primary_context_soon() is None
        monkeypatch.delenv(var)
    t = cuda_context.release_primary_context_soon()
    assert t is not None and t.daemon
    t.join(10)
    assert calls == [1] and cuda_context.release_primary_context_soon() is None  # once per process


# ----------------------------------------------------------------------------- the end

_AT_EXIT = textwrap.dedent("""
    import atexit, sys
    atexit.register(lambda: print("registered-before"))
    from dsv4_numerics.runner import cuda_context as c
    print("first", c.skip_shutdown_at_exit(), "again", c.skip_shutdown_at_exit())
    atexit.register(lambda: print("registered-after"))
    sys.stdout.write("buffered-no-newline")
    sys.exit(5)
""")


def _run_python(code: str, **env) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if k != "DSV4_FAST_EXIT"}
    e.update(env)
    return subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True, timeout=120)


def test_skip_shutdown_runs_later_handlers_skips_earlier_ones_and_flushes():
    out = _run_python(_AT_EXIT)
    assert out.returncode == 0, out.stderr  # an xdist worker's status is read by nobody
    assert "first True again False" in out.stdout
    assert "registered-after" in out.stdout and "buffered-no-newline" in out.stdout
    assert "registered-before" not in out.stdout


_NON_DAEMON = textwrap.dedent("""
    import atexit, threading, time
    from dsv4_numerics.runner import cuda_context as c
    c.skip_shutdown_at_exit()
    atexit.register(lambda: print("registered-after", flush=True))
    threading.Thread(target=time.sleep, args=(60,)).start()  # non-daemon: shutdown would wait 60 s
    print("main-done", flush=True)
""")


def test_skip_shutdown_does_not_wait_for_non_daemon_threads():
    t0 = time.monotonic()
    out = _run_python(_NON_DAEMON)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["main-done", "registered-after"]
    assert time.monotonic() - t0 < 30, "the process waited for its non-daemon thread"


def test_fast_exit_off_keeps_the_ordinary_shutdown():
    out = _run_python(_AT_EXIT, DSV4_FAST_EXIT="0")
    assert out.returncode == 5
    assert "first False again False" in out.stdout
    assert "registered-before" in out.stdout and "registered-after" in out.stdout


def test_exit_now_keeps_the_status_and_flushes():
    out = _run_python("import sys\nfrom dsv4_numerics.runner.cuda_context import exit_now\n"
               "sys.stdout.write('out'); sys.stderr.write('err')\nexit_now(3)\nprint('never')")
    assert (out.returncode, out.stdout, out.stderr) == (3, "out", "err")
