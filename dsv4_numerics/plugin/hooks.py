"""The dsv4-numerics pytest plugin (registered through the ``pytest11`` entry point).

``pip install dsv4-numerics`` is enough to use it from a test file in any project::

    import pytest
    from dsv4_numerics.plugin.hooks import parametrize_cases

    @pytest.mark.dsv4_sm90                       # skipped with the reason and the GPU found
    @parametrize_cases("swa_write")              # one test per canonical case, id = case name
    def test_my_writer(case, dsv4_results):
        results = dsv4_results(dsv4_numerics.judge(my_writer, "swa_write", cases=[case]))
        assert all(r.ok for r in results)

What it provides (nothing else; merely installed it changes no unrelated suite: importing it
imports no torch, sets no environment variable and loads no hypothesis profile, and it adds
skips only to tests carrying its own markers):

Markers (namespaced), each a skip with the reason and the hardware found when absent:
  ``dsv4_gpu`` any CUDA or ROCm device, ``dsv4_sm90`` compute capability 9.x (H100/H200),
  ``dsv4_sm100`` 10.x, ``dsv4_sm120`` 12.x, ``dsv4_rocm`` a ROCm build with a device.
  The hardware is probed (torch imported) only if a collected test carries one of them.
``parametrize_cases(stage, *, size="default", argname="case")``
  parametrises a test over the stage's canonical cases (``dsv4_numerics.api.testing.cases``) with
  the case names as ids; the cases are built when the test is collected, once per stage.
Fixture ``dsv4_results``
  ``collect(result_or_results)`` attaches ``oracles.report.Result`` objects to the test; they
  travel with the test report (JUnit user properties), so results from pytest-xdist workers
  reach the controller. Returns the list it was given.
  Results of ``judge`` / ``assert_matches_reference`` called while a test runs are attached to
  it as they are made (``dsv4_numerics.api.result_sink``), so a test that raises, skips or fails
  after judging still reports them; handing the same Results to ``dsv4_results`` again is a no-op.
  Marker ``dsv4_unreported``: not for this test (it judges deliberately wrong kernels, e.g. to
  test that a check catches them); only what it hands to ``dsv4_results`` is reported.
``--dsv4-report PATH``
  writes the collected Results as JSON (schema ``dsv4-numerics/report/1``; ``meta`` carries the
  run metadata of ``dsv4_numerics.report.run_meta`` -- arch, device, torch / CUDA / Triton / staged
  vLLM versions, git commit -- ``judged``, the requirement outcome, ``tests`` (pytest's outcome
  counts, as its terminal summary counts them) and ``tests_with_results`` (the same over the
  tests that attached Results)). Never greener than the run: a test pytest reports failed or
  errored whose Results all passed adds an ``error`` Result (rule ``test_outcome``) naming it.
  The terminal summary shows a kernel x case table whenever any Result was collected.
  A test whose xdist worker died while a kernel judged in it was running (a segfault in a kernel
  judged in-process) still leaves a row: an ``error`` Result (rule ``crash``) for that kernel,
  stage and case, from the call's announcement the worker wrote before the call.
``--dsv4-isolate`` (ini ``dsv4_isolate = true``)
  makes ``isolate=True`` the default of ``judge`` / ``assert_matches_reference`` / ``explain``
  in the run: each kernel is called in a crash-isolated child (``dsv4_numerics.api.isolation``),
  so a fault, hang or device error is an ``error`` Result of its case and the session goes on.
``--dsv4-require ENTRY_OR_GLOB`` (repeatable; env ``DSV4_REQUIRE``, comma-separated) and
``--dsv4-require-available``
  at the end of the session, every required entry must have at least one *judged* Result
  (``pass``/``fail``/``error``); one that only skipped, or has no Result, fails the session
  (exit status 1) with a line naming the entry and the reason (its probe's, or its tests' skip
  reason). A glob matching no entry fails too. Entries are known from the registry, installed
  packages, ``DSV4_ENTRIES_FROM`` sources and the Results. ``--dsv4-require-available`` requires every
  built-in registry entry whose architectures match the GPU present (and fails if none does).
``--dsv4-repro DIR``
  one minimal standalone reproducer (``dsv4_numerics.repro``) per case ``judge`` fails inside a
  test, in ``DIR/<test id>/<case>/`` (``plugin.repro``), listed in the terminal summary.
``--dsv4-pin-gpus`` (or env ``DSV4_PIN_GPUS=1``): opt-in xdist GPU pinning
  each xdist worker ``gwK`` gets ``CUDA_VISIBLE_DEVICES`` = visible GPU ``K % n``. It is done in
  ``pytest_load_initial_conftests`` (before any conftest or test module is imported, so before
  anything can initialise CUDA). ``DSV4_NO_GPU_PINNING=1`` turns it off again.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Iterable

import pytest

from dsv4_numerics.runner.host_gpus import visible_gpu_ids  # noqa: F401 - also this plugin's own name for it

MARKER_PREFIX = "dsv4_"
ARCH_REASONS = {
    "gpu": "needs a CUDA or ROCm GPU",
    "sm90": "needs an SM90 GPU (compute capability 9.x: H100/H200)",
    "sm100": "needs an SM100 GPU (compute capability 10.x: B200/GB200)",
    "sm120": "needs an SM120 GPU (compute capability 12.x: RTX Pro 6000 / DGX Spark)",
    "rocm": "needs a ROCm build of PyTorch with an AMD GPU",
}
_CC_MAJOR = {"sm90": 9, "sm100": 10, "sm120": 12}
ENV_PIN = "DSV4_PIN_GPUS"
ENV_NO_PIN = "DSV4_NO_GPU_PINNING"
ENV_PINNED = "DSV4_PINNED_GPU"
ENV_REQUIRE = "DSV4_REQUIRE"


# ----------------------------------------------------------------------------- GPU pinning
def pin_xdist_worker_to_gpu() -> str | None:
    """In xdist worker ``gwK``: set ``CUDA_VISIBLE_DEVICES`` to visible GPU ``K % n`` (and
    ``DSV4_PINNED_GPU``); returns the id, or None when not a worker, no GPU is visible, or
    ``DSV4_NO_GPU_PINNING=1``. Idempotent. Must run before anything initialises CUDA."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")  # "gw0", "gw1", ...
    if not worker or os.environ.get(ENV_NO_PIN) == "1":
        return None
    pinned = os.environ.get(ENV_PINNED)
    if pinned is not None and os.environ.get("CUDA_VISIBLE_DEVICES") == pinned:
        return pinned  # already pinned in this process (plugin and root conftest both ask)
    ids = visible_gpu_ids()
    if not ids:
        return None
    k = int(worker[2:]) if worker[2:].isdigit() else 0
    os.environ["CUDA_VISIBLE_DEVICES"] = ids[k % len(ids)]
    os.environ[ENV_PINNED] = ids[k % len(ids)]
    return ids[k % len(ids)]


