"""The plugin's report is never greener than the run (issue 24, item 4): a foreign project whose
tests judge with the public API and then fail in every way a test can -- ``assert_matches_reference``
raising (the Results never reach ``dsv4_results``), a test failing for its own reasons after its
Results passed, a test skipping after judging -- and the report's counts equal pytest's.
Run in a subprocess outside this repository's conftest (``test_plugin._suite``)."""

from __future__ import annotations

import json
import re

from tests.plugin.test_plugin import _pytest, _suite

SUITE = {
    "test_outcomes.py": '''
        import pytest
        import dsv4_numerics as dn
        from dsv4_numerics.oracles import stages as st
        from dsv4_numerics.pytest_plugin import parametrize_cases

        SPEC = st.STAGES["rope"]
        CASES = dn.cases("rope")
        BY = {c.name: c for c in CASES}

        def good(inputs):  # a stand-in kernel: the reference's own outputs
            e = SPEC.expected(BY[inputs.name], dict(SPEC.defaults))
            return {k: v for k, v in e.items() if not k.startswith("_")}

        def one_percent_high(inputs):
            o = good(inputs)
            o["out"] = o["out"] * 1.01
            return o

        @parametrize_cases("rope", size="small")
        def test_good(case, dsv4_results):
            dsv4_results(dn.assert_matches_reference(good, "rope", cases=[case]))

        def test_assert_fails(dsv4_results):  # raises before dsv4_results is called
            dsv4_results(dn.assert_matches_reference(one_percent_high, "rope", cases=CASES[:1]))

        def test_fails_after_passing_results():
            dn.judge(good, "rope", cases=CASES[1:2])
            raise RuntimeError("the test's own check failed")

        def test_skips_after_judging():
            dn.judge(one_percent_high, "rope", cases=CASES[2:3])
            pytest.skip("decided after judging")

        def test_without_results():
            pass
    ''',
}


def _counts(stdout: str) -> dict[str, int]:
    line = [l for l in stdout.splitlines() if re.search(r"\d+ (passed|failed)", l)][-1]
    return {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed)", line)}


def test_report_counts_equal_pytests_and_failures_are_never_lost(tmp_path):
    _suite(tmp_path, SUITE)
    r = _pytest(tmp_path, "--dsv4-report", "r.json")
    assert r.returncode == 1, r.stdout + r.stderr
    pytest_counts = _counts(r.stdout)
    assert pytest_counts == {"passed": 3, "failed": 2, "skipped": 1}, r.stdout
    d = json.loads((tmp_path / "r.json").read_text())
    meta = d["meta"]
    assert meta["tests"] == pytest_counts and meta["exitstatus"] == 1
    # every test but test_without_results attached Results
    assert meta["tests_with_results"] == {"passed": 2, "failed": 2, "skipped": 1}
    got = sorted((x["entry"], x["case"], x["verdict"], x["rule"]) for x in d["results"])
    G, B = "user.test_outcomes.good", "user.test_outcomes.one_percent_high"
    c0, c1, c2 = "plain-theta1e4-2048rows", "yarn-theta1.6e5-far-positions", "plain-per-head-broadcast"
    assert got == sorted([
        (G, c0, "pass", "bit_exact"), (G, c1, "pass", "bit_exact"),  # test_good x2
        (B, c0, "fail", "bit_exact"),  # the raising assert: its Result is kept
        (G, c1, "pass", "bit_exact"),  # the test that failed after its Result passed ...
        (G, c1, "error", "test_outcome"),  # ... adds an error naming it
        (B, c2, "fail", "bit_exact"),  # skipped after judging: the failure stays
    ]), got
    assert d["summary"] == {"pass": 3, "fail": 2, "skip": 0, "error": 1}
    outcome = next(x for x in d["results"] if x["rule"] == "test_outcome")
    assert "test_fails_after_passing_results failed" in outcome["message"]
    assert "RuntimeError: the test's own check failed" in outcome["message"]
    # as many failing tests as failing (fail + error) cells: the report is not greener than the run
    assert d["summary"]["fail"] + d["summary"]["error"] >= pytest_counts["failed"]
    for key in ("arch", "device", "torch", "cuda", "triton", "staged", "git_commit", "python"):
        assert key in meta, key
    assert meta["arch"] == "cpu" or meta["device"] == "cuda"
