"""Kernel children shared by every xdist worker of one pytest run: a few per GPU, not one per
worker.

Why: the driver serialises CUDA context creation across the whole host, so processes that
create contexts at once wait for each other, and the wait grows with their number. With one
kernel child per xdist worker the number of contexts grows with the workers; shared children
keep it at a few per GPU, whatever the number of workers.

How: the pytest-xdist controller (the process that starts the workers) starts a
:class:`KernelBroker` before it starts them: an :class:`~dsv4_numerics.runner.pool.IsolatedPool`
of ``per_gpu`` long-lived children per visible GPU (each pinned to its GPU with
``CUDA_VISIBLE_DEVICES``, so its ``cuda:0`` is that GPU) behind a Unix socket
(``multiprocessing.connection``, with an authentication key; the messages are JSON, sent as
bytes, never pickles: :func:`send_json` / :func:`recv_json`). The workers find it through
:data:`ADDRESS_ENV` / :data:`KEY_ENV` and hand it their jobs (:func:`run_isolated`, the same
arguments as :func:`dsv4_numerics.runner.pool.run_isolated` less ``session`` and ``env``); a free
child takes the next job, whichever worker sent it. Crash isolation is the pool's: a crash, a hang
or a device fault fails its case and restarts that child only.

Switch (environment of the pytest command): :data:`SWITCH_ENV` ``DSV4_KERNEL_BROKER`` = ``auto``
(default: on under ``pytest -n N`` with N > 0 when a GPU is visible), ``on`` (also without a GPU:
``per_gpu`` CPU children in all; tests use it), ``off`` (every worker keeps its own child).
:data:`PER_GPU_ENV` ``DSV4_KERNEL_CHILDREN_PER_GPU``: children per GPU (default
:func:`default_per_gpu`).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import tempfile
import threading
import traceback
from multiprocessing.connection import Client, Listener
from typing import Any

from dsv4_numerics.runner.pool import IsolatedPool

SWITCH_ENV = "DSV4_KERNEL_BROKER"
PER_GPU_ENV = "DSV4_KERNEL_CHILDREN_PER_GPU"
ADDRESS_ENV = "DSV4_KERNEL_BROKER_ADDRESS"  # set by the controller for its workers
KEY_ENV = "DSV4_KERNEL_BROKER_KEY"  # hex authentication key, likewise


class BrokerError(RuntimeError):
    """The broker could not run a job (it is gone, or the job raised there): the message carries
    the broker side's traceback."""


class BrokerUnreachable(BrokerError):
    """No broker answers at :data:`ADDRESS_ENV` (none listens there, or it went away): the job was
    not run, so the caller may run it elsewhere."""


def send_json(conn, obj: Any) -> None:
    """Send ``obj`` (JSON-ready: the requests and the pool's result dicts; paths are sent as
    strings) over ``conn``."""

    def path(o: Any) -> str:
        if isinstance(o, os.PathLike):
            return os.fspath(o)
        raise TypeError(f"kernel broker: a {type(o).__name__} cannot be sent (JSON values and paths only)")

    conn.send_bytes(json.dumps(obj, default=path).encode())


def recv_json(conn) -> Any:
    """The next message of ``conn`` (:func:`send_json`), parsed as JSON: ``Connection.recv`` would
    unpickle it."""
    return json.loads(conn.recv_bytes())