def _pinning_requested(namespace: Any) -> bool:
    return bool(getattr(namespace, "dsv4_pin_gpus", False)) or os.environ.get(ENV_PIN) == "1"


# ----------------------------------------------------------------------------- hardware markers
_HW: dict | None = None


def hardware() -> dict:
    """``{"gpu", "major", "rocm", "name"}`` of device 0 (imports torch; cached per process): the
    kernels' probe's ``gpu_info``, which reads an NVIDIA GPU from NVML without initialising CUDA
    (the driver serialises that between processes: it held up every xdist worker's collection)."""
    global _HW
    if _HW is None:
        from dsv4_numerics.kernels.probe import gpu_info

        g = gpu_info()
        _HW = {"gpu": g.present, "major": g.capability[0] if g.present and g.capability else None,
               "rocm": g.vendor == "rocm", "name": g.name if g.present else None}
    return _HW


def arch_skip_reason(arch: str) -> str | None:
    """Why a test needing ``arch`` (``gpu``, ``sm90``, ``sm100``, ``sm120``, ``rocm``) cannot run
    here, naming the hardware found; None if it can."""
    if arch not in ARCH_REASONS:
        raise ValueError(f"arch_skip_reason: argument 'arch' must be one of {sorted(ARCH_REASONS)} (got {arch!r})")
    hw = hardware()
    found = f"found {hw['name']}" if hw["gpu"] else "no GPU visible"
    if arch == "gpu":
        ok = hw["gpu"]
    elif arch == "rocm":
        ok = hw["rocm"]
    else:
        ok = hw["gpu"] and not hw["rocm"] and hw["major"] == _CC_MAJOR[arch]
    return None if ok else f"{ARCH_REASONS[arch]} ({found})"


