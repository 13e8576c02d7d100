"""``report merge`` and ``report diff`` on hand-built reports (``report_builders``): placement by
architecture, conflicts kept, divergences, rows without Results, and every kind of change the
diff gates on, with the CLI's exit codes."""

from __future__ import annotations

import json

import pytest

from dsv4_numerics import cli
from dsv4_numerics.reference.errors import InputError
from dsv4_numerics.report.diff import diff_matrices
from dsv4_numerics.report.merge import merge_reports

from .report_builders import R, check_report, meta, pytest_report, unavailable_row

E = "flashmla.sparse_decode.sm90"


def three_runs(tmp_path):
    """An H200 check run, an H200 pytest run that disagrees on one case, a B200 pytest run."""
    a = check_report(tmp_path / "h200-check.json",
                     [R(E, "c1", "pass", 1.5, 4.0), R(E, "c2", "pass", 0.5, 8.0)],
                     [unavailable_row("vllm_cuda.kv_rope_insert", "swa_write", "needs sm100")], meta("sm90"))
    b = pytest_report(tmp_path / "h200-pytest.json",
                      [R(E, "c1", "pass", 1.5, 4.0),
                       R(E, "c2", "fail", 9.0, 0.5, msg='out: 3 elements outside <tol> "quoted"')],
                      meta("sm90"))
    c = pytest_report(tmp_path / "b200.json",
                      [R(E, "c1", "pass", 1.0, 5.0), R("vllm_cuda.kv_rope_insert", "k1", "pass", None, float("inf"),
                                                       stage="swa_write", rule="bit_exact")], meta("sm100"))
    return a, b, c


def test_merge_places_cells_by_arch_and_keeps_conflicts(tmp_path):
    m = merge_reports(list(three_runs(tmp_path)))
    assert m["schema"] == "dsv4-numerics/matrix/1" and m["archs"] == ["sm90", "sm100"]
    assert [r["label"] for r in m["runs"]] == ["h200-check.json", "h200-pytest.json", "b200.json"]
    assert m["runs"][0]["staged"][0]["vllm_version"] == "0.33.0" and m["runs"][2]["cuda"] == "13.0"
    rows = {(r["entry"], r["stage"]): r for r in m["rows"]}
    h200 = rows[(E, "decode")]["cells"]["sm90"]
    # two cases (c1 seen in both H200 runs counts once); c2 passes in one run, fails in the other
    assert (h200["verdict"], h200["cases"], h200["judged"]) == ("fail", 2, 2)
    assert h200["worst_ulps"] == 9.0 and h200["headroom"] == 0.5 and h200["conflict"] is True
    assert len(h200["results"]) == 4  # nothing overwritten
    assert m["conflicts"] == [{"entry": E, "stage": "decode", "release": "", "arch": "sm90", "case": "c2",
                               "verdicts": {"h200-check.json": "pass", "h200-pytest.json": "fail"}}]
    failing = next(x for x in h200["results"] if x["verdict"] == "fail")
    assert "out: 3 elements outside" in failing["explain"]
    b200 = rows[(E, "decode")]["cells"]["sm100"]
    assert (b200["verdict"], b200["headroom"], b200["conflict"]) == ("pass", 5.0, False)
    assert m["divergences"] == [{"entry": E, "stage": "decode", "release": "", "passing": ["sm100"], "failing": ["sm90"]}]
    # the same entry: unavailable on the H200 (check row with the probe's reason), judged on the B200
    kv = rows[("vllm_cuda.kv_rope_insert", "swa_write")]["cells"]
    assert kv["sm90"]["verdict"] == "unavailable" and kv["sm90"]["note"] == "needs sm100"
    assert kv["sm100"]["verdict"] == "pass" and kv["sm100"]["headroom"] == "inf"
    assert rows[(E, "decode")]["family"] == "CUDA" and rows[(E, "decode")]["dtypes"]
    assert m["summary"] == {"fail": 1, "pass": 2, "unavailable": 1}


