"""Crash isolation for real kernels, the parent side: sessions of long-lived kernel children
and a pool of them.

A production kernel can take its process down (illegal memory access, device-side assert,
``abort`` in a C++ check, a hang). Such a crash must fail *that case* and nothing else. So the
kernel matrix never calls a kernel in the pytest process; it calls :func:`run_isolated`, which
hands the job to a child (``python -m dsv4_numerics.runner.child --serve``, held by a
:class:`WorkerSession`; the job protocol is :mod:`dsv4_numerics.runner.child`'s) and watches it:

1. the child inherits the environment it is given (an xdist worker's or a pool session's
   ``CUDA_VISIBLE_DEVICES`` pin holds: the child's ``cuda:0`` is the pinned GPU);
2. it runs the job's cases one at a time and appends one JSON line per event to the job's LOG,
   flushed before and after each case (``cases``, ``start`` with the child's ``pid``, ``result``,
   then ``done``);
3. when the child dies or stops making progress, the parent kills its process group, records the
   case that was running as an ``error`` result carrying the signal / exit code and the tail of
   what the child wrote to stderr *since this job was handed to it*, and starts a fresh child at
   the next case (a CUDA context after an illegal address is unusable, so a fresh process is the
   only honest continuation);
4. after ``max_restarts`` crashes the remaining cases are recorded as ``error`` ("not run").

A device fault the child catches after a case (``poisoned``) ends that child too; the cases after
it run in a fresh one.

What isolation means with a long-lived child: a crash, a hang or a device fault fails its case
and nothing else (the rest of that entry and the next entries run in a fresh child). But state
that a kernel which did *not* crash leaves behind -- module globals, monkeypatches, JIT and
autotune caches, CUDA allocator state, a silently corrupted buffer that the next synchronize does
not catch -- is shared with the later entries of that child. A result that depends on which
entry ran before is a bug to report; ``DSV4_KERNEL_REUSE=0`` (or ``run_isolated`` without a
``session``) gives every entry a child of its own again, at the old start-up cost.

Three things make many entries cheap (``dsv4-numerics check``, the ``kernel_results`` fixture):

* cases built once (:func:`dsv4_numerics.runner.case_files.stage_cases_file`): the parent builds a
  stage's default cases (or loads them from an on-disk cache) and hands every child
  ``--cases FILE``; a child never rebuilds them;
* long-lived children (:class:`WorkerSession`): a child's start-up (imports, CUDA context,
  staged packages: seconds) is paid once per session, not once per entry, and a
  child is forked from a server that imported torch once (:mod:`dsv4_numerics.runner.fork_server`;
  ``DSV4_KERNEL_FORK_SERVER=0``: started as its own ``python``);
* several sessions at once (:class:`IsolatedPool`): ``jobs`` sessions (default
  :func:`default_jobs`), each pinned for its life to one GPU with ``CUDA_VISIBLE_DEVICES``
  (round-robin over the visible GPUs) and given ``max(1, cpus // jobs)`` CPU threads
  (``OMP_NUM_THREADS``, unless already set); a free session takes the next entry.

Environment: ``DSV4_KERNEL_CASE_TIMEOUT``, ``DSV4_KERNEL_STARTUP_TIMEOUT``,
``DSV4_KERNEL_MAX_RESTARTS`` (defaults 180 s, 300 s, 8), ``DSV4_KERNEL_REUSE`` (default 1; 0: a
session ends its child after every entry); ``DSV4_CASES_CACHE`` (:mod:`dsv4_numerics.runner.case_files`).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from dsv4_numerics.runner import fork_server  # noqa: F401 - first: its exit handler (end the servers) runs after ours (end the sessions)
from dsv4_numerics.runner.case_files import stage_cases_file
from dsv4_numerics.runner.host_cpus import usable_cpus
from dsv4_numerics.runner.host_gpus import visible_gpu_ids
from dsv4_numerics.runner.child import CHILD_DEVICE_ENV, EXIT_POISONED, STDERR_TAIL

DEFAULT_CASE_TIMEOUT_S = float(os.environ.get("DSV4_KERNEL_CASE_TIMEOUT", "180"))
DEFAULT_MAX_RESTARTS = int(os.environ.get("DSV4_KERNEL_MAX_RESTARTS", "8"))
# Before its first case a child imports torch, initialises the device and builds the cases; on a
# loaded machine (many xdist workers) that alone can take a minute, so it gets its own allowance.
DEFAULT_STARTUP_TIMEOUT_S = float(os.environ.get("DSV4_KERNEL_STARTUP_TIMEOUT", "300"))


def _reuse_default() -> bool:
    return os.environ.get("DSV4_KERNEL_REUSE", "1").strip().lower() not in ("0", "off", "no", "false")
_REPO_ROOT = Path(__file__).resolve().parents[2]  # dsv4_numerics/runner/pool.py -> the checkout (or site-packages)


UNAVAILABLE = "<unavailable>"  # run_isolated's result key when a probing job found the entry unavailable


# ----------------------------------------------------------------------------- one session

def _signal_name(rc: int) -> str:
    if rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exit code {rc}"


def _read_events(path: Path) -> list[dict]:
    events = []
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return events
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut by a crash
            continue
    return events


def _error(case: str, rule: str, message: str) -> dict:
    return {"case": case, "verdict": "error", "rule": rule, "message": message}


class SessionClosed(RuntimeError):
    """A job was given to a :class:`WorkerSession` after :meth:`WorkerSession.close`."""


_LIVE_SESSIONS: "weakref.WeakSet[WorkerSession]" = weakref.WeakSet()


# Variables a parent's environment changes under a long-lived child without meaning anything to
# it: pytest rewrites PYTEST_CURRENT_TEST before every test phase, so a session comparing whole
# environments (``use_env``) would end and restart its child (imports, CUDA context) for every
# matrix item. Children never see them.
VOLATILE_ENV = ("PYTEST_CURRENT_TEST",)


def child_environment(env: dict | None) -> dict:
    """The environment a child gets: ``env`` (None: this process's) without
    :data:`VOLATILE_ENV`, with the repository root first on ``PYTHONPATH`` (so
    ``tests.kernels...`` fake entries import in the child) and ``PYTHONUNBUFFERED=1`` unless set."""
    child_env = {k: v for k, v in (os.environ if env is None else env).items() if k not in VOLATILE_ENV}
    child_env["PYTHONPATH"] = os.pathsep.join(
        [str(_REPO_ROOT)] + [p for p in child_env.get("PYTHONPATH", "").split(os.pathsep) if p])
    child_env.setdefault("PYTHONUNBUFFERED", "1")
    return child_env


class WorkerSession:
    """A reusable child (``python -m dsv4_numerics.runner.child --serve``) that runs jobs one
    after the other; give it to :func:`run_isolated` (``session=``) so many entries share one
    child's start-up (imports, device context, JIT caches).

    The child is started lazily by the first job, and again by the next job after it died (a
    crash, a timeout kill, a device fault). ``env`` (None: this process's environment now) is
    the children's environment; :meth:`use_env` with a different one ends the
    current child, so every job runs with the environment it asked for. ``starts`` counts the
    children started, ``pid`` is the live child's (None when there is none). Its stdout and
    stderr go to ``<workdir>/<prefix>.<n>.stderr`` for the ``n``-th child. ``reuse=False``
    (default: ``DSV4_KERNEL_REUSE``, 1) ends the child after every job (:meth:`recycle`).

    :meth:`close`: end of stdin (the child exits when idle), SIGKILL of its process group after
    ``grace_s``; a closed session refuses new jobs (:class:`SessionClosed`). Sessions still open
    at interpreter exit are closed then. Not thread-safe for concurrent jobs: one job at a time
    (:meth:`close` may be called from another thread)."""

    def __init__(self, env: dict | None = None, workdir: str | None = None, prefix: str = "child",
                 reuse: bool | None = None):
        self._env = child_environment(env)
        self.reuse = _reuse_default() if reuse is None else bool(reuse)
        self._dir = Path(workdir or tempfile.mkdtemp(prefix="dsv4-session-"))
        self._dir.mkdir(parents=True, exist_ok=True)
        self._prefix = prefix
        self._proc: Any = None  # subprocess.Popen, or fork_server.ForkedChild
        self._err_path: Path | None = None
        self._lock = threading.RLock()
        self._closed = False
        self.starts = 0
        _LIVE_SESSIONS.add(self)

    # -- state
    @property
    def env(self) -> dict:
        """The environment of the live child and of the next one."""
        return dict(self._env)

    @property
    def pid(self) -> int | None:
        p = self._proc
        return p.pid if p is not None and p.poll() is None else None

    @property
    def closed(self) -> bool:
        return self._closed

    def use_env(self, env: dict | None) -> None:
        """Jobs from now on run with ``env`` (None: this process's environment now): a live child
        with another environment is ended first (gracefully: it is idle between jobs)."""
        want = child_environment(env)
        with self._lock:
            if want != self._env:
                self._end_child(grace_s=5.0)
                self._env = want

    # -- jobs
    def send(self, job: dict) -> tuple[subprocess.Popen, Path, int]:
        """Hand ``job`` (:func:`dsv4_numerics.runner.child.run_job`'s arguments) to the live child, starting one if there is
        none; returns the child, its output file and that file's size before the job (the job's
        output is what follows). Raises :class:`SessionClosed` after :meth:`close`."""
        line = (json.dumps(job) + "\n").encode()
        with self._lock:
            for attempt in (0, 1):
                if self._closed:
                    raise SessionClosed("the kernel worker session is closed")
                if self._proc is not None and self._proc.poll() is not None:
                    self._end_child(grace_s=0)  # died between jobs: reap it, start a fresh one
                if self._proc is None:
                    self._spawn()
                offset = self._err_path.stat().st_size
                try:
                    self._proc.stdin.write(line)
                    self._proc.stdin.flush()
                    return self._proc, self._err_path, offset
                except OSError:  # it died just now (broken pipe): once more with a fresh child
                    if attempt:
                        raise
                    self._end_child(grace_s=0)
        raise AssertionError("unreachable")

    def warm(self) -> None:
        """Start the child now (if none is live), so its start-up overlaps the caller's work; the
        child warms up (:func:`dsv4_numerics.runner.child._warm_up`) before it reads its first job."""
        with self._lock:
            if self._closed:
                raise SessionClosed("the kernel worker session is closed")
            if self._proc is None or self._proc.poll() is not None:
                if self._proc is not None:
                    self._end_child(grace_s=0)
                self._spawn()

    def recycle(self, grace_s: float = 5.0) -> None:
        """End the idle child (end of stdin, then SIGKILL after ``grace_s``); the next job starts
        a fresh one."""
        with self._lock:
            self._end_child(grace_s=grace_s)

    def hang_up(self) -> None:
        """Close the live child's stdin (it exits once idle) without waiting; :meth:`close` then
        waits for it. Lets a caller end many sessions' children in parallel."""
        with self._lock:
            p = self._proc
            if p is not None:
                with contextlib.suppress(OSError):
                    p.stdin.close()

    def kill(self) -> int | None:
        """SIGKILL the child's process group (a hung or crashed job); returns its exit status."""
        with self._lock:
            return self._end_child(grace_s=0)

    def close(self, grace_s: float = 5.0) -> None:
        """No more jobs; the child gets end-of-stdin and ``grace_s`` seconds to exit, then its
        process group is killed. Idempotent."""
        with self._lock:
            self._closed = True
            self._end_child(grace_s=grace_s)
        _LIVE_SESSIONS.discard(self)

    def __enter__(self) -> "WorkerSession":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close(grace_s=0 if exc[0] is not None else 5.0)

    # -- internals
    def _spawn(self) -> None:
        self.starts += 1
        self._err_path = self._dir / f"{self._prefix}.{self.starts}.stderr"
        self._err_path.write_bytes(b"")
        # forked from this process's fork server (torch imported once: dsv4_numerics/runner/fork_server.py),
        # else started the plain way
        self._proc = fork_server.spawn(self.env, str(_REPO_ROOT), str(self._err_path),
                                       str(self._dir / f"{self._prefix}.{self.starts}.jobs"))
        if self._proc is not None:
            return
        with open(self._err_path, "wb") as err:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "dsv4_numerics.runner.child", "--serve"],
                stdin=subprocess.PIPE, stdout=err, stderr=subprocess.STDOUT, env=self.env,
                cwd=str(_REPO_ROOT), start_new_session=True)

    def _end_child(self, grace_s: float) -> int | None:
        p, self._proc = self._proc, None
        if p is None:
            return None
        with contextlib.suppress(OSError):
            p.stdin.close()
        if grace_s > 0 and p.poll() is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=grace_s)
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)  # its own session: kernel helpers die with it
        return p.wait()


