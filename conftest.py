"""Root pytest configuration of this repository: hypothesis profiles, our unprefixed hardware
markers, one xdist worker per GPU by default, and ``matrix_results``.

Everything a foreign project can use lives in the pytest plugin ``dsv4_numerics.pytest_plugin``
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
visibility. ``.ci/gpu-matrix`` relies on it.
"""

from __future__ import annotations

import os
import sys

from dsv4_numerics import pytest_plugin as _plugin

_plugin.pin_xdist_worker_to_gpu()


def _share_cpu_threads_between_xdist_workers() -> None:
    """Under ``pytest -n N`` give each worker ``cpus // N`` intra-op threads (at least 1), unless
    the user chose (``OMP_NUM_THREADS`` set). N workers each spinning ``cpus`` OpenMP threads
    oversubscribe the machine: building the decode cases took 15.7 s at 2 threads against 0.6 s
    at 1 on a busy 2-core box. Results do not depend on it (the reference has a fixed reduction
    order; derivation tests set their own thread counts)."""
    n = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not n or not n.isdigit() or "OMP_NUM_THREADS" in os.environ:
        return
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(n)))


_share_cpu_threads_between_xdist_workers()

import pytest  # noqa: E402

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
    config.addinivalue_line("markers", "slow: long-running; still part of the default run")


def hardware() -> dict:
    return _plugin.hardware()


def arch_skip_reason(marker: str) -> str | None:
    """The reason a test carrying ``marker`` cannot run here, or None if it can."""
    return _plugin.arch_skip_reason(marker)


def pytest_collection_modifyitems(config, items):
    _plugin.apply_arch_skips(items, "")
    longest_first(items)


def _group(item) -> str | None:
    m = item.get_closest_marker("xdist_group")
    return (m.kwargs.get("name") or (m.args[0] if m.args else None)) if m else None


def longest_first(items) -> None:
    """Schedule the long units first (in place, deterministic): pytest-xdist hands scopes out in
    collection order, and a 30 s test or a 6-case kernel group (one child, one worker) that comes
    last is the run's tail -- on one H200 the last worker finished 26 s after the median one
    (``.ci/gpu-scaling``'s timeline). Order: tests marked ``slow`` (single tests of 15-35 s on a
    loaded GPU host); then xdist groups that hold at least one runnable item, largest first;
    then the rest as collected. Skipped items keep their relative place."""
    sizes: dict[str, int] = {}
    for it in items:
        g = _group(it)
        if g is not None and not it.get_closest_marker("skip"):
            sizes[g] = sizes.get(g, 0) + 1

    def key(it):  # list.sort is stable: items of equal key keep their collected order
        g = _group(it)
        if it.get_closest_marker("slow") and not it.get_closest_marker("skip"):
            return (0, 0, "")
        if g in sizes:
            return (1, -sizes[g], g)
        return (2, 0, "")

    items.sort(key=key)


@pytest.fixture
def matrix_results(dsv4_results):
    """Our tests' name for the plugin's ``dsv4_results``: ``collect(results)`` attaches Results
    (one or a list) to this test's report and returns the list it was given."""
    return dsv4_results


# ----------------------------------------------------------------------------- suite timeline
# DSV4_TIMELINE=DIR (set by .ci/gpu-scaling): every process (xdist worker or a plain run) appends
# one line per test phase to DIR/<worker>.tsv -- "<start> <end> <phase> <nodeid>" in seconds since
# the epoch -- plus "<t> <t> sessionstart -" when it starts, so a run's wall time splits into worker
# start-up and collection, test time and idle time (python -m dsv4_numerics.timeline DIR).
_TIMELINE = os.environ.get("DSV4_TIMELINE")
if _TIMELINE:
    import time as _time

    def _timeline_write(start: float, end: float, what: str, nodeid: str) -> None:
        os.makedirs(_TIMELINE, exist_ok=True)
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        with open(os.path.join(_TIMELINE, f"{worker}.tsv"), "a") as f:
            f.write(f"{start:.3f}\t{end:.3f}\t{what}\t{nodeid}\n")

    _timeline_write(_time.time(), _time.time(), "sessionstart", "-")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        t0 = _time.time()
        yield
        _timeline_write(t0, _time.time(), "test", item.nodeid)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_collection(session):
        t0 = _time.time()
        yield
        _timeline_write(t0, _time.time(), "collection", "-")


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
    if _DEVICE_FAULT or torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return result
    try:
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - any asynchronous device error
        _DEVICE_FAULT.append(item.nodeid)
        raise RuntimeError(f"a device fault surfaced at the end of this test (a kernel it launched "
                           f"faulted asynchronously; later GPU tests of this process fail with it): "
                           f"{type(e).__name__}: {e}") from e
    return result