def test_one_run_judging_a_case_twice_is_a_conflict_labelled_by_policies(tmp_path):
    a, b = R(E, "c1", "pass", 1.0, 4.0), R(E, "c1", "fail", 9.0, 0.5)
    a.policies, b.policies = {"scale_rule": "scale_clamp"}, {"scale_rule": "amax_clamp"}
    m = merge_reports([pytest_report(tmp_path / "r.json", [a, b], meta("sm90"))])
    assert m["conflicts"] == [{"entry": E, "stage": "decode", "release": "", "arch": "sm90", "case": "c1",
                               "verdicts": {"r.json [scale_rule=scale_clamp]": "pass",
                                            "r.json [scale_rule=amax_clamp]": "fail"}}]
    b.policies = dict(a.policies)  # the same policies twice, different verdicts: still both kept
    m = merge_reports([pytest_report(tmp_path / "r.json", [a, b], meta("sm90"))])
    assert m["conflicts"][0]["verdicts"] == {"r.json": "pass", "r.json #2": "fail"}
    assert m["rows"][0]["cells"]["sm90"]["results"][0]["policies"] == "scale_rule=scale_clamp"


def test_merge_reads_gzipped_reports(tmp_path):
    import gzip

    paths = list(three_runs(tmp_path))
    gz = tmp_path / "b200.json.gz"
    gz.write_bytes(gzip.compress(open(paths[2], "rb").read()))
    plain, zipped = merge_reports(paths), merge_reports(paths[:2] + [gz])
    assert zipped["runs"][2]["label"] == "b200.json.gz"
    assert json.dumps(zipped["rows"]).replace("b200.json.gz", "b200.json") == json.dumps(plain["rows"])


def test_merge_rejects_what_is_not_a_report(tmp_path):
    (tmp_path / "x.json").write_text('{"schema": "other"}')
    (tmp_path / "y.json").write_text("not json")
    with pytest.raises(InputError, match="x.json must be a 'dsv4-numerics/check/2'"):
        merge_reports([tmp_path / "x.json"])
    with pytest.raises(InputError, match="y.json is not JSON"):
        merge_reports([tmp_path / "y.json"])
    with pytest.raises(InputError, match="REPORT .*missing.json is not a file"):
        merge_reports([tmp_path / "missing.json"])
    assert cli.main(["report", "merge", str(tmp_path / "x.json")]) == cli.EXIT_USAGE