def register_arch_markers(config: Any, prefix: str) -> None:
    for arch, reason in ARCH_REASONS.items():
        config.addinivalue_line("markers", f"{prefix}{arch}: {reason}; skipped with a reason otherwise")


def apply_arch_skips(items: Iterable[Any], prefix: str) -> None:
    """Skip every item carrying a ``<prefix><arch>`` marker whose hardware is absent. Items
    without such a marker are untouched, and the hardware is probed only if one has one."""
    names = {f"{prefix}{a}": a for a in ARCH_REASONS}
    for item in items:
        for marker, arch in names.items():
            if item.get_closest_marker(marker) is not None:
                reason = arch_skip_reason(arch)
                if reason:
                    item.add_marker(pytest.mark.skip(reason=reason))
                    break


# ----------------------------------------------------------------------------- case parametrisation
CASES_MARKER = "dsv4_cases"
_CASES: dict[tuple[str, str], list] = {}


def _stage_cases(stage: str, size: str) -> list:
    key = (stage, size)
    if key not in _CASES:
        try:
            from dsv4_numerics.api.testing import cases as _cases
        except ModuleNotFoundError as e:  # the public API not in this build: the stage's default set
            if e.name != "dsv4_numerics.api.testing":
                raise
            _cases = None
        if _cases is not None:
            _CASES[key] = list(_cases(stage, size=size))
        else:
            from dsv4_numerics.reference.cases import default_cases

            if size != "default":
                raise ValueError(f"parametrize_cases: size={size!r} needs dsv4_numerics.api.testing (only 'default' here)")
            _CASES[key] = list(default_cases(stage))
    return _CASES[key]


def parametrize_cases(stage: str, *, size: str = "default", argname: str = "case"):
    """Decorator: parametrise a test over the canonical cases of ``stage`` (argument ``argname``
    gets a ``reference.cases.Case``; test ids are the case names). The cases are built when the
    test is collected (once per stage and size), not when the module is imported."""
    for arg, v in (("stage", stage), ("size", size), ("argname", argname)):
        if not isinstance(v, str) or not v:
            raise TypeError(f"parametrize_cases: argument {arg!r} must be a non-empty str (got {v!r})")
    return getattr(pytest.mark, CASES_MARKER)(stage, size=size, argname=argname)


def pytest_generate_tests(metafunc):
    for m in metafunc.definition.iter_markers(CASES_MARKER):
        stage = m.args[0] if m.args else m.kwargs["stage"]
        argname = m.kwargs.get("argname", "case")
        cases = _stage_cases(stage, m.kwargs.get("size", "default"))
        metafunc.parametrize(argname, cases, ids=[c.name for c in cases])


# ----------------------------------------------------------------------------- session state
@dataclass
class State:
    results: list = field(default_factory=list)  # oracles.report.Result
    skips: list[tuple[str, str]] = field(default_factory=list)  # (nodeid, reason)
    requirement_failures: list[str] = field(default_factory=list)
    requirements: list[dict] = field(default_factory=list)
    # nodeid -> pytest's status categories of its reports ("passed", "failed", "error", "skipped",
    # "xfailed", "xpassed"), as the terminal counts them; first failure line per nodeid
    outcomes: dict[str, list[str]] = field(default_factory=dict)
    longrepr: dict[str, str] = field(default_factory=dict)
    results_of: dict[str, list] = field(default_factory=dict)  # nodeid -> its Results
    crashed: dict[str, str] = field(default_factory=dict)  # nodeid -> xdist's line: its worker died in it
    config: Any = None
    writer: Any = None  # the xdist controller's report-writing thread (joined at unconfigure)
    writer_error: list = field(default_factory=list)  # the exception it raised, if any


_STATE_KEY = pytest.StashKey[State]()


def _state(config) -> State:
    st = config.stash.get(_STATE_KEY, None)
    if st is None:
        st = config.stash[_STATE_KEY] = State()
    return st


