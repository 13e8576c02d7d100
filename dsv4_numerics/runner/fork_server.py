"""A fork server for kernel children: one process per parent with torch imported, which forks a
ready child for each :class:`~dsv4_numerics.runner.pool.WorkerSession` start.

Why: a kernel child's start-up is mostly ``import torch`` (CPU-seconds), and a GPU suite run
starts dozens of them (the kernel broker's, the isolation tests', the CLI's), in a run that is
bound by its CPUs. A child
forked from a process that has imported torch -- and never initialised CUDA -- starts in a few
milliseconds and still gets a CUDA context, an environment and a process of its own, so crash
isolation is unchanged: a crash, a hang or a device fault takes down that child only.

Protocol (the server, ``python -m dsv4_numerics.runner.fork_server``): it imports torch, writes
``ready``, then reads one JSON request per line on stdin -- ``{"id", "env", "cwd", "err", "jobs"}``
-- and for each forks a child that starts its own session (``setsid``), reads its jobs from the
FIFO ``jobs`` (the parent opened it first), writes stdout and stderr to the file ``err``, takes
``env`` as its whole environment (``PYTHONPATH``'s entries put first on ``sys.path``: that was
read when the server started) and ``cwd``, and serves jobs (:func:`dsv4_numerics.runner.child.serve`, as ``--serve`` does).
The server answers ``{"id", "pid"}`` per request and ``{"exit": pid, "status": code}`` when a
child ends (``subprocess``'s convention: the exit status, or minus the signal). It is single
threaded (a fork copies only the forking thread); at the end of its stdin it waits for its
children (each ends when its jobs FIFO closes) and ends, so that whoever waits for the server
counts their CPU time (``.ci/gpu-scaling``'s process-tree CPU seconds). Its parent ends it
at exit (:func:`close_all`, registered when this module is imported: import it before anything
whose exit handler must run first, as :mod:`dsv4_numerics.runner.pool` does).

The parent side, :func:`spawn`: a Popen-like :class:`ForkedChild` (``pid``, ``stdin``, ``poll``,
``wait``) from this process's server, started on first use; None when the server is turned off
(``DSV4_KERNEL_FORK_SERVER=0``), not on Linux, or failed to start or died -- the caller then
starts a plain ``python -m dsv4_numerics.runner.child --serve``. A child whose environment
differs from the server's in a variable torch reads at import (anything but
:data:`APPLIED_AFTER_FORK`) is not forked either: the server is for the common case, many
children of one environment.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import json
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

ENV_SWITCH = "DSV4_KERNEL_FORK_SERVER"
READY_TIMEOUT_S = 120.0  # the server's own start-up (import torch) on a loaded host
# variables a forked child applies itself (or nothing reads before the child runs): any other
# difference from the server's environment means a plain start
# (not the thread counts: torch sizes its pools from them at import, so a server serves one setting)
APPLIED_AFTER_FORK = ("CUDA_VISIBLE_DEVICES", "PYTHONPATH", "DSV4_", "PYTEST_", "HYPOTHESIS", "COV_CORE_",
                      "TRITON_", "SGLANG_", "VLLM_", "PYTORCH_NVML_BASED_CUDA_CHECK", "PYTORCH_CUDA_ALLOC_CONF")


def enabled() -> bool:
    """Whether kernel children are forked (``DSV4_KERNEL_FORK_SERVER`` not ``0``; Linux only)."""
    return sys.platform.startswith("linux") and os.environ.get(ENV_SWITCH, "1").strip() != "0"


def _import_env(env: dict) -> dict:
    return {k: v for k, v in env.items() if not k.startswith(APPLIED_AFTER_FORK)}


# ----------------------------------------------------------------------------- the server


def _child(req: dict) -> int:
    """In the forked child: become the kernel child the request describes; returns its status."""
    os.setsid()
    fd = os.open(req["jobs"], os.O_RDONLY)
    os.dup2(fd, 0)
    os.close(fd)
    fd = os.open(req["err"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.chdir(req["cwd"])
    env = req["env"]
    os.environ.clear()
    os.environ.update(env)
    front = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
    sys.path[:0] = front
    sys.argv = [sys.argv[0], "--serve"]
    from dsv4_numerics.runner import child as worker_child

    return int(worker_child.worker_main(["--serve"]) or 0)


def serve_forks() -> int:
    """The server's loop (module docstring)."""
    import torch  # noqa: F401 - the point of the server: imported once, shared by every child

    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w)
    out = sys.stdout

    def say(obj: Any) -> None:
        out.write((obj if isinstance(obj, str) else json.dumps(obj)) + "\n")
        out.flush()

    def reap() -> None:
        while True:
            try:
                pid, st = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            say({"exit": pid, "status": os.waitstatus_to_exitcode(st)})

    sel = selectors.SelectSelector()  # any descriptor (epoll refuses a regular file as stdin)
    sel.register(0, selectors.EVENT_READ)
    sel.register(wake_r, selectors.EVENT_READ)
    say("ready")
    buf = b""
    while True:
        for key, _ in sel.select():
            if key.fd == wake_r:
                with contextlib.suppress(BlockingIOError):
                    os.read(wake_r, 4096)
                reap()
                continue
            data = os.read(0, 1 << 16)
            if not data:  # the parent is done with us: wait for the children (each ends at the end
                # of its jobs FIFO), so their CPU time is counted in ours for whoever waits for us
                signal.set_wakeup_fd(-1)
                while True:
                    try:
                        pid, st = os.waitpid(-1, 0)
                    except ChildProcessError:
                        return 0
                    with contextlib.suppress(OSError, ValueError):
                        say({"exit": pid, "status": os.waitstatus_to_exitcode(st)})
            buf += data
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                if not line.strip():
                    continue
                req = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    rc = 1
                    try:
                        sel.close()
                        signal.set_wakeup_fd(-1)
                        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                        os.close(wake_r)
                        os.close(wake_w)
                        rc = _child(req)
                    except SystemExit as e:
                        rc = e.code if isinstance(e.code, int) else 1
                    except BaseException:  # noqa: BLE001 - the child's stderr is its err file by now
                        traceback.print_exc()
                    finally:
                        for stream in (sys.stdout, sys.stderr):
                            with contextlib.suppress(Exception):
                                stream.flush()
                        os._exit(rc)
                say({"id": req["id"], "pid": pid})
            reap()