@pytest.mark.parametrize("argv, named", [
    (["report", "diff", "BAD", "GOOD"], "report diff: argument BASE "),
    (["report", "diff", "GOOD", "BAD"], "report diff: argument NEW "),
    (["report", "merge", "GOOD", "BAD"], "report merge: argument REPORT "),
])
def test_a_bad_report_is_named_with_the_command_that_read_it(tmp_path, capsys, argv, named):
    good = pytest_report(tmp_path / "good.json", [R(E, "c1", "pass", 1.0, 4.0)], meta("sm90"))
    (tmp_path / "bad.md").write_text("# not a report\n")
    paths = {"GOOD": str(good), "BAD": str(tmp_path / "bad.md")}
    assert cli.main([paths.get(a, a) for a in argv]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert f"{named}{tmp_path / 'bad.md'} is not JSON" in err
    other = "report merge" if argv[1] == "diff" else "report diff"
    assert other not in err


def _diff_pair(tmp_path, new_results, new_meta=None):
    base = pytest_report(tmp_path / "base.json", [
        R(E, "c1", "pass", 1.0, 4.0), R(E, "c2", "pass", 0.5, 8.0),
        R("e.gone", "k", "pass", stage="gather", rule="bit_exact", head=float("inf")),
        R("e.exact", "k", "pass", stage="gather", rule="bit_exact", head=float("inf")),
        R("e.flaky", "k", "fail", 5.0, 0.2, stage="rope")], meta("sm90"))
    new = pytest_report(tmp_path / "new.json", new_results, new_meta or meta("sm90", vllm="0.34.0", commit="bbbb"))
    return base, new


def test_diff_flags_each_kind_of_change_and_gates_on_regressions(tmp_path, capsys):
    base, new = _diff_pair(tmp_path, [
        R(E, "c1", "pass", 1.2, 1.1),  # still passes, but headroom 4 -> 1.1: drift beyond 2x
        R("e.exact", "k", "pass", 0.0, 3.0, stage="gather"),  # bit-exact became inexact
        R("e.flaky", "k", "pass", 0.5, 2.0, stage="rope"),  # fixed: an improvement
        R("e.new", "k", "pass", stage="gather", head=float("inf")),
    ])
    m = {p: merge_reports([p]) for p in (base, new)}
    ch = {(c.kind, c.entry): c for c in diff_matrices(m[base], m[new])}
    assert set(ch) == {("coverage", E), ("headroom", E), ("missing", "e.gone"), ("headroom", "e.exact"),
                       ("verdict", "e.flaky"), ("new", "e.new")}
    assert ch[("coverage", E)].text == "cases judged 2 -> 1" and ch[("coverage", E)].regression
    assert ch[("headroom", E)].text.startswith("headroom 4 -> 1.1")
    assert ch[("verdict", "e.flaky")].text == "fail -> pass" and not ch[("verdict", "e.flaky")].regression
    assert not ch[("new", "e.new")].regression and ch[("missing", "e.gone")].regression
    rc = cli.main(["report", "diff", base, new, "--json", str(tmp_path / "d.json")])
    out = capsys.readouterr().out
    assert rc == cli.EXIT_FAIL and "4 regression(s), 2 other change(s) -- FAILED" in out
    assert "vllm 0.33.0" in out.splitlines()[0] and "vllm 0.34.0" in out.splitlines()[1]  # the versions compared
    assert json.loads((tmp_path / "d.json").read_text())["regressions"] == 4


def test_diff_and_page_name_the_sglang_version(tmp_path, capsys):
    """A run that staged SGLang next to vLLM: ``report diff`` and the HTML page name both versions (the
    base run staged vLLM only, so its line names vLLM alone)."""
    from dsv4_numerics.report import html as report_html

    base, new = _diff_pair(tmp_path, [R(E, "c1", "pass", 1.0, 4.0)],
                           meta("sm90", vllm="0.34.0", commit="bbbb", sglang="0.5.23"))
    cli.main(["report", "diff", base, new])
    lines = capsys.readouterr().out.splitlines()
    assert "vllm 0.33.0;" in lines[0] and "sglang" not in lines[0]
    assert "vllm 0.34.0, sglang 0.5.23;" in lines[1]
    page = report_html.render_html(merge_reports([new]))
    assert "vllm 0.34.0, sglang 0.5.23" in page


def test_diff_thresholds_and_unavailable(tmp_path):
    base, new = _diff_pair(tmp_path, [
        R(E, "c1", "pass", 1.9, 2.5), R(E, "c2", "pass", 0.9, 5.0),  # headroom 4 -> 2.5: within 2x
        R("e.gone", "k", "pass", stage="gather", rule="bit_exact", head=float("inf")),
        R("e.exact", "k", "pass", stage="gather", rule="bit_exact", head=float("inf")),
        R("e.flaky", "k", "error", stage="rope", msg="kernel crashed"),
    ])
    mb, mn = merge_reports([base]), merge_reports([new])
    ch = diff_matrices(mb, mn)
    assert [(c.kind, c.entry, c.regression) for c in ch] == [("verdict", "e.flaky", True)]
    assert [(c.kind, c.entry) for c in diff_matrices(mb, mn, ratio=1.5)] == [("verdict", "e.flaky"), ("headroom", E)]
    # worst ulps 1 -> 1.9 is not a whole ulp: no ulps drift; 0.5 -> 0.9 neither
    assert not [c for c in diff_matrices(mb, mn, ratio=1.01) if c.kind == "ulps"]
    with pytest.raises(InputError, match="'ratio' must be a finite number >= 1"):
        diff_matrices(mb, mn, ratio=0.5)
    # an entry that became unavailable (check row, probe's reason) is a regression
    un = check_report(tmp_path / "un.json", [], [unavailable_row(E, "decode", "needs sm90 GPU (found none)")],
                      meta("sm90"))
    c = next(c for c in diff_matrices(mb, merge_reports([un])) if c.entry == E)
    assert c.kind == "unavailable" and c.regression and "needs sm90 GPU" in c.text
    # identical runs: nothing, exit 0
    assert diff_matrices(mb, mb) == [] and cli.main(["report", "diff", base, base]) == cli.EXIT_OK


def test_cli_merge_writes_matrix_and_page_and_diff_reads_them_back(tmp_path, capsys):
    paths = list(three_runs(tmp_path))
    out, page = tmp_path / "m.json", tmp_path / "m.html"
    assert cli.main(["report", "merge", *paths, "--json", str(out), "--html", str(page)]) == cli.EXIT_OK
    text = capsys.readouterr().out
    assert "DIVERGES flashmla.sparse_decode.sm90 [decode]: passes on sm100, fails on sm90" in text
    assert "CONFLICT flashmla.sparse_decode.sm90 [decode] sm90 c2: h200-check.json=pass, h200-pytest.json=fail" in text
    m = json.loads(out.read_text())
    assert m == merge_reports(paths) and page.read_text().startswith("<!DOCTYPE html>")
    # a merged matrix is a valid BASE / NEW: the same matrix twice has no change
    assert cli.main(["report", "diff", str(out), str(out)]) == cli.EXIT_OK
    # the B200 run alone as NEW: the H200 cells are missing there (regressions)
    assert cli.main(["report", "diff", str(out), paths[2]]) == cli.EXIT_FAIL
    assert "REGRESSION missing     flashmla.sparse_decode.sm90 [decode] @sm90" in capsys.readouterr().out
    for argv, msg in ((["report"], "choose an action: merge, diff or history"),
                      (["report", "merge", paths[0], "--html", str(tmp_path / "no" / "p.html")], "--html"),
                      (["report", "diff", paths[0]], "the following arguments are required: NEW")):
        assert cli.main(argv) == cli.EXIT_USAGE
        assert msg in capsys.readouterr().err


def test_a_results_own_arch_and_a_recording_arch_win_over_the_runs(tmp_path):
    """A CPU runner's report (meta arch ``cpu``) holds live vLLM-CPU rows recorded under their x86
    ISA tag and replayed GPU recordings: each lands in its own architecture's column."""
    cpu_row = R("vllm_cpu.sparse_decode", "c1", "pass", 1.0, 3.0)
    cpu_row.arch = "x86-avx512bf16"
    replay = R("recorded:flashmla.sparse_decode.sm90@sm90", "c1", "pass", 1.5, 2.0)
    plain = R("example.decode.fp32", "c1", "pass", 0.5, 4.0)
    path = check_report(tmp_path / "cpu.json", [cpu_row, replay, plain],
                        [unavailable_row("flashmla.sparse_decode.sm90", "decode", "needs sm90")], meta("cpu", device="cpu"))
    m = merge_reports([path])
    assert m["archs"] == ["x86-avx512bf16", "sm90", "cpu"]
    rows = {r["entry"]: r["cells"] for r in m["rows"]}
    assert list(rows["vllm_cpu.sparse_decode"]) == ["x86-avx512bf16"]
    assert list(rows["recorded:flashmla.sparse_decode.sm90@sm90"]) == ["sm90"]
    assert list(rows["example.decode.fp32"]) == ["cpu"] and list(rows["flashmla.sparse_decode.sm90"]) == ["cpu"]


def test_mutation_suite_results_are_counted_not_placed(tmp_path):
    caught = R("approx_log2", "c1", "fail", 3.0, 0.1)
    caught.family = "mutant"
    escaped = R("lse_base2", "c1", "pass", 0.0, 9.0)
    escaped.family = "mutant"
    m = merge_reports([pytest_report(tmp_path / "p.json", [caught, escaped, R(E, "c1", "pass", 1.0, 3.0)], meta("sm90"))])
    assert [r["entry"] for r in m["rows"]] == [E]
    assert m["mutants"] == {"caught": 1, "escaped": 1}