def results_of(config) -> list:
    """The Results collected so far in this pytest run (the controller's view under xdist)."""
    return list(_state(config).results)


# ----------------------------------------------------------------------------- hooks
def pytest_addoption(parser):
    group = parser.getgroup("dsv4-numerics")
    group.addoption("--dsv4-report", action="store", default=None, metavar="PATH",
                    help="write the dsv4-numerics Results collected during the session as JSON to PATH")
    group.addoption("--dsv4-require", action="append", default=[], metavar="ENTRY_OR_GLOB",
                    help="fail the session unless this kernel entry (or every entry matching the glob) got a "
                         "judged Result (pass/fail/error); repeatable; env DSV4_REQUIRE (comma-separated)")
    group.addoption("--dsv4-require-available", action="store_true", default=False,
                    help="fail the session unless every dsv4-numerics registry entry whose architectures match "
                         "the GPU present got a judged Result")
    group.addoption("--dsv4-isolate", action="store_true", default=False,
                    help="judge / assert_matches_reference / explain call kernels in a crash-isolated child "
                         "process unless a call says isolate=False (ini: dsv4_isolate)")
    parser.addini("dsv4_isolate", type="bool", default=False,
                  help="dsv4-numerics: judge kernels in a crash-isolated child by default (as --dsv4-isolate)")
    group.addoption("--dsv4-repro", action="store", default=None, metavar="DIR",
                    help="write a minimal standalone reproducer (dsv4_numerics.repro) of every case that judge "
                         "fails inside a test, into DIR/<test id>/<case>/")
    group.addoption("--dsv4-failures", action="store", default=None, metavar="PATH",
                    help="append each failed test's id and first error line to PATH as it fails (tab-separated), "
                         "so a run stopped by a time limit still names its failures")
    group.addoption("--dsv4-pin-gpus", action="store_true", default=False,
                    help="pin each xdist worker gwK to visible GPU K %% n via CUDA_VISIBLE_DEVICES "
                         "(env DSV4_PIN_GPUS=1; DSV4_NO_GPU_PINNING=1 turns it off)")


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config, parser, args):
    # runs before any conftest.py or test module is imported: the earliest place a plugin can
    # pin an xdist worker before CUDA could be initialised
    if _pinning_requested(early_config.known_args_namespace):
        pin_xdist_worker_to_gpu()


def pytest_configure(config):
    register_arch_markers(config, MARKER_PREFIX)
    config.addinivalue_line("markers", f"{CASES_MARKER}(stage, size='default', argname='case'): "
                                       "parametrise over a stage's canonical cases (parametrize_cases)")
    config.addinivalue_line("markers", f"{UNREPORTED_MARKER}: Results judged in this test are not attached to its "
                                       "report unless handed to dsv4_results (tests of deliberately wrong kernels)")
    if _pinning_requested(config.option):  # plugin loaded late (-p): still before test modules
        pin_xdist_worker_to_gpu()
    _state(config)
    _start_spool(config)
    if config.getoption("--dsv4-isolate", default=False) or config.getini("dsv4_isolate"):
        from dsv4_numerics.api import isolation  # imports torch: only when asked for

        config.stash[_ISOLATE_BEFORE] = isolation.set_default(True)


_ISOLATE_BEFORE = pytest.StashKey[bool]()  # the API's isolation default before this pytest run set it


def pytest_collection_modifyitems(config, items):
    apply_arch_skips(items, MARKER_PREFIX)


UNREPORTED_MARKER = "dsv4_unreported"
_ATTACHED = pytest.StashKey[list]()  # the Result objects already attached to an item


def attach_results(item, results) -> list:
    """Attach Results (one or a list) to ``item``'s report (its user properties, which travel to
    the xdist controller), each object once however often it is handed over. Returns the list."""
    from dsv4_numerics.oracles.report import Result, record

    rs = [results] if isinstance(results, Result) else list(results)
    for r in rs:
        if not isinstance(r, Result):
            raise TypeError(f"dsv4_results: expected oracles.report.Result objects (got {type(r).__name__})")
    done = item.stash.setdefault(_ATTACHED, [])
    for r in rs:
        if not any(r is x for x in done):
            done.append(r)
            record(r, lambda k, v: item.user_properties.append((k, v)))
            _spool(item.nodeid, r)
    return rs