# ----------------------------------------------------------------------------- the parent's side


class ForkedChild:
    """A forked kernel child as ``subprocess.Popen`` sees one: ``pid``, ``stdin`` (the write end
    of its jobs FIFO), ``returncode``, :meth:`poll`, :meth:`wait`. Its status comes from the server
    that forked it."""

    def __init__(self, server: "_Server", pid: int, stdin):
        self._server = server
        self.pid = pid
        self.stdin = stdin
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server.status(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._server.cv:
            while self.poll() is None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise subprocess.TimeoutExpired(f"forked kernel child {self.pid}", timeout)
                self._server.cv.wait(0.2 if left is None else min(0.2, left))
        return self.returncode


class _Server:
    def __init__(self, env: dict, cwd: str, err_path: str):
        with open(err_path, "ab") as err:
            self.proc = subprocess.Popen([sys.executable, "-m", "dsv4_numerics.runner.fork_server"], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=err, env=env, cwd=cwd,
                                         start_new_session=True)
        self.cv = threading.Condition()
        self._pids: dict[int, int] = {}  # request id -> pid
        self._exits: dict[int, int] = {}  # pid -> status
        self._ids = itertools.count()
        self._send_lock = threading.Lock()
        self.ready = threading.Event()
        threading.Thread(target=self._read, daemon=True, name="dsv4-fork-server-reader").start()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def _read(self) -> None:
        for raw in self.proc.stdout:
            line = raw.decode("utf-8", "replace").strip()
            if line == "ready":
                self.ready.set()
                continue
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            with self.cv:
                if "exit" in msg:
                    self._exits[int(msg["exit"])] = int(msg["status"])
                elif "id" in msg:
                    self._pids[int(msg["id"])] = int(msg["pid"])
                self.cv.notify_all()
        with self.cv:  # the server is gone: nobody will report on its children now
            self.cv.notify_all()

    def status(self, pid: int) -> int | None:
        with self.cv:
            if pid in self._exits:
                return self._exits[pid]
        if self.alive():
            return None
        try:  # no server to report it: the process is gone (reparented and reaped) or not
            os.kill(pid, 0)
        except ProcessLookupError:
            return -signal.SIGKILL
        except PermissionError:
            pass
        return None

    def spawn(self, env: dict, cwd: str, err_path: str, jobs_path: str) -> ForkedChild | None:
        if not self.ready.wait(READY_TIMEOUT_S) or not self.alive():
            return None
        os.mkfifo(jobs_path)
        # read-write: the open does not wait for the child's end, and the child's read of its FIFO
        # ends (EOF) when this end closes
        stdin = os.fdopen(os.open(jobs_path, os.O_RDWR), "wb", buffering=0)
        rid = next(self._ids)
        req = {"id": rid, "env": env, "cwd": cwd, "err": err_path, "jobs": jobs_path}
        try:
            with self._send_lock:
                self.proc.stdin.write((json.dumps(req) + "\n").encode())
                self.proc.stdin.flush()
        except OSError:
            stdin.close()
            return None
        with self.cv:
            deadline = time.monotonic() + 60.0
            while rid not in self._pids and self.alive() and time.monotonic() < deadline:
                self.cv.wait(0.5)
            pid = self._pids.pop(rid, None)
        if pid is None:
            stdin.close()
            return None
        return ForkedChild(self, pid, stdin)

    def close(self, timeout_s: float = 10.0) -> None:
        with contextlib.suppress(OSError):
            self.proc.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=timeout_s)
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)


SERVERS: dict[tuple, _Server] = {}
_LOCK = threading.Lock()


def spawn(env: dict, cwd: str, err_path: str, jobs_path: str) -> ForkedChild | None:
    """A kernel child forked by this process's server for ``env`` (module docstring), its output to
    ``err_path``, its jobs through the FIFO made at ``jobs_path``; None when it cannot be forked
    (the caller starts one the plain way)."""
    if not enabled():
        return None
    key = tuple(sorted(_import_env(env).items())) + (cwd,)
    with _LOCK:
        srv = SERVERS.get(key)
        if srv is not None and not srv.alive():
            srv = None
        if srv is None:
            try:
                srv = SERVERS[key] = _Server(env, cwd, err_path + ".fork-server")
            except OSError:
                return None
    try:
        return srv.spawn(env, cwd, err_path, jobs_path)
    except OSError:
        return None


def close_all(timeout_s: float = 10.0) -> None:
    """End this process's servers: end of their input, then each waits for its children (which end
    at the end of their jobs) and exits; killed after ``timeout_s``."""
    with _LOCK:
        servers = list(SERVERS.values())
        SERVERS.clear()
    for srv in servers:
        with contextlib.suppress(OSError):
            srv.proc.stdin.close()
    for srv in servers:
        srv.close(timeout_s)


atexit.register(close_all)


if __name__ == "__main__":
    sys.exit(serve_forks())
