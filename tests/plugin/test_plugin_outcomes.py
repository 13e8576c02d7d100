"""The plugin's report is never greener than the run: a foreign project whose
tests judge with the public API and then fail in every way a test can -- ``assert_matches_reference``
raising (the Results never reach ``dsv4_results``), a test failing for its own reasons after its
Results passed, a test skipping after judging, the xdist worker dying inside a test -- and the
report's counts equal pytest's.
Run in a subprocess outside this repository's conftest (``test_plugin.write_suite``)."""

from __future__ import annotations

import json
import re

import pytest

from tests.plugin.test_plugin import run_pytest, write_suite

SUITE = {
    "test_outcomes.py": '''
        import pytest
        import dsv4_numerics as dn
        from dsv4_numerics.oracles import stages as st
        from dsv4_numerics.plugin.hooks import parametrize_cases

        STAGE = "swa_indices"  # an index stage: cases and judging take milliseconds
        SPEC = st.STAGES[STAGE]
        CASES = dn.cases(STAGE)
        BY = {c.name: c for c in CASES}

        def good(inputs):  # a stand-in kernel: the reference's own outputs
            e = SPEC.expected(BY[inputs.name], dict(SPEC.defaults))
            return {k: v for k, v in e.items() if not k.startswith("_")}

        def off_by_one(inputs):
            o = good(inputs)
            k = sorted(o)[0]
            o[k] = o[k] + 1
            return o

        @parametrize_cases("swa_indices", size="small")
        def test_good(case, dsv4_results):
            dsv4_results(dn.assert_matches_reference(good, STAGE, cases=[case]))

        def test_assert_fails(dsv4_results):  # raises before dsv4_results is called
            dsv4_results(dn.assert_matches_reference(off_by_one, STAGE, cases=CASES[:1]))

        def test_fails_after_passing_results():
            dn.judge(good, STAGE, cases=CASES[1:2])
            raise RuntimeError("the test's own check failed")

        def test_skips_after_judging():
            dn.judge(off_by_one, STAGE, cases=CASES[2:3])
            pytest.skip("decided after judging")

        def test_worker_crashes_after_judging():  # the xdist worker dies: its reports never come
            import os
            dn.judge(good, STAGE, cases=CASES[3:4])
            os._exit(3)

        def test_without_results():
            pass

        @pytest.mark.dsv4_unreported
        def test_catches_a_wrong_kernel():  # opted out: its deliberate failures are not the matrix
            assert not dn.judge(off_by_one, STAGE, cases=CASES[4:5])[0].ok
    ''',
}


def _counts(stdout: str) -> dict[str, int]:
    line = [l for l in stdout.splitlines() if re.search(r"\d+ (passed|failed)", l)][-1]
    return {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed)", line)}


@pytest.mark.slow  # scheduled first under xdist (root conftest): one of the suite's longest tests
def test_report_counts_equal_pytests_and_failures_are_never_lost(tmp_path):
    write_suite(tmp_path, SUITE)
    r = run_pytest(tmp_path, "--dsv4-report", "r.json", "-n", "2", "--dsv4-failures", "failures.txt")
    assert r.returncode == 1, r.stdout + r.stderr
    pytest_counts = _counts(r.stdout)
    assert pytest_counts == {"passed": 4, "failed": 3, "skipped": 1}, r.stdout
    # --dsv4-failures: each failed test once, as it failed, with its first error line
    logged = dict(ln.split("\t", 1) for ln in (tmp_path / "failures.txt").read_text().splitlines())
    assert sorted(k.split("::")[1] for k in logged) == ["test_assert_fails", "test_fails_after_passing_results",
                                                       "test_worker_crashes_after_judging"], logged
    assert "the test's own check failed" in logged["test_outcomes.py::test_fails_after_passing_results"]
    d = json.loads((tmp_path / "r.json").read_text())
    meta = d["meta"]
    assert meta["tests"] == pytest_counts and meta["exitstatus"] == 1
    # every test but test_without_results and the opted-out one attached Results
    assert meta["tests_with_results"] == {"passed": 2, "failed": 3, "skipped": 1}
    got = sorted((x["entry"], x["case"], x["verdict"], x["rule"]) for x in d["results"])
    G, B = "user.test_outcomes.good", "user.test_outcomes.off_by_one"
    c0, c1, c2, c3 = ("decode-bs64-w128-window-starts-at-0-padding", "prefill-paged-bs61-token-offset",
                      "window16-bs2-starts-at-0", "decode-bs256-long-context")
    assert got == sorted([
        (G, c0, "pass", "exact"), (G, c1, "pass", "exact"),  # test_good x2
        (B, c0, "fail", "swa_indices:exact"),  # the raising assert: its Result is kept
        (G, c1, "pass", "exact"),  # the test that failed after its Result passed ...
        (G, c1, "error", "test_outcome"),  # ... adds an error naming it
        (B, c2, "fail", "swa_indices:exact"),  # skipped after judging: the failure stays
        (G, c3, "pass", "exact"),  # judged before its worker crashed: from the worker's spool ...
        (G, c3, "error", "test_outcome"),  # ... and the crash as an error
    ]), got
    assert d["summary"] == {"pass": 4, "fail": 2, "skip": 0, "error": 2}
    outcome = {x["case"]: x["message"] for x in d["results"] if x["rule"] == "test_outcome"}
    assert "test_fails_after_passing_results failed" in outcome[c1]
    assert "RuntimeError: the test's own check failed" in outcome[c1]
    assert "test_worker_crashes_after_judging failed" in outcome[c3] and "crashed" in outcome[c3]
    # as many failing tests as failing (fail + error) cells: the report is not greener than the run
    assert d["summary"]["fail"] + d["summary"]["error"] >= pytest_counts["failed"]
    for key in ("arch", "device", "torch", "cuda", "triton", "staged", "git_commit", "python"):
        assert key in meta, key
    assert meta["arch"] == "cpu" or meta["device"] == "cuda"