# ----------------------------------------------------------------------------- crash spool (xdist)
# A test's Results normally reach the xdist controller with its reports. If the worker process
# dies inside the test (a segfaulting kernel, os._exit), those reports never come: so each worker
# also appends every attached Result to its own spool file, in a folder the controller made and
# handed to the workers (workerinput), and the controller takes from the spool the Results of the
# tests whose reports brought none.
_SPOOL_DIR = pytest.StashKey[str]()
_SPOOL_FILE: list[str | None] = [None]  # this worker's spool file


def _spool(nodeid: str, result) -> None:
    _spool_line({"nodeid": nodeid, "result": result.to_dict()})


def _spool_start(nodeid: str, call: dict) -> None:
    """A kernel call about to start in this test (``result_sink.announce``): if the worker dies
    in it, the controller reports an ``error`` for that kernel and case (:func:`recover_spooled`)."""
    _spool_line({"nodeid": nodeid, "start": call})


def _spool_line(doc: dict) -> None:
    path = _SPOOL_FILE[0]
    if path:
        import json

        with open(path, "a") as f:  # closed before the call: a crash after it cannot lose the line
            f.write(json.dumps(doc, allow_nan=False) + "\n")


@pytest.hookimpl(optionalhook=True)
def pytest_handlecrashitem(crashitem, report, sched):  # pytest-xdist, in the controller
    st = _LAST_STATE[0]  # this hook gets no config: the session's state
    if st is not None:
        st.crashed[crashitem] = str(report.longrepr)  # "worker 'gw0' crashed while running '...'"


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):  # pytest-xdist, in the controller, once per worker
    d = node.config.stash.get(_SPOOL_DIR, None)
    if d:
        node.workerinput["dsv4_spool"] = d


def _start_spool(config) -> None:
    wi = getattr(config, "workerinput", None)
    if wi is not None:  # a worker: spool into the controller's folder
        if wi.get("dsv4_spool"):
            _SPOOL_FILE[0] = os.path.join(wi["dsv4_spool"], f"{wi.get('workerid', 'gw')}-{os.getpid()}.jsonl")
    elif config.pluginmanager.hasplugin("xdist") and (
            config.getoption("--dsv4-report", default=None) or _required_patterns(config)
            or config.getoption("--dsv4-require-available", default=False)):
        import tempfile

        config.stash[_SPOOL_DIR] = tempfile.mkdtemp(prefix="dsv4-report-spool-")


def recover_spooled(st: "State", folder: str) -> int:
    """Add the spooled Results of tests whose reports brought none (their worker crashed), and
    for a test whose worker crashed (``st.crashed``, from xdist) while a kernel call it announced
    had no Result yet, an ``error`` Result (rule ``crash``) for that kernel, stage and case;
    returns how many Results were added. Removes the folder."""
    import glob
    import json
    import shutil

    from dsv4_numerics.oracles.report import Result

    delivered = set(st.results_of)  # tests whose reports brought their Results
    n = 0
    open_call: dict[str, dict | None] = {}  # nodeid -> its last announced call without a Result since
    for path in sorted(glob.glob(os.path.join(folder, "*.jsonl"))):
        with open(path) as f:
            lines = [json.loads(line) for line in f if line.strip()]
        for d in lines:
            nodeid = d["nodeid"]
            if nodeid in delivered:
                continue
            if "start" in d:
                open_call[nodeid] = d["start"]
                continue
            r = Result.from_dict(d["result"])
            st.results.append(r)
            st.results_of.setdefault(nodeid, []).append(r)
            n += 1
            c = open_call.get(nodeid)
            if c is not None and (c.get("entry"), c.get("stage"), c.get("case")) == (r.entry, r.stage, r.case):
                open_call[nodeid] = None
    for nodeid, c in open_call.items():
        if c is None or nodeid not in st.crashed:
            continue
        r = Result(entry=str(c.get("entry", "?")), stage=str(c.get("stage", "?")), case=str(c.get("case", "?")),
                   verdict="error", rule="crash", family=str(c.get("family", "")), device=str(c.get("device", "")),
                   policies={str(k): str(v) for k, v in (c.get("policies") or {}).items()},
                   message=f"the test process died while the kernel ran this case ({st.crashed[nodeid]}); "
                           f"judge with isolate=True (or run with --dsv4-isolate) to get the signal and let the "
                           f"other cases run")
        st.results.append(r)
        st.results_of.setdefault(nodeid, []).append(r)
        n += 1
    shutil.rmtree(folder, ignore_errors=True)
    return n


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    # every Result `judge` / `assert_matches_reference` produce while this test runs (setup, call,
    # teardown) is attached to it at once: a later raise, skip or failure cannot lose it
    from dsv4_numerics.api.result_sink import collecting, watching

    if item.get_closest_marker(UNREPORTED_MARKER) is not None:
        yield
        return
    repro_dir = item.config.getoption("--dsv4-repro", default=None)
    with collecting(lambda rs: attach_results(item, rs)), watching(lambda call: _spool_start(item.nodeid, call)), \
            _repro_sink(item, repro_dir):
        yield


