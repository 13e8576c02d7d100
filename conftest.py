"""Root pytest configuration of this repository: hypothesis profiles, our unprefixed hardware
markers, one xdist worker per GPU by default, and ``matrix_results``.

Everything a foreign project can use lives in the pytest plugin ``dsv4_numerics.plugin.hooks``
(loaded here through the editable install's ``pytest11`` entry point): ``--dsv4-report``,
``--dsv4-require`` / ``--dsv4-require-available``, the ``dsv4_*`` markers, ``dsv4_results``.

Hypothesis profiles (``--hypothesis-profile NAME``):
  ci       default; derandomized (deterministic), bounded example counts, no deadline
  dev      more examples, random seeds, no deadline
  nightly  many more examples

Markers (registered, each skips with a reason and the hardware found when it is absent; the
plugin's functions decide, the same rules as its ``dsv4_*`` markers):
  gpu    any CUDA or ROCm device      sm90   compute capability 9.x (H100/H200)
  sm100  compute capability 10.x      sm120  compute capability 12.x
  rocm   a ROCm (HIP) build of PyTorch with a device

GPU pinning: ON by default here (the plugin makes it opt-in elsewhere): under ``pytest -n N``
each xdist worker ``gwK`` gets ``CUDA_VISIBLE_DEVICES`` set to GPU ``K % num_gpus`` at conftest
import time, before anything initialises CUDA. ``DSV4_NO_GPU_PINNING=1`` keeps the inherited
visibility. ``.ci/gpu-matrix`` relies on it. A pinned worker also starts making its CUDA context
in a background thread at that moment, overlapping the driver's host-wide serialisation of context
creation with its collection (``DSV4_WARM_CUDA=0`` turns that off), and at its end skips the
interpreter's shutdown, CUDA teardown included (``DSV4_FAST_EXIT=0`` turns that off).
"""

from __future__ import annotations

import os
from pathlib import Path
import sys
import threading

# ``torch.cuda.is_available()`` (test modules' skip marks, at collection) through NVML, not the CUDA
# driver's initialisation, which the driver serialises host-wide with every other process's context
# creation: under ``-n 64`` on a 4-GPU host it held every worker's collection up to 15-16 s. The
# hardware itself is read from NVML too (``dsv4_numerics.kernels.gpu_facts``); children inherit it.
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

from dsv4_numerics.runner import cuda_context as _cuda_context  # noqa: E402
from dsv4_numerics.runner.host_cpus import usable_cpus  # noqa: E402
from dsv4_numerics.plugin import hooks as _plugin  # noqa: E402

_PINNED = _plugin.pin_xdist_worker_to_gpu() is not None
if _PINNED:
    # a worker pinned to a GPU makes its CUDA context now, in a thread, while it collects (the
    # driver serialises context creation host-wide), and skips the interpreter's shutdown (and the
    # CUDA teardown in it) at its end: the controller waits for every worker process to exit
    # (dsv4_numerics/runner/cuda_context.py)
    _cuda_context.warm_primary_context()
    _cuda_context.skip_shutdown_at_exit()


