"""A GPU process's two ends: its CUDA primary context made early, in a background thread, and
its interpreter's shutdown skipped at the end.

Why: the driver serialises CUDA context creation between processes, so workers that start
together wait for each other, each at its first GPU test. Started here, while the worker is still
collecting its tests (CPU work), the wait overlaps the collection instead of adding to the tests.

How: through the driver API (``cuInit``, ``cuDeviceGet``, ``cuDevicePrimaryCtxRetain``) by
``ctypes``, which releases the GIL for each foreign call, so the collecting thread keeps running.
The primary context is the one the CUDA runtime (and so torch and Triton) uses, so torch's own
lazy initialisation later finds it made. The context is retained for the life of the process (its
reference is never released): the process was going to make it anyway.

At the end, :func:`skip_shutdown_at_exit` / :func:`exit_now`: a process that has done its work
(an xdist worker whose results are sent, a kernel child at the end of its jobs) ends with
``os._exit`` after flushing stdout and stderr, instead of the interpreter's shutdown (module
teardown, the atexit handlers registered before it, the CUDA runtime's teardown of the context):
the xdist controller and the kernel broker wait for those processes to exit. The driver releases
what the process held when it exits, as it does for any process. ``DSV4_FAST_EXIT=0`` turns it off.

The early context is an optimisation only: every failure (no driver, no device, a ROCm host) is swallowed, and
CUDA's own initialisation reports any real problem later, where it always did. ``DSV4_WARM_CUDA=0``
turns it off. Call it only after ``CUDA_VISIBLE_DEVICES`` is final (the GPU pinning of xdist
workers): the context is made on the first visible device.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import sys
import threading
from typing import NoReturn

ENV_WARM = "DSV4_WARM_CUDA"
ENV_FAST_EXIT = "DSV4_FAST_EXIT"
ENV_EARLY_RELEASE = "DSV4_EARLY_CUDA_RELEASE"
_DRIVER_LIBS = ("libcuda.so.1", "libcuda.so")
STARTED: list[threading.Thread] = []


def _driver():
    """The CUDA driver library (``ctypes.CDLL``), or None when none loads."""
    for name in _DRIVER_LIBS:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


def retain_primary_context() -> int:
    """Driver calls in order; returns the first non-zero CUresult, 0 when the context is made, or
    -1 when no driver library loads."""
    lib = _driver()
    if lib is None:
        return -1
    rc = lib.cuInit(0)
    if rc:
        return rc
    dev = ctypes.c_int()
    rc = lib.cuDeviceGet(ctypes.byref(dev), 0)
    if rc:
        return rc
    ctx = ctypes.c_void_p()
    return lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev)


def retain_quietly() -> None:
    try:
        retain_primary_context()
    except Exception:  # noqa: BLE001 - an optimisation: CUDA's own init reports real problems later
        pass


def warm_primary_context() -> threading.Thread | None:
    """Start (once per process) a daemon thread that makes the CUDA primary context of the first
    visible device; returns it, or None when turned off (``DSV4_WARM_CUDA=0``), when no GPU is
    visible (``CUDA_VISIBLE_DEVICES`` empty), or when started already."""
    if os.environ.get(ENV_WARM) == "0" or os.environ.get("CUDA_VISIBLE_DEVICES", "x").strip() in ("", "-1"):
        return None
    if STARTED:
        return None
    t = threading.Thread(target=retain_quietly, name="dsv4-cuda-context", daemon=True)
    STARTED.append(t)
    t.start()
    return t


# ----------------------------------------------------------------------------- the end


def reset_primary_context() -> int:
    """``cuDevicePrimaryCtxReset`` of the first visible device: its allocations and state are
    destroyed now (whoever retains it). Returns the CUresult, or -1 without a driver library."""
    lib = _driver()
    if lib is None:
        return -1
    reset = getattr(lib, "cuDevicePrimaryCtxReset_v2", None) or getattr(lib, "cuDevicePrimaryCtxReset", None)
    if reset is None:
        return -1
    dev = ctypes.c_int()
    rc = lib.cuDeviceGet(ctypes.byref(dev), 0)
    return rc or reset(dev)


RELEASED: list[threading.Thread] = []


def release_primary_context_soon() -> threading.Thread | None:
    """For a process that will make no more CUDA calls and then end through :func:`exit_now` (an
    xdist worker after its last test; nothing in it may touch CUDA afterwards): destroy its
    primary context now, in a daemon thread, instead of at its exit. The driver releases contexts
    one process at a time host-wide: workers ending together queue at the run's end, while
    released as each worker finishes its last test the releases overlap the other workers' last
    tests. Returns the thread, or None when turned off
    (``DSV4_EARLY_CUDA_RELEASE=0``, or fast exit off: an ordinary shutdown still tears CUDA
    down itself), when no CUDA context exists in this process, or when started already.
    Failures are swallowed: the exit releases what is left."""
    if os.environ.get(ENV_EARLY_RELEASE, "1").strip() == "0" or not fast_exit_enabled() or RELEASED:
        return None
    torch = sys.modules.get("torch")
    if not STARTED and (torch is None or not torch.cuda.is_initialized()):
        return None
    if torch is not None and torch.cuda.is_initialized():
        with contextlib.suppress(Exception):
            torch.cuda.synchronize()  # the last test's work is done before its context goes

    def run() -> None:
        with contextlib.suppress(Exception):
            for t in STARTED:  # the early context is made (or failed) before it is destroyed
                t.join()
            reset_primary_context()

    t = threading.Thread(target=run, name="dsv4-cuda-release", daemon=True)
    RELEASED.append(t)
    t.start()
    return t


def fast_exit_enabled() -> bool:
    """Whether processes end with :func:`exit_now` (``DSV4_FAST_EXIT`` is not ``0``)."""
    return os.environ.get(ENV_FAST_EXIT, "1").strip() != "0"


def exit_now(code: int) -> NoReturn:
    """Flush stdout and stderr, then end this process with status ``code`` at once
    (``os._exit``: no atexit handlers, no module teardown, no CUDA runtime teardown). Only for a
    process whose results are all written: buffered files other than stdout/stderr are lost."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


_SKIPPING: list[bool] = []


def _exit_handlers_now() -> None:
    """The ``atexit`` handlers, run now (last in, first out), from the start of the interpreter's
    shutdown: the first to run that was registered by :func:`skip_shutdown_at_exit` ends the
    process, so those registered before it never run."""
    run = getattr(atexit, "_run_exitfuncs", None)
    if run is None:
        exit_now(0)
    run()


def skip_shutdown_at_exit() -> bool:
    """Register (once per process) an atexit handler that ends the process with status 0 through
    :func:`exit_now`, and have the atexit handlers run as soon as the main thread is done -- at the
    start of the interpreter's shutdown, before it waits for non-daemon threads (CPython's
    ``threading`` exit hooks; where they are missing, at the usual point). Handlers registered
    after this call still run (atexit runs them last in, first out); those registered before it,
    the wait for non-daemon threads and the interpreter's shutdown do not. For processes whose
    exit status nobody reads (an xdist worker: its results and errors travel over its channel, and
    its gateway ends its main thread when the controller tells it to exit). Returns whether it is
    registered (False when turned off or registered already)."""
    if not fast_exit_enabled() or _SKIPPING:
        return False
    _SKIPPING.append(True)
    atexit.register(exit_now, 0)
    thread_end = getattr(threading, "_register_atexit", None)  # CPython >= 3.9
    if thread_end is not None:
        with contextlib.suppress(RuntimeError):  # "can't register atexit after shutdown"
            thread_end(_exit_handlers_now)
    return True