def _repro_sink(item, folder):
    """``--dsv4-repro``'s per-test sink (``plugin.repro``); a no-op context without the option."""
    import contextlib

    if not folder:
        return contextlib.nullcontext()
    from dsv4_numerics.api.result_sink import JUDGED, collecting
    from dsv4_numerics.plugin.repro import sink_for

    return collecting(sink_for(item.nodeid, folder), kind=JUDGED)


@pytest.fixture
def dsv4_results(request):
    """Callable ``collect(results)``: attach Results (one or a list) to this test's report, for
    the session table, ``--dsv4-report`` and ``--dsv4-require``. Returns the list it was given.
    (Results of ``judge`` / ``assert_matches_reference`` called inside the test are attached
    without it, even when the test then fails; handing them over again changes nothing.)"""

    def collect(results):
        return attach_results(request.node, results)

    return collect


def pytest_runtest_logreport(report):
    st = _LAST_STATE[0]  # this hook gets no config: the session's state, set at session start
    if st is None:
        return
    if st.config is not None:
        cat = st.config.hook.pytest_report_teststatus(report=report, config=st.config)[0]
        if cat:  # what the terminal counts ("" for a passing setup or teardown)
            st.outcomes.setdefault(report.nodeid, []).append(cat)
            if report.failed and report.nodeid not in st.longrepr:
                st.longrepr[report.nodeid] = _first_line(report)
                _log_failure(st.config, report.nodeid, st.longrepr[report.nodeid])
    if report.skipped and report.when in ("setup", "call"):
        longrepr = report.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
        st.skips.append((report.nodeid, reason.removeprefix("Skipped: ")))
    # user properties accumulate on the item; read them once, from the teardown report
    if report.when == "teardown" and report.user_properties:
        import json

        from dsv4_numerics.oracles.report import RESULT_PROPERTY, Result

        for k, v in report.user_properties:
            if k == RESULT_PROPERTY:
                st.results.append(Result.from_dict(json.loads(v)))
                st.results_of.setdefault(report.nodeid, []).append(st.results[-1])


def _log_failure(config, nodeid: str, line: str) -> None:
    """Append ``nodeid<TAB>line`` to ``--dsv4-failures`` (in the xdist controller, or a run without
    xdist: each failure once), flushed at once."""
    path = config.getoption("--dsv4-failures", default=None)
    if not path or hasattr(config, "workerinput"):
        return
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(f"{nodeid}\t{line}\n")


def _first_line(report) -> str:
    text = str(getattr(report, "longreprtext", "") or report.longrepr or "")
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    # the exception line ("E   AssertionError: ...") says most; else the last line
    e = next((ln for ln in lines if ln.startswith("E ")), None)
    return (e[1:].strip() if e else lines[-1] if lines else report.outcome)[:300]


_LAST_STATE: list[State | None] = [None]


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session):
    _LAST_STATE[0] = _state(session.config)
    _LAST_STATE[0].config = session.config


def _required_patterns(config) -> list[str]:
    pats = list(config.getoption("--dsv4-require", default=None) or [])
    env = os.environ.get(ENV_REQUIRE, "")
    pats += [p.strip() for p in env.split(",") if p.strip()]
    return list(dict.fromkeys(pats))