def _share_cpu_threads_between_xdist_workers() -> None:
    """Under ``pytest -n N`` give each worker ``cpus // N`` intra-op threads (at least 1; ``cpus``: the
    CPUs this process may run on, ``host_cpus.usable_cpus``), unless
    the user chose (``OMP_NUM_THREADS`` set). N workers each spinning ``cpus`` OpenMP threads
    oversubscribe the machine: building the decode cases took 15.7 s at 2 threads against 0.6 s
    at 1 on a busy 2-core box. Results do not depend on it (the reference has a fixed reduction
    order; derivation tests set their own thread counts)."""
    n = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not n or not n.isdigit() or "OMP_NUM_THREADS" in os.environ:
        return
    import torch

    torch.set_num_threads(max(1, usable_cpus() // int(n)))


_share_cpu_threads_between_xdist_workers()

import pytest  # noqa: E402

# under xdist, an item a worker collected but never reported fails the session by name
# (dsv4_numerics/plugin/lost_items.py)
pytest_plugins = ["dsv4_numerics.plugin.lost_items"]

try:
    from hypothesis import HealthCheck, settings

    settings.register_profile(
        "ci",
        max_examples=60,
        derandomize=True,
        deadline=None,
        print_blob=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    settings.register_profile(
        "dev", max_examples=300, deadline=None, print_blob=True,
        suppress_health_check=[HealthCheck.too_slow],
    )
    settings.register_profile(
        "nightly", max_examples=3000, deadline=None, print_blob=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    # GPU fuzzing at production shapes (tests/kernels/test_fuzz_attention_gpu.py): each example
    # is a production-size kernel launch plus its reference, so fewer examples than `nightly`.
    settings.register_profile(
        "gpu-nightly", max_examples=400, deadline=None, print_blob=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
except ImportError:  # hypothesis is in the `test` extra; the CLI does not need it
    pass


def pytest_configure(config):
    _plugin.register_arch_markers(config, "")
    # keep the collection order (longest_first) when handing scopes out: pytest-xdist's loadscope /
    # loadgroup scheduler otherwise re-sorts them by test count, so every multi-test group went
    # before the single long tests, which then ran last (the 2-GPU run's 23 s tail)
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False
    _prefer_loadgroup(config)
    config.addinivalue_line("markers", "slow: long-running; still part of the default run")
    _start_kernel_broker(config)
    if _PINNED:
        config.pluginmanager.register(_ReleaseCudaAfterTheLastTest(), "dsv4-cuda-release")
    if _TIMELINE:
        config.pluginmanager.register(_TimelineEnd(), "dsv4-timeline-end")


def _prefer_loadgroup(config) -> None:
    """``pytest -n N`` without ``--dist`` runs here as ``--dist loadgroup``. xdist's default
    ``load`` hands each worker a consecutive quarter of its share first (items 0-263 of 2118 to
    one worker on 2 CPUs): with the longest units first that worker got every long test and ran
    199 s while the other was done at 41 s. ``loadgroup`` hands out one unit (a test, or a whole
    ``xdist_group``: a matrix case group, run in one kernel child) at a time, in collection order."""
    if getattr(config.option, "dist", "no") != "load":
        return
    given = [str(a) for a in config.invocation_params.args] + os.environ.get("PYTEST_ADDOPTS", "").split()
    given += [str(a) for a in (config.getini("addopts") or [])]
    if not any(a == "--dist" or a.startswith("--dist=") for a in given):
        config.option.dist = "loadgroup"


# ----------------------------------------------------------------------------- kernel broker
# Under `pytest -n N` on a GPU host the controller shares a few kernel children per GPU between all
# workers (dsv4_numerics/runner/broker.py: every CUDA context costs the whole host ~0.3 s of
# serialised driver time, and one child per worker doubled the contexts). DSV4_KERNEL_BROKER=off
# gives every worker its own child again.
_BROKER: list = []


def _start_kernel_broker(config) -> None:
    if hasattr(config, "workerinput") or _BROKER:
        return  # an xdist worker (it uses the controller's broker), or started already
    workers = getattr(config.option, "numprocesses", None)
    if not isinstance(workers, int) or getattr(config.option, "dist", "no") == "no":
        return
    from dsv4_numerics.runner import broker as worker_broker

    broker = worker_broker.maybe_start(workers)
    if broker is not None:
        _BROKER.append(broker)
        _BROKERS_RUN.append(broker)


_INTERRUPTED: list = []
_BROKERS_RUN: list = []  # every broker this process started (the summary line reads them)
_CLOSING: list = []  # the thread ending the brokers' children while xdist waits for its workers


def _close_brokers(cancel: bool) -> None:
    while _BROKER:
        _BROKER.pop().close(cancel=cancel)


@pytest.hookimpl(tryfirst=True)  # before xdist's own sessionfinish, which waits for the workers
def pytest_sessionfinish(session, exitstatus):
    interrupted = exitstatus == pytest.ExitCode.INTERRUPTED  # SIGINT (a runner's time limit), Ctrl-C
    if interrupted:
        _INTERRUPTED.append(True)
    # The controller's sessionfinish comes after its test loop: every worker's results are in and no
    # worker asks the broker for anything more. Its children end in a thread while xdist waits for
    # the worker processes to exit (both wait on the driver releasing CUDA contexts, one process at
    # a time): the run's end overlaps them instead of adding them (pytest_unconfigure joins).
    if _BROKER and not _CLOSING:
        t = threading.Thread(target=_close_brokers, args=(interrupted,), daemon=True, name="dsv4-broker-close")
        t.start()
        _CLOSING.append(t)


# The broker's users: the matrix items and the oracle-mode checks that read its results
# (tests/kernels/conftest.py's kernel_results). Once every one of their items has reported its
# teardown, no worker asks the broker for anything more and its children end then, in a thread,
# while the other tests run: ending a child waits on the driver releasing its CUDA context, one
# process at a time host-wide, which at the run's end queued behind the workers' own. A test that
# still asked would find the broker gone and run its own child (a warning).
_BROKER_USERS = ("tests/kernels/test_matrix.py::", "tests/kernels/test_oracle_modes_gpu.py::")
_BROKER_PENDING: dict = {}  # "ids": the users' node ids not yet torn down


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    if _BROKER and "ids" not in _BROKER_PENDING:
        _BROKER_PENDING["ids"] = {i for i in ids if i.startswith(_BROKER_USERS)}


def pytest_runtest_logreport(report):
    pending = _BROKER_PENDING.get("ids")
    if pending is None or report.when != "teardown":
        return
    pending.discard(report.nodeid)
    if not pending and _BROKER and not _CLOSING:
        _BROKER_PENDING["ended_early"] = True
        t = threading.Thread(target=_close_brokers, args=(False,), daemon=True, name="dsv4-broker-close")
        t.start()
        _CLOSING.append(t)


def pytest_unconfigure(config):
    # an interrupted run kills the shared kernel children at once: waiting for their running jobs
    # (up to a case limit of minutes) would outlast the runner's grace period after its SIGINT
    while _CLOSING:
        _CLOSING.pop().join()
    _close_brokers(bool(_INTERRUPTED))


def pytest_terminal_summary(terminalreporter):
    for b in _BROKERS_RUN:
        where = f"{len(b.gpus)} GPU(s) ({b.per_gpu} each)" if b.gpus else f"the CPU ({b.per_gpu})"
        early = "; its children ended after its last user's teardown" if _BROKER_PENDING.get("ended_early") else ""
        terminalreporter.write_line(f"kernel broker: {b.jobs_served} matrix jobs in {b.children_started} "
                                    f"kernel children on {where}{early}")


def hardware() -> dict:
    return _plugin.hardware()


def arch_skip_reason(marker: str) -> str | None:
    """The reason a test carrying ``marker`` cannot run here, or None if it can."""
    return _plugin.arch_skip_reason(marker)


def pytest_collection_modifyitems(config, items):
    _plugin.apply_arch_skips(items, "")
    longest_first(items)


def pytest_collection_finish(session):
    # What exists now (torch, the product, hypothesis, every test item: ~250k objects) lives until
    # the process ends: moved out of the collector's reach, a full collection no longer walks it
    # (~0.1 s each; pytest runs five at the end of every process, half a second after the last
    # test of every xdist worker, and a few more come in between)
    import gc

    gc.collect()
    gc.freeze()


def xdist_group_name(item) -> str | None:
    m = item.get_closest_marker("xdist_group")
    return (m.kwargs.get("name") or (m.args[0] if m.args else None)) if m else None


# Measured seconds per scheduling unit (a test, or a whole xdist group as "@GROUP") on a GPU host:
# ``python -m dsv4_numerics.runner.timeline --durations junit.xml > tests/durations.json`` from a
# ``.ci/gpu-matrix`` run's junit.xml (README, "How many workers"). Units under 0.3 s are absent.
DURATIONS_FILE = Path(__file__).resolve().parent / "tests" / "durations.json"
SLOW_DEFAULT_S = 10.0  # a `slow` test the durations file does not know yet
# Units measured shorter than this keep their collected place: moving them buys nothing for the
# tail, and interleaving modules re-creates module-scoped fixtures (a module's tests are contiguous
# in the collected order)
LPT_MIN_S = 1.0


def _durations() -> dict[str, float]:
    import json

    try:
        data = json.loads(DURATIONS_FILE.read_text())
    except (OSError, ValueError):
        return {}
    return {str(k): float(v) for k, v in data.items() if isinstance(v, (int, float))}


def longest_first(items, durations: dict[str, float] | None = None) -> None:
    """Schedule the long units first (in place, deterministic): pytest-xdist hands scopes out in
    collection order (one unit per test, or per ``xdist_group``), so a 12 s test that comes last
    is the run's tail -- on one H100 the last worker finished 9.8 s after the median one with only
    the ``slow`` tests first (``.ci/gpu-scaling``'s timeline). Longest processing time first: each
    unit's seconds from ``durations`` (default: ``tests/durations.json``, measured on a GPU host;
    :func:`dsv4_numerics.runner.timeline.unit_key`; under ``LPT_MIN_S`` they count 0), a ``slow`` test it
    does not know counts ``SLOW_DEFAULT_S``, an unknown group its runnable items' count times 0.3 s,
    anything else 0; skipped items count 0. Equal estimates keep the collected order."""
    from dsv4_numerics.runner.timeline import unit_key

    known = _durations() if durations is None else durations
    groups = [xdist_group_name(it) for it in items]
    units = [unit_key(it.nodeid, g) for it, g in zip(items, groups)]
    first: dict[str, int] = {}
    est: dict[str, float] = {}
    for i, (it, g, unit) in enumerate(zip(items, groups, units)):
        first.setdefault(unit, i)
        if it.get_closest_marker("skip"):
            est.setdefault(unit, 0.0)
            continue
        if unit in known:
            est[unit] = known[unit] if known[unit] >= LPT_MIN_S else 0.0
        elif it.get_closest_marker("slow"):
            est[unit] = max(est.get(unit, 0.0), SLOW_DEFAULT_S)
        elif g is not None:
            est[unit] = est.get(unit, 0.0) + 0.3
        else:
            est.setdefault(unit, 0.0)
    order = {id(it): (-est[unit], first[unit], i) for i, (it, unit) in enumerate(zip(items, units))}
    items.sort(key=lambda it: order[id(it)])


@pytest.fixture
def matrix_results(dsv4_results):
    """Our tests' name for the plugin's ``dsv4_results``: ``collect(results)`` attaches Results
    (one or a list) to this test's report and returns the list it was given."""
    return dsv4_results


# ----------------------------------------------------------------------------- suite timeline
# DSV4_TIMELINE=DIR (set by .ci/gpu-scaling): every process (xdist worker or a plain run) appends
# one line per test phase to DIR/<worker>.tsv -- "<start> <end> <phase> <nodeid> <cpu0> <cpu1>
# <kids0> <kids1>": wall seconds since the epoch, then this process's CPU seconds (user + system) and
# its waited-for children's (subprocess tests, CLI runs) at the phase's start and end -- plus "<t> <t>
# sessionstart -" when it starts, so a run's wall time splits into worker start-up and collection,
# test time and idle time, and its CPU time into the same phases (python -m dsv4_numerics.runner.timeline DIR).
from dsv4_numerics.runner import timeline as _timeline  # noqa: E402

_TIMELINE = os.environ.get(_timeline.ENV)
if _TIMELINE:
    import time as _time

    def _cpu() -> tuple[float, float]:
        """This process's CPU seconds (user + system) and its waited-for children's."""
        t = os.times()
        return t.user + t.system, t.children_user + t.children_system

    def _timeline_write(start: float, end: float, what: str, nodeid: str, cpu0=None) -> None:
        """One row; the CPU seconds at its end are now's, at its start ``cpu0`` (default: now's)."""
        os.makedirs(_TIMELINE, exist_ok=True)
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        cpu1 = _cpu()
        cpu0 = cpu0 or cpu1
        with open(os.path.join(_TIMELINE, f"{worker}.tsv"), "a") as f:
            f.write(_timeline.row_line(start, end, what, nodeid, cpu0[0], cpu1[0], cpu0[1], cpu1[1]))

    def _process_start() -> float | None:
        """This process's start (seconds since the epoch) from /proc, or None off Linux."""
        try:
            with open("/proc/self/stat") as f:
                ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
            with open("/proc/stat") as f:
                btime = next(int(line.split()[1]) for line in f if line.startswith("btime "))
            return btime + ticks / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError, StopIteration):
            return None

    _t_import = _time.time()
    _t_process = _process_start()
    if _t_process is not None:  # python start-up and the imports before this line (torch)
        _timeline_write(min(_t_process, _t_import), _t_import, "imports", "-", (0.0, 0.0))
    _timeline_write(_t_import, _t_import, "sessionstart", "-")

    import contextlib as _contextlib

    @_contextlib.contextmanager
    def _row(what: str, nodeid: str = "-"):
        """A row for the body's wall and CPU time."""
        t0, c0 = _time.time(), _cpu()
        try:
            yield
        finally:
            _timeline_write(t0, _time.time(), what, nodeid, c0)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        with _row("test", item.nodeid):
            yield

    @pytest.hookimpl(hookwrapper=True)
    def pytest_collection(session):
        with _row("collection"):
            yield

    def _timed_impl(fn, label: str):
        import functools

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            with _row("hook", label):
                return fn(*args, **kwargs)

        timed._dsv4_timed = True
        return timed

    class _TimelineEnd:
        """The end of a run: each process's ``sessionfinish`` and ``unconfigure`` (in the xdist
        controller the first waits for every worker process to exit, the second ends the kernel
        broker's children), the controller's ``nodedown`` (a worker reported its session done) and
        every process's ``exit`` (the start of its interpreter's shutdown)."""

        @pytest.hookimpl(wrapper=True)
        def pytest_sessionfinish(self, session, exitstatus):
            with _row("sessionfinish"):
                return (yield)

        @pytest.hookimpl(wrapper=True)
        def pytest_unconfigure(self, config):
            with _row("unconfigure"):
                return (yield)

        @staticmethod
        def pytest_sessionstart(session):
            """Each plain implementation of ``pytest_sessionfinish`` and ``pytest_unconfigure`` (every
            plugin's: xdist's node teardown, the reports, the broker) writes a ``hook`` row named
            ``<hook>:<plugin>``: which of them the end of a run waits for. In the xdist controller
            (or a plain run) only: the workers' ends are their ``sessionfinish``/``unconfigure`` rows."""
            if hasattr(session.config, "workerinput"):
                return
            pm = session.config.pluginmanager
            for name in ("pytest_sessionfinish", "pytest_unconfigure"):
                for impl in getattr(pm.hook, name).get_hookimpls():
                    if impl.hookwrapper or impl.wrapper or getattr(impl.function, "_dsv4_timed", False):
                        continue
                    impl.function = _timed_impl(impl.function, f"{name}:{impl.plugin_name}")

        @pytest.hookimpl(optionalhook=True)
        def pytest_testnodedown(self, node, error):
            t = _time.time()
            _timeline_write(t, t, "nodedown", str(getattr(getattr(node, "gateway", None), "id", "?")))

    import atexit as _atexit

    _atexit.register(lambda: _timeline_write(_time.time(), _time.time(), "exit", "-"))
    # "mainend": the main thread is done (an xdist worker: its gateway was told to exit), before the
    # interpreter waits for non-daemon threads (and, in a worker that skips its shutdown, ends there)
    _register_thread_end = getattr(threading, "_register_atexit", None)
    if _register_thread_end is not None:
        _register_thread_end(lambda: _timeline_write(_time.time(), _time.time(), "mainend", "-"))


# ----------------------------------------------------------------------------- a worker's last test
# A pinned xdist worker (it ends through os._exit, above) destroys its CUDA context as soon as its
# last test is done (xdist gives the last item no next one), not at its exit: the driver releases
# contexts one process at a time host-wide, and 32 workers ending together queued ~2.7 s at the
# run's end (dsv4_numerics/runner/cuda_context.py; DSV4_EARLY_CUDA_RELEASE=0 turns it off).
class _ReleaseCudaAfterTheLastTest:
    """Registered in pinned workers (pytest_configure)."""

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        yield
        if nextitem is None:
            _cuda_context.release_primary_context_soon()


# ----------------------------------------------------------------------------- device faults
# A kernel launched in this process that faults (an illegal address) is reported by CUDA at the
# next synchronising call, which may belong to the NEXT test: the culprit passes and an innocent
# test fails with "an illegal memory access was encountered" at its first `.to("cuda")`, and so
# does every later GPU test of this xdist worker (the context is lost). Synchronising after each
# test's call phase, wherever this process has a CUDA context, pins the fault on the test that
# launched the kernel.
_DEVICE_FAULT: list[str] = []  # the test after which this process's device faulted


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    result = yield
    torch = sys.modules.get("torch")  # never imported here: a process without torch has no CUDA work
    # is_initialized first: is_available asks NVML each time before CUDA is initialised
    # (PYTORCH_NVML_BASED_CUDA_CHECK, above), and this runs after every test
    if _DEVICE_FAULT or torch is None or not torch.cuda.is_initialized() or not torch.cuda.is_available():
        return result
    try:
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - any asynchronous device error
        _DEVICE_FAULT.append(item.nodeid)
        raise RuntimeError(f"a device fault surfaced at the end of this test (a kernel it launched "
                           f"faulted asynchronously; later GPU tests of this process fail with it): "
                           f"{type(e).__name__}: {e}") from e
    return result