@atexit.register
def _close_live_sessions() -> None:
    for sess in list(_LIVE_SESSIONS):
        with contextlib.suppress(Exception):
            sess.close(grace_s=1.0)


_TERMINAL = ("done", "setup_error", "poisoned", "unavailable")


def run_isolated(
    entry: str,
    case_names: list[str] | None = None,
    *,
    device: str = "cuda:0",
    cases_file: str | None = None,
    mode: str = "judge",
    judge: str | None = None,
    case_timeout_s: float | None = None,
    max_restarts: int | None = None,
    workdir: str | None = None,
    env: dict | None = None,
    session: WorkerSession | None = None,
    probe: bool = False,
    judge_options: dict | None = None,
) -> dict[str, dict]:
    """Run ``entry``'s cases in child processes; ``{case name: result dict}``.

    ``case_names``: the cases to run, in order (the child runs only these of the case list; None:
    all of them); a case the child never reported gets an ``error`` result. ``case_timeout_s`` bounds one case (default
    ``DSV4_KERNEL_CASE_TIMEOUT`` or 180 s); a case over it is killed and reported as timed out.
    A child's start-up (imports, device, case building) is bounded separately by
    ``DSV4_KERNEL_STARTUP_TIMEOUT`` (default 300 s).
    In ``raw`` mode the result dicts carry ``outputs_file`` (``case_files.load_outputs`` reads it).
    ``judge_options``: keyword arguments (JSON values) the child's ``judge`` gets besides
    ``cases`` and ``device``.

    ``session``: run in that :class:`WorkerSession`'s live child (started if none; restarted
    first if ``env`` is given and differs from the session's); after a crash, a timeout or a
    device fault the rest of the cases run in a fresh child of the session, which later jobs
    then reuse. None: a session of this call only, closed before returning.

    ``probe``: the child first runs the entry's availability probe; if it fails, the result is
    ``{UNAVAILABLE: {"verdict": "unavailable", "message": reason}}`` and no case runs."""
    timeout = DEFAULT_CASE_TIMEOUT_S if case_timeout_s is None else float(case_timeout_s)
    startup = DEFAULT_STARTUP_TIMEOUT_S
    restarts_left = DEFAULT_MAX_RESTARTS if max_restarts is None else int(max_restarts)
    tmp = Path(workdir or tempfile.mkdtemp(prefix="dsv4-kernel-"))
    tmp.mkdir(parents=True, exist_ok=True)
    safe = "".join(ch if ch.isalnum() or ch in "._-" else "_" for ch in entry)
    log_path = tmp / f"{safe}.jsonl"
    log_path.write_text("", encoding="utf-8")
    own = session is None
    if own and str(device) == "cpu":  # a child of this call only, for CPU work: no device context to warm
        env = dict(os.environ if env is None else env, **{CHILD_DEVICE_ENV: "cpu"})
    sess = WorkerSession(env, workdir=str(tmp), prefix=safe) if own else session
    if not own and env is not None:
        sess.use_env(env)
    try:
        return _run_job_in(sess, entry, case_names, log_path, device=device, cases_file=cases_file,
                           mode=mode, judge=judge, timeout=timeout, startup=startup,
                           restarts_left=restarts_left, probe=probe, judge_options=judge_options)
    finally:
        if own:
            sess.close()
        elif not sess.reuse:
            sess.recycle()