def _known_entries() -> dict[str, Any]:
    """Built-in registry, installed external entries and those of the sources in
    ``DSV4_ENTRIES_FROM`` (``os.pathsep``-separated .py files / modules), by name."""
    out: dict[str, Any] = {}
    try:
        from dsv4_numerics.kernels import registry

        out.update({e.name: e for e in registry.all_entries()})
    except Exception:  # noqa: BLE001 - the requirement check must still report
        pass
    try:
        from dsv4_numerics.api import external

        sources = [x for x in os.environ.get(external.ENV_ENTRIES_FROM, "").split(os.pathsep) if x]
        provided, _ = external.collect(sources, include_installed=True)
        out.update({p.entry.name: p.entry for p in provided if p.entry.name not in out})
    except Exception:  # noqa: BLE001
        pass
    return out


def evaluate_requirements(results: list, skips: list[tuple[str, str]], patterns: list[str],
                          require_available: bool) -> tuple[list[dict], list[str]]:
    """``(requirements, failures)``: one dict per (pattern, entry) with ``ok`` and ``reason``,
    and one line per unmet requirement (``runner.requirements``, judged as the Results say)."""
    from dsv4_numerics.oracles.report import JUDGED
    from dsv4_numerics.runner import requirements

    judged: dict[str, int] = {}
    seen: dict[str, list[str]] = {}
    for r in results:
        seen.setdefault(r.entry, []).append(r.verdict)
        if r.verdict in JUDGED:
            judged[r.entry] = judged.get(r.entry, 0) + 1
    known = _known_entries() if (patterns or require_available) else {}
    names = list(dict.fromkeys([*known, *seen]))
    wanted: list[tuple[str, str]] = []
    failures: list[str] = []
    from dsv4_numerics.kernels.registry import match_patterns

    for pat, hits in match_patterns(patterns, names).items():
        if not hits:
            failures.append(f"--dsv4-require: required {pat!r} matches no kernel entry (none registered, installed "
                            "or reported by a test)")
        wanted += [(pat, n) for n in hits]
    if require_available:
        from dsv4_numerics.kernels import registry

        fit = requirements.fitting_names(registry.all_entries())
        if not fit:
            failures.append(requirements.no_fit_failure("--dsv4-require-available", "registry"))
        wanted += [("--dsv4-require-available", name) for name in fit]
    reqs, unmet = requirements.outcome(
        wanted, lambda name: judged.get(name, 0),
        lambda name: _why_not_judged(name, known.get(name), seen.get(name, []), skips),
        "required entry {entry} was not judged: {reason}")
    return reqs, failures + unmet


def _why_not_judged(name: str, entry: Any, verdicts: list[str], skips: list[tuple[str, str]]) -> str:
    if entry is not None:
        ok, reason = entry.available()
        if not ok:
            return f"unavailable: {reason}"
    skip = next((r for nid, r in skips if name in nid or name in r), None)
    if verdicts:
        return f"all {len(verdicts)} Results were skips" + (f" ({skip})" if skip else "")
    if skip:
        return f"its tests were skipped: {skip}"
    return "no test attached a Result for it (dsv4_results)"


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session, exitstatus):
    config = session.config
    if hasattr(config, "workerinput"):  # an xdist worker: the controller judges and writes
        return
    st = _state(config)
    spool = config.stash.get(_SPOOL_DIR, None)
    if spool:  # Results of tests whose xdist worker crashed
        recover_spooled(st, spool)
    patterns = _required_patterns(config)
    req_avail = bool(config.getoption("--dsv4-require-available", default=False))
    if patterns or req_avail:
        st.requirements, st.requirement_failures = evaluate_requirements(st.results, st.skips, patterns, req_avail)
        if st.requirement_failures and int(session.exitstatus) in (0, 5):  # OK or no tests collected
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
    st.results.extend(outcome_results(st))
    path = config.getoption("--dsv4-report", default=None)
    if not path:
        return
    if not config.pluginmanager.hasplugin("dsession"):
        write_report(config, st, path, int(session.exitstatus))
        return
    # The xdist controller: its own sessionfinish (after this one) tells the workers to exit and
    # waits for them -- seconds, the driver releasing their CUDA contexts one process at a time.
    # The report (its run metadata, the JSON) is written meanwhile, in a thread that
    # pytest_unconfigure joins, so the workers' exit does not wait for it.
    import threading

    def write(status: int = int(session.exitstatus)) -> None:
        try:
            write_report(config, st, path, status)
        except BaseException as e:  # noqa: BLE001 - raised again at unconfigure
            st.writer_error.append(e)

    st.writer = threading.Thread(target=write, name="dsv4-report-writer", daemon=True)
    st.writer.start()