def default_per_gpu(workers: int, gpus: int) -> int:
    """Children per GPU by default: one per two xdist workers on it, at least 2. The trade-off:
    a worker whose matrix case group waits for a busy child idles its core, and each child more
    is one CUDA context more (created serially host-wide, module docstring)."""
    per = -(-max(1, workers) // max(1, gpus))
    return max(2, per // 2)


def switch() -> str:
    """``auto`` | ``on`` | ``off`` from :data:`SWITCH_ENV` (unset: ``auto``)."""
    v = os.environ.get(SWITCH_ENV, "auto").strip().lower()
    if v in ("1", "on", "yes", "true"):
        return "on"
    if v in ("0", "off", "no", "false"):
        return "off"
    if v in ("", "auto"):
        return "auto"
    from dsv4_numerics.reference.errors import InputError

    raise InputError(f"{SWITCH_ENV} must be auto, on or off (got {v!r})")


class KernelBroker:
    """The shared children (module docstring). ``gpus``: ids to spread the children over (None:
    :func:`~dsv4_numerics.runner.host_gpus.visible_gpu_ids` with ``torch_fallback=True``; empty: CPU children, ``per_gpu`` in all).
    :meth:`start` serves; :meth:`warm` starts the children now; :meth:`close` ends them.
    ``jobs_served`` counts the jobs run, ``children_started`` the children started (restarts
    after crashes included)."""

    def __init__(self, per_gpu: int, gpus: list[str] | None = None, workdir: str | None = None):
        from dsv4_numerics.runner.host_gpus import visible_gpu_ids

        if int(per_gpu) < 1:
            from dsv4_numerics.reference.errors import InputError

            raise InputError(f"per_gpu must be >= 1 (children per GPU), got {per_gpu}")
        self.gpus = visible_gpu_ids(torch_fallback=True) if gpus is None else list(gpus)
        self.per_gpu = int(per_gpu)
        self._dir = tempfile.mkdtemp(prefix="dsv4-broker-")
        self.pool = IsolatedPool("cuda" if self.gpus else "cpu", jobs=self.per_gpu * max(1, len(self.gpus)),
                                 gpus=self.gpus or None, workdir=workdir or os.path.join(self._dir, "children"))
        self.address = os.path.join(self._dir, "socket")
        self.authkey = os.urandom(16)
        self._listener: Listener | None = None
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._closing = False
        self.jobs_served = 0

    @property
    def children_started(self) -> int:
        return sum(s.starts for s in self.pool.sessions)

    def env(self) -> dict[str, str]:
        """The variables a worker needs to reach this broker."""
        return {ADDRESS_ENV: self.address, KEY_ENV: self.authkey.hex()}

    def start(self) -> "KernelBroker":
        """Listen (a daemon thread accepts, one thread per connected worker). Idempotent."""
        with self._lock:
            if self._listener is None:
                self._listener = Listener(self.address, family="AF_UNIX", authkey=self.authkey)
                threading.Thread(target=self._accept, daemon=True, name="dsv4-broker-accept").start()
        return self

    def warm(self) -> None:
        """Start every child now (their imports and device contexts overlap the workers' work)."""
        self.pool.start(warm=True)

    def run(self, entry: str, case_names: list[str] | None = None, **kwargs: Any) -> dict[str, dict]:
        """Run one job in the next free child (blocks): :func:`~dsv4_numerics.runner.pool.run_isolated`'s
        result."""
        with self._lock:
            key = f"job{next(self._ids)}"
        self.pool.submit(key, entry, case_names, **kwargs)
        out = self.pool.result(key)
        with self._lock:
            self.jobs_served += 1
        return out

    def close(self, cancel: bool = False) -> None:
        """Stop listening, let the running jobs end (``cancel``: kill the children now, as after
        an interrupted run), end the children, remove the socket. Idempotent."""
        self._closing = True
        lst, self._listener = self._listener, None
        if lst is not None:
            with contextlib.suppress(OSError):
                lst.close()
        self.pool.close(cancel=cancel)
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> "KernelBroker":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- serving
    def _accept(self) -> None:
        while not self._closing:
            lst = self._listener
            if lst is None:
                return
            try:
                conn = lst.accept()
            except Exception:  # noqa: BLE001 - closed (OSError), or a client with a wrong key
                continue  # (AuthenticationError): the broker keeps serving the others
            threading.Thread(target=self._serve, args=(conn,), daemon=True, name="dsv4-broker-conn").start()

    def _serve(self, conn) -> None:
        with conn:
            while True:
                try:
                    req = recv_json(conn)
                except (EOFError, OSError, ValueError):  # ValueError: not JSON
                    return
                if self._closing:
                    return  # the worker sees the connection end: BrokerError "went away"
                try:
                    if req.get("op") == "warm":
                        self.warm()
                        reply: dict = {"ok": True}
                    elif req.get("op") == "run":
                        reply = {"ok": True, "result": self.run(req["entry"], req.get("case_names"), **req["kwargs"])}
                    else:
                        reply = {"ok": False, "error": f"unknown request {req!r}"}
                except BaseException:  # noqa: BLE001 - sent back to the worker that asked
                    reply = {"ok": False, "error": traceback.format_exc()}
                try:
                    send_json(conn, reply)
                except (OSError, EOFError):
                    return


# ----------------------------------------------------------------------------- the controller's side

def maybe_start(workers: int) -> KernelBroker | None:
    """In the xdist controller, before the workers start: a started broker when :func:`switch`
    says so for ``workers`` workers (``auto``: workers > 0 and a GPU visible), with its
    :meth:`KernelBroker.env` put into ``os.environ`` for the workers to inherit; else None."""
    from dsv4_numerics.runner.host_gpus import visible_gpu_ids

    mode = switch()
    if mode == "off" or workers < 1:
        return None
    gpus = visible_gpu_ids(torch_fallback=True)
    if mode == "auto" and not gpus:
        return None
    raw = os.environ.get(PER_GPU_ENV, "").strip()
    per_gpu = int(raw) if raw else default_per_gpu(workers, len(gpus))
    broker = KernelBroker(per_gpu, gpus=gpus).start()
    os.environ.update(broker.env())
    return broker


# ----------------------------------------------------------------------------- a worker's side

CONNECTIONS: dict = {}  # {broker address: this process's connection to it}
_CONN_LOCK = threading.Lock()


def available() -> bool:
    """Whether this process was given a broker (:data:`ADDRESS_ENV`)."""
    return bool(os.environ.get(ADDRESS_ENV))


def _request(req: dict) -> dict:
    address = os.environ.get(ADDRESS_ENV, "")
    with _CONN_LOCK:
        if address not in CONNECTIONS:
            try:
                CONNECTIONS[address] = Client(address, family="AF_UNIX", authkey=bytes.fromhex(os.environ[KEY_ENV]))
            except (KeyError, ValueError, OSError) as e:
                raise BrokerUnreachable(f"no kernel broker at {address!r}: {type(e).__name__}: {e}") from e
        conn = CONNECTIONS[address]
        try:
            send_json(conn, req)
            reply = recv_json(conn)
        except (OSError, EOFError, ValueError) as e:
            del CONNECTIONS[address]
            raise BrokerUnreachable(f"the kernel broker went away: {type(e).__name__}: {e}") from e
    if not reply.get("ok"):
        raise BrokerError(f"the kernel broker could not run the job:\n{reply.get('error')}")
    return reply


def warm() -> None:
    """Ask the broker to start its children now."""
    _request({"op": "warm"})


def run_isolated(entry: str, case_names: list[str] | None = None, **kwargs: Any) -> dict[str, dict]:
    """:func:`dsv4_numerics.runner.pool.run_isolated` in one of the broker's children (no
    ``session``, no ``env``: the child's environment is the broker's, pinned to its GPU)."""
    for bad in ("session", "env"):
        if bad in kwargs:
            from dsv4_numerics.reference.errors import InputError

            raise InputError(f"{bad}: the broker's children have their own; do not pass it")
    return _request({"op": "run", "entry": entry, "case_names": case_names, "kwargs": kwargs})["result"]
