"""Result records, the summary table, the JSON report round trip, JUnit properties."""

from __future__ import annotations

import json
import math

import pytest

from dsv4_numerics.oracles import report as rp
from dsv4_numerics.reference.errors import InputError


def _results():
    return [
        rp.Result("k.one", "decode", "case-a", "pass", rule="cosine", worst_ulps=1.5, headroom=3.0),
        rp.Result("k.one", "decode", "case-b", "fail", rule="elementwise_abs_or_rel", worst_ulps=40.0,
                  headroom=0.25, message="3/96 elements exceed", details={"max_abs": 0.01}),
        rp.Result("k.two", "decode", "case-a", "skip", message="needs sm90"),
        rp.Result("k.two", "swa_write", "c", "error", message="RuntimeError: boom"),
        rp.Result("k.three", "decode", "case-a", "pass", headroom=math.inf),
    ]


def test_bad_verdict_rejected():
    with pytest.raises(InputError, match="verdict"):
        rp.Result("e", "s", "c", "passed")


def test_json_round_trip(tmp_path):
    rs = _results()
    p = rp.write_json(rs, tmp_path / "r" / "report.json", meta={"arch": "cpu"})
    raw = json.loads(p.read_text())  # strict JSON: inf written as a string
    assert raw["schema"] == rp.SCHEMA and raw["summary"] == {"pass": 2, "fail": 1, "skip": 1, "error": 1}
    assert raw["results"][4]["headroom"] == "inf"
    back, meta = rp.read_json(p)
    assert meta == {"arch": "cpu"}
    assert [r.to_dict() for r in back] == [r.to_dict() for r in rs]
    assert back[4].headroom == math.inf


def test_summary_table_shape():
    text = rp.summary_table(_results())
    lines = text.splitlines()
    assert lines[0] == "dsv4-numerics matrix: 2 pass, 1 fail, 1 skip, 1 error"
    assert "-- stage decode (3 entries x 2 cases)" in text
    row = next(line for line in lines if line.startswith("k.one "))
    assert row.split()[1:] == ["ok", "FAIL"]
    row = next(line for line in lines if line.startswith("k.two "))
    assert row.split()[1:] == ["skip", "."]  # k.two has no case-b result in stage decode
    assert "#0=case-a, #1=case-b" in text
    assert "k.one [decode] case-b: FAIL rule=elementwise_abs_or_rel worst=40ulp headroom=0.25" in text
    assert "RuntimeError: boom" in text


def test_junit_properties_and_collector_round_trip():
    recorded = []
    r = _results()[1]
    rp.record(r, lambda k, v: recorded.append((k, v)))
    props = dict(recorded)
    assert props["dsv4.verdict"] == "fail" and props["dsv4.headroom"] == "0.25"
    assert props["dsv4.worst_ulps"] == "40"
    col = rp.ResultCollector()
    assert col.add_from_user_properties(recorded) == 1
    assert col.results[0].to_dict() == r.to_dict()


def test_matrix_results_fixture_records_properties(matrix_results, request):
    rs = matrix_results([rp.Result("report.selftest", "selftest", f"fixture{i}", "pass") for i in range(2)])
    assert len(rs) == 2
    names = [k for k, _ in request.node.user_properties]
    assert names.count(rp.RESULT_PROPERTY) == 2
    matrix_results(rs)  # the same Result objects again (e.g. judged, then handed over): attached once
    assert [k for k, _ in request.node.user_properties].count(rp.RESULT_PROPERTY) == 2