@pytest.hookimpl(tryfirst=True)
def pytest_unconfigure(config):
    """The xdist controller's report is written by now (:func:`pytest_sessionfinish`'s thread);
    its error, if any, is raised here. The API's isolation default is restored."""
    if _ISOLATE_BEFORE in config.stash:
        from dsv4_numerics.api import isolation

        isolation.set_default(config.stash[_ISOLATE_BEFORE])
    st = config.stash.get(_STATE_KEY, None)
    if st is None or st.writer is None:
        return
    st.writer.join()
    st.writer = None
    if st.writer_error:
        raise st.writer_error.pop()


def outcome_results(st: State) -> list:
    """The report is never greener than the run: for each test pytest reported ``failed`` or
    ``error`` whose own Results are all pass or skip (it failed for another reason after
    judging), one ``error`` Result (rule ``test_outcome``) on its first Result's entry, stage and
    case, naming the test and its failure. Called once, at the end of the session."""
    from dsv4_numerics.oracles.report import Result, Verdict

    out = []
    for nodeid, rs in st.results_of.items():
        bad = [c for c in st.outcomes.get(nodeid, []) if c in ("failed", "error")]
        if bad and not any(r.verdict.bad for r in rs):
            r0 = rs[0]
            out.append(Result(entry=r0.entry, stage=r0.stage, case=r0.case, verdict=Verdict.ERROR, rule="test_outcome",
                              message=f"pytest: {nodeid} {bad[0]} after its Results passed: "
                                      f"{st.longrepr.get(nodeid, '')}",
                              family=r0.family, device=r0.device, policies=dict(r0.policies)))
    return out


def outcome_counts(st: State) -> tuple[dict[str, int], dict[str, int]]:
    """``(all, with_results)``: pytest's outcome counts (its terminal's categories) over every
    test, and over the tests that attached Results."""
    every: dict[str, int] = {}
    judged: dict[str, int] = {}
    for nodeid, cats in st.outcomes.items():
        for c in cats:
            every[c] = every.get(c, 0) + 1
            if nodeid in st.results_of:
                judged[c] = judged.get(c, 0) + 1
    return every, judged


def write_report(config, st: State, path: str, exitstatus: int) -> None:
    from dsv4_numerics.oracles.report import JUDGED, write_json
    from dsv4_numerics.report.run_meta import run_metadata

    every, with_results = outcome_counts(st)
    meta: dict[str, Any] = {**run_metadata(), "exitstatus": exitstatus,
                            "judged": sum(r.verdict in JUDGED for r in st.results),
                            "tests": every, "tests_with_results": with_results,
                            "requirements": st.requirements, "requirement_failures": st.requirement_failures}
    meta["hardware_markers"] = hardware()
    write_json(st.results, path, meta)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    from dsv4_numerics.plugin.repro import summary

    summary(terminalreporter)
    st = config.stash.get(_STATE_KEY, None)
    if st is None:
        return
    if st.results:
        from dsv4_numerics.oracles.report import JUDGED, summary_table

        terminalreporter.section("dsv4-numerics matrix")
        terminalreporter.write_line(summary_table(st.results))
        n = sum(r.verdict in JUDGED for r in st.results)
        terminalreporter.write_line(f"dsv4-numerics: {len(st.results)} Results, {n} judged (pass+fail+error)")
    if st.requirement_failures:
        terminalreporter.section("dsv4-numerics requirements", red=True)
        for line in st.requirement_failures:
            terminalreporter.write_line(f"FAILED {line}", red=True)
    elif st.requirements:
        terminalreporter.write_line(f"dsv4-numerics: all {len(st.requirements)} required entries judged")
