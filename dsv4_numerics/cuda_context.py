"""A GPU process's two ends: its CUDA primary context made early, in a background thread, and
its interpreter's shutdown skipped at the end.

Why: creating a CUDA context costs the whole host about 0.25-0.35 s of driver time that the driver
serialises between processes (measured on a 4-GPU H100 host: 16 processes started together waited
3.6 s each on average, 32 waited 8.0 s, 64 waited 14.8-22.7 s). Under ``pytest -n 32`` every worker
paid that wait at its first GPU test. Started here, while the worker is still collecting (5-7 s
of CPU work), the wait overlaps the collection instead of adding to the tests.

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

How a process waits for its GPU (``DSV4_CUDA_SYNC``): CUDA's default (``auto``) makes a process with
one context on a host with more cores than contexts SPIN on a core while it waits for the GPU.
Sixteen or more test processes share each GPU, and a process waits behind the others' kernels, so
the spinning takes cores from the processes that have CPU work. ``blocking`` (the primary
context's ``CU_CTX_SCHED_BLOCKING_SYNC``: the waiting thread sleeps on an interrupt), ``yield`` and
``spin`` set the flag before the context is made (:func:`sync_flag`, :func:`set_sync_mode`); unset
or ``auto`` leaves CUDA's default. It changes where the host waits, never a result.

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
ENV_SYNC = "DSV4_CUDA_SYNC"
# CUctx_flags scheduling values (cuda.h): CU_CTX_SCHED_AUTO 0, SPIN 1, YIELD 2, BLOCKING_SYNC 4
SYNC_FLAGS = {"auto": None, "spin": 0x1, "yield": 0x2, "blocking": 0x4}
ENV_FAST_EXIT = "DSV4_FAST_EXIT"
_DRIVER_LIBS = ("libcuda.so.1", "libcuda.so")
_STARTED: list[threading.Thread] = []


def sync_flag() -> int | None:
    """The ``CU_CTX_SCHED_*`` flag that ``DSV4_CUDA_SYNC`` asks for, None for ``auto`` or unset.
    Another value raises ``ValueError`` naming the variable and its values."""
    v = os.environ.get(ENV_SYNC, "auto").strip().lower() or "auto"
    if v not in SYNC_FLAGS:
        raise ValueError(f"{ENV_SYNC}={v!r}: must be one of {', '.join(SYNC_FLAGS)}")
    return SYNC_FLAGS[v]


def _driver_device():
    """``(lib, CUdevice)`` of the first visible device after ``cuInit``, or ``(None, rc)``: the
    first non-zero CUresult, -1 when no driver library loads."""
    lib = None
    for name in _DRIVER_LIBS:
        try:
            lib = ctypes.CDLL(name)
            break
        except OSError:
            continue
    if lib is None:
        return None, -1
    rc = lib.cuInit(0)
    if rc:
        return None, rc
    dev = ctypes.c_int()
    rc = lib.cuDeviceGet(ctypes.byref(dev), 0)
    return (lib, dev) if rc == 0 else (None, rc)


def _retain_primary_context(flag: int | None = None) -> int:
    """Driver calls in order (the scheduling ``flag`` first, when given); returns the first
    non-zero CUresult, 0 when the context is made, or -1 when no driver library loads."""
    lib, dev = _driver_device()
    if lib is None:
        return dev
    if flag is not None:
        rc = lib.cuDevicePrimaryCtxSetFlags(dev, flag)
        if rc:
            return rc
    ctx = ctypes.c_void_p()
    return lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev)


def set_sync_mode() -> int | None:
    """Set ``DSV4_CUDA_SYNC``'s flag on the first visible device's primary context, before anything
    makes it (a kernel child calls this before torch initialises CUDA); returns the CUresult (0:
    set), -1 without a driver, None when there is nothing to set. Failures are swallowed: CUDA's
    default then applies."""
    try:
        flag = sync_flag()
        if flag is None or os.environ.get("CUDA_VISIBLE_DEVICES", "x").strip() in ("", "-1"):
            return None
        lib, dev = _driver_device()
        return dev if lib is None else lib.cuDevicePrimaryCtxSetFlags(dev, flag)
    except Exception:  # noqa: BLE001 - an optimisation, like the early context
        return None


def _run() -> None:
    try:
        _retain_primary_context(sync_flag())
    except Exception:  # noqa: BLE001 - an optimisation: CUDA's own init reports real problems later
        pass


def warm_primary_context() -> threading.Thread | None:
    """Start (once per process) a daemon thread that makes the CUDA primary context of the first
    visible device, with ``DSV4_CUDA_SYNC``'s scheduling flag; returns it, or None when turned off
    (``DSV4_WARM_CUDA=0``: then only the flag is set, at once), when no GPU is visible
    (``CUDA_VISIBLE_DEVICES`` empty), or when started already."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", "x").strip() in ("", "-1"):
        return None
    if os.environ.get(ENV_WARM) == "0":
        set_sync_mode()
        return None
    if _STARTED:
        return None
    t = threading.Thread(target=_run, name="dsv4-cuda-context", daemon=True)
    _STARTED.append(t)
    t.start()
    return t


# ----------------------------------------------------------------------------- the end


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


def skip_shutdown_at_exit() -> bool:
    """Register (once per process) an atexit handler that ends the process with status 0 through
    :func:`exit_now`. Handlers registered after this call still run (atexit runs them last in,
    first out); those registered before it, and the interpreter's shutdown, do not. For processes
    whose exit status nobody reads (an xdist worker: its results and errors travel over its
    channel). Returns whether it is registered (False when turned off or registered already)."""
    if not fast_exit_enabled() or _SKIPPING:
        return False
    _SKIPPING.append(True)
    atexit.register(exit_now, 0)
    return True