def _run_job_in(sess: WorkerSession, entry: str, case_names: list[str] | None, log_path: Path, *,
                device: str, cases_file: str | None, mode: str, judge: str | None, timeout: float,
                startup: float, restarts_left: int, probe: bool = False,
                judge_options: dict | None = None) -> dict[str, dict]:
    """:func:`run_isolated`'s loop: one job per (re)start of the session's child."""
    results: dict[str, dict] = {}
    names: list[str] | None = list(case_names) if case_names is not None else None
    start = 0
    while True:
        job = {"entry": entry, "out": str(log_path), "device": device, "start": start, "mode": mode}
        if cases_file:
            job["cases"] = cases_file
        if names is not None:  # only these cases of the file, in this order ("start" indexes them)
            job["names"] = names
        if judge:
            job["judge"] = judge
        if judge_options:
            job["judge_options"] = judge_options
        if probe and start == 0:
            job["probe"] = True
        n0 = len(_read_events(log_path))
        # the log's size BEFORE the job is sent: a warm child can answer a quick job (an
        # unavailable entry's probe) before this thread looks again, and a size taken after the
        # send already counted that answer -- the job then looked silent until its time limit
        size_seen = log_path.stat().st_size
        proc, err_path, err_offset = sess.send(job)
        n_seen = n0
        last_progress = time.monotonic()
        in_case = False  # the per-case limit runs from a "start" event to its "result"
        timed_out = False
        rc: int | None = None
        while True:
            size = log_path.stat().st_size
            if size != size_seen:
                size_seen = size
                events = _read_events(log_path)
                if len(events) != n_seen:
                    n_seen = len(events)
                    last_progress = time.monotonic()
                    in_case = events[-1].get("event") == "start"
                    ends = [ev["event"] for ev in events[n0:] if ev.get("event") in _TERMINAL]
                    if ends:
                        if ends[-1] == "poisoned":  # the child exits 3 now; it must not go on
                            with contextlib.suppress(subprocess.TimeoutExpired):
                                proc.wait(timeout=10.0)
                            if proc.poll() is None:
                                sess.kill()
                            rc = proc.wait()
                        break
            rc = proc.poll()
            if rc is not None:  # died (or the session was closed): its last events are read below
                sess.kill()  # the session lets go of it
                break
            limit = timeout if in_case else max(timeout, startup)
            if time.monotonic() - last_progress > limit:
                timed_out = True
                sess.kill()
                rc = proc.wait()
                break
            time.sleep(0.05)
        events = _read_events(log_path)
        stderr_tail = _tail(err_path, err_offset)

        running: dict | None = None
        finished = poisoned = False
        for ev in events:
            kind = ev.get("event")
            if kind == "cases" and names is None:
                names = list(ev["names"])
            elif kind == "unavailable":
                return {UNAVAILABLE: {"verdict": "unavailable", "message": str(ev.get("reason", ""))}}
            elif kind == "setup_error":
                msg = f"worker setup failed: {ev.get('message')}"
                for n in names or []:
                    results.setdefault(n, _error(n, "setup_error", msg))
                return results
            elif kind == "start":
                running = ev
            elif kind == "result":
                for r in ev.get("results", []):
                    if isinstance(r, dict):
                        r.setdefault("case", ev["case"])
                        r.setdefault("seconds", ev.get("seconds"))
                        results[ev["case"]] = r
                running = None
            elif kind == "done":
                finished = True
        poisoned = any(ev.get("event") == "poisoned" for ev in events[n0:])
        if finished:
            break
        if running is not None and running["case"] not in results:
            why = (f"timed out after {timeout:g} s without progress" if timed_out
                   else f"worker crashed ({_signal_name(rc if rc is not None else 0)})")
            results[running["case"]] = _error(
                running["case"], "timeout" if timed_out else "crash",
                f"{why} while running this case; stderr tail:\n{stderr_tail}")
            start = running["index"] + 1
        elif poisoned or rc == EXIT_POISONED:  # after a recorded case: continue after it
            start = max((ev["index"] for ev in events if ev.get("event") == "result"), default=-1) + 1
        else:
            # died outside any case (import error, OOM at startup, ...): everything left fails
            why = (f"worker start-up timed out after {max(timeout, startup):g} s" if timed_out
                   else f"worker ended ({_signal_name(rc if rc is not None else 0)}) outside any case")
            msg = f"{why}; stderr tail:\n{stderr_tail}"
            for n in names or []:
                results.setdefault(n, _error(n, "crash", msg))
            break
        if names is not None and start >= len(names):
            break
        restarts_left -= 1
        if restarts_left < 0:
            for n in names or []:
                results.setdefault(n, _error(n, "not_run", "not run: the worker crashed too often"))
            break
    for n in names or []:
        results.setdefault(n, _error(n, "missing", "the worker reported no result for this case"))
    return results


