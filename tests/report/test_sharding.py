"""Sharding: a suite split over N jobs with pytest-split (``--splits N
--group K``), each shard writing its own ``--dsv4-report``, merges into the same matrix as one
run of the whole suite. Run as a foreign project in subprocesses (``tests/plugin/test_plugin``)."""

from __future__ import annotations

import json

import pytest

from dsv4_numerics.report.merge import merge_reports
from tests.plugin.test_plugin import run_pytest, write_suite

pytest.importorskip("pytest_split", reason="pytest-split is not installed (pip install pytest-split)")

SUITE = {
    "test_matrix.py": '''
        import pytest
        from dsv4_numerics.oracles.report import Result

        CASES = ["c1", "c2", "c3"]

        @pytest.mark.parametrize("entry", ["k.alpha", "k.beta", "k.gamma"])
        @pytest.mark.parametrize("case", CASES)
        def test_case(entry, case, dsv4_results):
            bad = entry == "k.gamma" and case == "c2"
            dsv4_results(Result(entry=entry, stage="decode", case=case, verdict="fail" if bad else "pass",
                                rule="numeric", worst_ulps=float(len(entry) + CASES.index(case)),
                                headroom=0.5 if bad else 4.0 - CASES.index(case)))
            assert not bad
    ''',
}


def _cells(m):
    """The matrix without run labels (the same cells, whichever runs gave them)."""
    rows = []
    for r in m["rows"]:
        cells = {a: {k: v for k, v in c.items() if k != "runs"} for a, c in r["cells"].items()}
        for c in cells.values():
            c["results"] = sorted((x["case"], x["verdict"], x["worst_ulps"], x["headroom"]) for x in c["results"])
        rows.append({**r, "cells": cells})
    return rows


def test_two_shards_merge_into_the_one_run_matrix(tmp_path):
    write_suite(tmp_path, SUITE)
    full = run_pytest(tmp_path, "--dsv4-report", "full.json")
    assert full.returncode == 1 and "1 failed, 8 passed" in full.stdout, full.stdout
    shards = []
    for k in (1, 2):
        r = run_pytest(tmp_path, "--splits", "2", "--group", str(k), "--dsv4-report", f"shard{k}.json")
        assert r.returncode in (0, 1), r.stdout + r.stderr
        shards.append(json.loads((tmp_path / f"shard{k}.json").read_text()))
    # each shard ran part of the suite, together all of it, no test twice
    n = [sum(s["meta"]["tests"].values()) for s in shards]
    assert all(x > 0 for x in n) and sum(n) == 9, n
    keys = [{(x["entry"], x["case"]) for x in s["results"]} for s in shards]
    assert not keys[0] & keys[1] and len(keys[0] | keys[1]) == 9
    one = merge_reports([tmp_path / "full.json"])
    merged = merge_reports([tmp_path / "shard1.json", tmp_path / "shard2.json"])
    assert _cells(merged) == _cells(one)
    assert merged["summary"] == one["summary"] == {"pass": 2, "fail": 1}
    assert merged["conflicts"] == one["conflicts"] == []
