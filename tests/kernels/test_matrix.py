"""The kernel matrix: every registry entry x the case set of its stage (the default set;
``DSV4_CASES=full``: the full set, ``case_files.stage_cases_file``).

Test ids read ``<entry>-<case>`` (e.g. ``flashmla.sparse_decode.sm90-h64-swa128-...``).

* An entry whose probe says it cannot run here is a SKIP carrying the probe's reason: the
  specific one (a missing package and version, the architecture found, a library that fails to
  load). Without a GPU the whole probe runs at collection (GPU entries stop at the architecture,
  nothing is imported). On a GPU host collection checks only the architecture and the entry's
  isolated child runs the probe (``run_isolated(probe=True)``): the production modules (Triton,
  the FlashMLA and CUDA libraries, ~18 s of the GPU suite's wall time when all 16 workers imported
  them at once) are imported by the children that run the kernels, not by every xdist worker.
* An available entry runs all its cases once, in child processes (``kernel_results`` fixture,
  ``dsv4_numerics/runner/pool.py``): a crash or hang fails only the case it happened in.
* Each case is judged by ``oracles.matrix.run_entry`` (bytes stages bit-exact under the entry's
  declared policies, index stages exact, attention by tolerance records) and its ``Result`` is
  attached to the test report (``matrix_results``), so the session table and the JSON report
  show every judged case.
* Items carry the hardware markers of their entry (``gpu``, ``sm90``, ...) for ``-m`` selection
  and an ``xdist_group`` per entry (per case group of ``conftest.GROUP_CASES`` cases for the
  attention stages, ``conftest.case_groups``), so ``pytest -n N --dist loadgroup`` keeps a group
  on one worker (one GPU) and runs it once in that worker's child.
"""

from __future__ import annotations

import pytest

from dsv4_numerics.kernels import registry
from dsv4_numerics.kernels.probe import arch_reason, gpu_info
from dsv4_numerics.runner.pool import UNAVAILABLE
from dsv4_numerics.oracles.report import Result
from dsv4_numerics.runner.case_files import case_names

from .conftest import case_groups, group_name


def collection_reason(entry) -> str | None:
    """Why ``entry`` cannot run here, as far as collection asks (module docstring): the whole
    probe without a GPU, the architecture alone with one (its child probes the rest)."""
    if gpu_info().present:
        return arch_reason(entry.archs)
    ok, reason = entry.available()
    return None if ok else reason


def _params():
    out = []
    cache: dict[str, list] = {}  # a stage's case names (the case file's sidecar): once per stage
    for entry in registry.all_entries():
        marks = [getattr(pytest.mark, m) for m in entry.markers]
        reason = collection_reason(entry)
        skip = [] if not reason else [pytest.mark.skip(reason=f"{entry.name}: {reason}")]
        try:
            if entry.stage not in cache:
                # built once, single-threaded, on disk for every xdist worker and kernel child
                cache[entry.stage] = case_names(entry.stage)
            names = cache[entry.stage]
        except KeyError as e:
            out.append(pytest.param(entry.name, None, 0, id=f"{entry.name}-no-cases",
                                    marks=[pytest.mark.skip(reason=str(e))]))
            continue
        groups = case_groups(entry, names)
        for g, names in enumerate(groups):
            gmarks = [pytest.mark.xdist_group(group_name(entry.name, g, len(groups)))]
            for name in names:
                out.append(pytest.param(entry.name, name, g, id=f"{entry.name}-{name}", marks=skip + marks + gmarks))
    return out


PARAMS = _params()


def _as_result(entry, case_name: str, res: dict) -> Result:
    if all(k in res for k in ("entry", "stage", "case", "verdict")):
        return Result.from_dict(res)
    # synthetic results of the isolation layer (crash, timeout, setup error, not run)
    return Result(entry=entry.name, stage=entry.stage, case=case_name,
                  verdict="error" if res.get("verdict") not in ("pass", "fail", "skip") else res["verdict"],
                  rule=res.get("rule", ""), message=res.get("message", ""), family=entry.family,
                  policies=dict(entry.policies))


@pytest.mark.skipif(not PARAMS, reason="no kernel entries registered")
@pytest.mark.parametrize("entry_name,case_name,group", PARAMS or [pytest.param(None, None, 0, id="none")])
def test_kernel_case(entry_name, case_name, group, kernel_results, matrix_results):
    entry = registry.get(entry_name)
    results = kernel_results(entry_name, group)  # the child probes the entry first
    if UNAVAILABLE in results:
        pytest.skip(f"{entry.name}: {results[UNAVAILABLE]['message']}")
    res = results.get(case_name)
    assert res is not None, f"{entry_name}: no result for case {case_name}"
    result = _as_result(entry, case_name, res)
    matrix_results(result)
    if result.verdict == "skip":
        pytest.skip(result.line())
    if result.verdict != "pass":
        pytest.fail(result.line(), pytrace=False)