def _tail(path: Path, offset: int) -> str:
    """The last :data:`STDERR_TAIL` bytes a child wrote to ``path`` after ``offset``."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(offset, size - STDERR_TAIL))
            data = f.read()
    except OSError:
        return ""
    return data.decode("utf-8", "replace").strip()


# ----------------------------------------------------------------------------- many children at once

def default_jobs(num_gpus: int, num_entries: int, cpus: int | None = None) -> int:
    """Children run at once by default: 8 per GPU (8 with none: a child spends most of its life
    in imports, device start-up and the CPU-side reference, not on the GPU), at most one per
    entry and one per two CPUs (``cpus``, default ``host_cpus.usable_cpus()``): a child's start-up
    is CPU work, so more children than half the CPUs only queue for them."""
    cpus = usable_cpus() if cpus is None else cpus
    return max(1, min(8 * max(1, num_gpus), num_entries, max(1, cpus // 2)))


class IsolatedPool:
    """Run :func:`run_isolated` for several entries at once, in ``jobs`` long-lived children
    (:class:`WorkerSession`); results in submission order.

    ``device``: ``"cuda"`` spreads the sessions over :func:`~dsv4_numerics.runner.host_gpus.visible_gpu_ids` (``torch_fallback=True``) (session ``i`` is pinned
    for its life to GPU ``i mod n`` with ``CUDA_VISIBLE_DEVICES``, so its child sees it as
    ``cuda:0``); an explicit device (``"cuda:1"``, ``"cpu"``) runs every child on it with the
    inherited visibility, unless ``gpus`` (ids) is given: then the sessions are spread over those
    ids whatever the device (tests use it on CPU). ``jobs``: sessions (children at once; None:
    :func:`default_jobs` over the entries submitted when the pool starts; submit all first).
    Each child gets ``OMP_NUM_THREADS`` = ``max(1, cpus // jobs)`` unless its env sets it.

    The pool starts at :meth:`start` or the first :meth:`result`; a free session takes the next
    submitted entry, preferring one whose environment is its child's (so a child is restarted
    only when the environment must change: external entries pass ``DSV4_ENTRIES_FROM`` in
    ``env``), then one its children ran before (or one of the same family), and leaving a job
    to another free session whose children ran its entry (:meth:`_pick`): an entry's imports,
    probe and first launches are then paid in fewer children. A crash restarts only that session's child. Use as a context manager or call
    :meth:`close` (waits for the submitted entries, then ends the children; ``cancel=True``, or
    leaving the ``with`` block by an exception: drops the entries not started and kills the
    children now).

    ``submit(key, entry, stage=..., **run_isolated_kwargs)``: a ``device`` there is that job's
    (e.g. ``"cpu"`` for a CPU entry in a pool of GPU children); ``stage`` given and no
    ``cases_file``: the children get :func:`stage_cases_file` (built here once, in the submitting
    thread); a stage without default cases leaves the child to report its setup error as before.
    ``env`` (None: this process's environment at submission) is snapshotted at submission.
    """

    def __init__(self, device: str = "cuda", jobs: int | None = None, gpus: list[str] | None = None,
                 workdir: str | None = None):
        dev = str(device)
        self.device = dev
        self._spread: list[str] = list(gpus) if gpus is not None else (visible_gpu_ids(torch_fallback=True) if dev == "cuda" else [])
        if jobs is not None and int(jobs) < 1:
            from dsv4_numerics.reference.errors import InputError

            raise InputError(f"jobs must be >= 1 (children run at once), got {jobs}")
        self.jobs = None if jobs is None else int(jobs)
        # the children's environment: this process's now (a production import during the caller's
        # probes may change os.environ later; that must not restart the warm children)
        self.base_env = dict(os.environ)
        self._workdir = workdir
        self._futures: dict[str, Future] = {}
        self._queue: list[tuple[str, tuple, dict, dict]] = []  # (key, args, kwargs, base env)
        self._cv = threading.Condition()
        self._closing = False
        self._threads: list[threading.Thread] = []
        self.sessions: list[WorkerSession] = []
        self._ran: dict[int, set[str]] = {}  # slot -> the entries its children have run
        self._idle: set[int] = set()  # slots waiting for a job
        self._job_env: dict[tuple[int, str], dict] = {}  # (slot, queued key) -> its child's environment there

    # -- submission
    def __contains__(self, key: str) -> bool:
        return key in self._futures

    def submit(self, key: str, entry: str, case_names: list[str] | None = None, *, stage: str | None = None,
               **kwargs: Any) -> None:
        if key in self:
            raise ValueError(f"entry {key!r} submitted twice")
        if self._closing:
            raise RuntimeError("the pool is closed")
        if stage is not None and not kwargs.get("cases_file"):
            try:
                kwargs["cases_file"] = stage_cases_file(stage)
            except Exception:  # noqa: BLE001 - no default cases, a builder bug: the child builds
                pass  # them itself and reports the error as its setup_error, as without the pool
        base_env = dict(self.base_env if kwargs.get("env") is None else kwargs["env"])
        kwargs.pop("env", None)
        with self._cv:
            self._futures[key] = Future()
            self._queue.append((key, (entry, case_names), kwargs, base_env))
            self._cv.notify_all()  # every idle session looks: the one that ran this entry takes it

    def start(self, warm: bool = False) -> None:
        """Start the sessions' threads (children start with their first entry; ``warm``: at once,
        so their start-up -- imports, device context -- overlaps the caller's work before it
        submits). Idempotent. Without ``jobs``, the count comes from the entries queued now."""
        with self._cv:
            if self._threads:
                return
            n = self.jobs or default_jobs(len(self._spread), max(1, len(self._queue)))
            self.jobs = n
            for i in range(n):
                sess = WorkerSession(self._slot_env(i, dict(self.base_env)), workdir=self._workdir,
                                     prefix=f"session{i}")
                self.sessions.append(sess)
                t = threading.Thread(target=self._serve, args=(i, sess, warm), daemon=True,
                                     name=f"dsv4-kernel-session-{i}")
                self._threads.append(t)
        for t in self._threads:
            t.start()

    def _slot_env(self, slot: int, base: dict) -> dict:
        env = dict(base)
        if "OMP_NUM_THREADS" not in env:
            env["OMP_NUM_THREADS"] = str(max(1, usable_cpus() // max(1, self.jobs or 1)))
        if self._spread:
            env["CUDA_VISIBLE_DEVICES"] = self._spread[slot % len(self._spread)]
        return env

    def _serve(self, slot: int, sess: WorkerSession, warm: bool = False) -> None:
        device = "cuda:0" if self.device == "cuda" else self.device
        if warm:
            with contextlib.suppress(SessionClosed, OSError):
                sess.warm()
        while True:
            with self._cv:
                while True:
                    pick = self._pick(slot) if self._queue else None
                    if pick is not None or (self._closing and not self._queue):
                        break
                    self._idle.add(slot)
                    self._cv.wait()
                    self._idle.discard(slot)
                if pick is None:
                    return
                key, args, kwargs, base = self._queue.pop(pick)
                for other in range(len(self.sessions)):
                    self._job_env.pop((other, key), None)
                self._ran.setdefault(slot, set()).add(str(args[0]))
                self._cv.notify_all()  # a session that left this job to this one looks again
            fut = self._futures[key]
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                res = run_isolated(*args, **dict(kwargs, env=self._slot_env(slot, base),
                                                 device=kwargs.get("device") or device, session=sess))
            except BaseException as e:  # noqa: BLE001 - handed to the caller through the future
                fut.set_exception(e)
            else:
                fut.set_result(res)

    def _affinity(self, slot: int, item: tuple) -> tuple[bool, int]:
        """How well queued ``item`` suits session ``slot``: whether its child's environment is the
        job's (else the child restarts), then 2 if the slot's children ran the job's entry already
        (its imports, probe and first launches are paid: an entry's first case in a child is its
        slowest), 1 if an entry of its family (the name before
        the first dot), 0 if neither."""
        entry = str(item[1][0])
        ran = self._ran.get(slot, ())
        family = entry.split(".", 1)[0]
        score = 2 if entry in ran else int(any(e.split(".", 1)[0] == family for e in ran))
        # the job's environment in this slot, built once per queued job (every idle session weighs
        # every queued job for every rival at each wake-up)
        want = self._job_env.get((slot, item[0]))
        if want is None:
            want = self._job_env[(slot, item[0])] = child_environment(self._slot_env(slot, item[3]))
        return want == self.sessions[slot].env, score

    def _pick(self, slot: int) -> int | None:
        """The queued job session ``slot`` takes now (under the lock): of the jobs that suit it
        best first (:meth:`_affinity`; equal: the earliest submitted), the first that suits no
        other idle session better; None when every job is left to an idle session it suits
        better (that one takes it: ``notify_all`` wakes every idle session, and each pop wakes
        them again). Some idle session always takes a job: the one a job suits best does."""
        rivals = [r for r in self._idle if r != slot]
        fits = [self._affinity(slot, item) for item in self._queue]
        for i in sorted(range(len(fits)), key=lambda i: (fits[i], -i), reverse=True):
            if all(self._affinity(r, self._queue[i]) <= fits[i] for r in rivals):
                return i
        return None

    # -- results
    def result(self, key: str) -> dict[str, dict]:
        """``run_isolated``'s result for ``key`` (blocks; starts the pool on first use)."""
        self.start()
        return self._futures[key].result()

    def results(self) -> dict[str, dict[str, dict]]:
        """Every submitted entry's result, in submission order."""
        self.start()
        return {k: f.result() for k, f in self._futures.items()}

    def close(self, cancel: bool = False) -> None:
        """Wait for every submitted entry (``cancel``: drop those not started and kill the
        running children now), then end the children (end of stdin, SIGKILL after a grace
        period). Idempotent."""
        with self._cv:
            self._closing = True
            if cancel:
                for key, *_ in self._queue:
                    self._futures[key].cancel()
                self._queue.clear()
                self._job_env.clear()  # the queued jobs' environments (``_affinity``) went with them
            self._cv.notify_all()
        if cancel:
            for sess in self.sessions:
                sess.close(grace_s=0)
        elif self._queue and not self._threads:
            self.start()  # submitted, never asked for: run them, as the executor did
        for t in self._threads:
            t.join()
        # every child gets its end of stdin at once, then each is waited for: a child's exit
        # (CUDA context teardown, ~1 s) overlaps the others' instead of adding up
        for sess in self.sessions:
            sess.hang_up()
        for sess in self.sessions:
            sess.close()

    def __enter__(self) -> "IsolatedPool":
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        self.close(cancel=exc_type is not None)


def run_isolated_many(entries: dict[str, dict], *, device: str = "cuda", jobs: int | None = None
                      ) -> dict[str, dict[str, dict]]:
    """``{key: run_isolated kwargs (entry, case_names, stage, cases_file, mode, ...)}`` run at
    most ``jobs`` at once (:class:`IsolatedPool`); ``{key: {case name: result}}``."""
    with IsolatedPool(device, jobs) as pool:
        for key, kw in entries.items():
            kw = dict(kw)
            pool.submit(key, kw.pop("entry", key), kw.pop("case_names", None), **kw)
        return pool.results()
