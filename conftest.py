"""Root pytest configuration: hypothesis profiles, hardware markers, one xdist worker per GPU.

Hypothesis profiles (``--hypothesis-profile NAME``):
  ci       default; derandomized (deterministic), bounded example counts, no deadline
  dev      more examples, random seeds, no deadline
  nightly  many more examples

Markers (registered, each skips with a reason when the hardware is absent):
  gpu    any CUDA or ROCm device      sm90   compute capability 9.x (H100/H200)
  sm100  compute capability 10.x      sm120  compute capability 12.x
  rocm   a ROCm (HIP) build of PyTorch with a device

GPU pinning: under ``pytest -n N`` each xdist worker ``gwK`` gets ``CUDA_VISIBLE_DEVICES`` set to
GPU ``K % num_gpus`` here, at conftest import time, before anything initialises CUDA. Set
``DSV4_NO_GPU_PINNING=1`` to keep the inherited visibility.
"""

from __future__ import annotations

import os
import re
import subprocess


def _visible_gpu_ids() -> list[str]:
    """GPU ids visible to this process, found without initialising CUDA."""
    inherited = os.environ.get("CUDA_VISIBLE_DEVICES")
    if inherited is not None:
        return [d for d in inherited.split(",") if d.strip() != ""]
    try:
        nodes = sorted(n for n in os.listdir("/dev") if re.fullmatch(r"nvidia\d+", n))
    except OSError:
        nodes = []
    if nodes:
        return [str(i) for i in range(len(nodes))]
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10)
        return [str(i) for i, line in enumerate(out.stdout.splitlines()) if line.startswith("GPU ")]
    except (OSError, subprocess.SubprocessError):
        return []


def _pin_xdist_worker_to_gpu() -> None:
    worker = os.environ.get("PYTEST_XDIST_WORKER")  # "gw0", "gw1", ...
    if not worker or os.environ.get("DSV4_NO_GPU_PINNING") == "1":
        return
    ids = _visible_gpu_ids()
    if not ids:
        return
    k = int(worker[2:]) if worker[2:].isdigit() else 0
    os.environ["CUDA_VISIBLE_DEVICES"] = ids[k % len(ids)]
    os.environ["DSV4_PINNED_GPU"] = ids[k % len(ids)]


_pin_xdist_worker_to_gpu()

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
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
except ImportError:  # hypothesis is in the `test` extra; the CLI does not need it
    pass

_ARCH_MARKERS = {
    "gpu": "needs a CUDA or ROCm GPU",
    "sm90": "needs an SM90 GPU (compute capability 9.x: H100/H200)",
    "sm100": "needs an SM100 GPU (compute capability 10.x: B200/GB200)",
    "sm120": "needs an SM120 GPU (compute capability 12.x: RTX Pro 6000 / DGX Spark)",
    "rocm": "needs a ROCm build of PyTorch with an AMD GPU",
}


def pytest_configure(config):
    for name, reason in _ARCH_MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {reason}; skipped with a reason otherwise")
    config.addinivalue_line("markers", "slow: long-running; still part of the default run")


def _hardware() -> dict:
    import torch

    info = {"gpu": False, "major": None, "rocm": False, "name": None}
    if torch.cuda.is_available():
        info["gpu"] = True
        info["rocm"] = torch.version.hip is not None
        info["major"] = torch.cuda.get_device_capability()[0]
        info["name"] = torch.cuda.get_device_name()
    return info


_HW: dict | None = None


def hardware() -> dict:
    global _HW
    if _HW is None:
        _HW = _hardware()
    return _HW


def arch_skip_reason(marker: str) -> str | None:
    """The reason a test carrying ``marker`` cannot run here, or None if it can."""
    hw = hardware()
    found = f"found {hw['name']}" if hw["gpu"] else "no GPU visible"
    if marker == "gpu":
        return None if hw["gpu"] else f"{_ARCH_MARKERS['gpu']} ({found})"
    if marker == "rocm":
        return None if hw["rocm"] else f"{_ARCH_MARKERS['rocm']} ({found})"
    major = {"sm90": 9, "sm100": 10, "sm120": 12}[marker]
    if hw["gpu"] and not hw["rocm"] and hw["major"] == major:
        return None
    return f"{_ARCH_MARKERS[marker]} ({found})"


def pytest_collection_modifyitems(config, items):
    for item in items:
        for marker in _ARCH_MARKERS:
            if item.get_closest_marker(marker) is not None:
                reason = arch_skip_reason(marker)
                if reason:
                    item.add_marker(pytest.mark.skip(reason=reason))
                    break


# --------------------------------------------------------------------------- matrix reporting
# (oracles owner) Tests hand oracles.report.Result objects to the `matrix_results` fixture; each
# Result is attached to the test as JUnit properties (key figures + the full Result as JSON).
# The properties travel with the test report, so the session collector below sees results from
# pytest-xdist workers too. At the end: a kernel x case table in the terminal summary, and the
# JSON report with `--dsv4-report PATH`.


def pytest_addoption(parser):
    group = parser.getgroup("dsv4-numerics")
    group.addoption(
        "--dsv4-report", action="store", default=None, metavar="PATH",
        help="write the matrix Results collected during the session as a JSON report to PATH",
    )


_DSV4_COLLECTOR = None


def _dsv4_collector():
    global _DSV4_COLLECTOR
    if _DSV4_COLLECTOR is None:
        from dsv4_numerics.oracles.report import ResultCollector

        _DSV4_COLLECTOR = ResultCollector()
    return _DSV4_COLLECTOR


@pytest.fixture
def matrix_results(record_property):
    """Callable ``collect(results)``: attach Results (one or a list) to this test's report.

    Returns the list it was given, so ``collect(run_entry(entry))`` can be asserted on directly.
    """
    from dsv4_numerics.oracles.report import Result, record

    def collect(results):
        rs = [results] if isinstance(results, Result) else list(results)
        for r in rs:
            record(r, record_property)
        return rs

    return collect


def pytest_runtest_logreport(report):
    # user properties accumulate on the item; read them once, from the teardown report
    if report.when == "teardown" and report.user_properties:
        _dsv4_collector().add_from_user_properties(report.user_properties)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    col = _DSV4_COLLECTOR
    if col is None or not col.results:
        return
    terminalreporter.section("dsv4-numerics matrix")
    terminalreporter.write_line(col.table())


def pytest_sessionfinish(session, exitstatus):
    if hasattr(session.config, "workerinput"):  # an xdist worker: the controller writes
        return
    path = session.config.getoption("--dsv4-report", default=None)
    if not path:
        return
    import platform

    meta = {"exitstatus": int(exitstatus), "python": platform.python_version(), "hardware": hardware()}
    try:
        import torch

        meta["torch"] = torch.__version__
    except ImportError:  # pragma: no cover
        pass
    _dsv4_collector().write(path, meta)
