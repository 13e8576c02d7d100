"""A foreign project whose kernel segfaults on one case (``ctypes.string_at(0)``), judged with
``assert_matches_reference`` (run in a subprocess outside this repository's conftest,
``test_plugin.write_suite``):

* with ``dsv4_isolate = true`` (ini, here ``-o``) the session survives: the failing case is an ``error``
  Result with the signal, the other cases pass, the later test runs, and the report and the
  merged matrix carry the error row;
* without isolation under ``-n 2`` the worker dies, yet the report holds an ``error`` row (rule
  ``crash``) for that kernel and case -- the call announced itself in the worker's spool before
  it ran -- so the merged matrix shows the kernel's cell as an error;
* ``--dsv4-isolate`` turns the default on too; without either it is off.

And :func:`recover_spooled` on hand-written spools: an announced call with no Result after it
becomes an error row only for a test whose worker crashed."""

from __future__ import annotations

import json
import os

import pytest

from dsv4_numerics.plugin.hooks import State, recover_spooled
from dsv4_numerics.report.merge import merge_reports

from tests.plugin.test_plugin import clean_env, run_pytest, write_suite

CRASH = "bs64-s37440-tiny-ties"  # the second of the three cases judged
SUITE = {
    "conftest.py": '''
        def pytest_sessionfinish(session):  # the API's isolation default in this run
            from dsv4_numerics.api import isolation

            with open("default.txt", "w") as f:
                f.write(str(isolation.default()))
    ''',
    "kern.py": '''
        import ctypes
        from dsv4_numerics.oracles import stages as st
        from dsv4_numerics.reference.cases import Case

        SPEC = st.STAGES["swa_write"]

        def writer(inputs):  # the reference's own cache, except a segfault on one case
            if inputs.name == "%s":
                ctypes.string_at(0)
            e = SPEC.expected(Case(inputs.name, inputs.stage, dict(inputs), inputs.params), dict(SPEC.defaults))
            return {k: v for k, v in e.items() if not k.startswith("_")}
    ''' % CRASH,
    "test_writer.py": '''
        import dsv4_numerics as dn
        from kern import writer

        def test_writer():
            dn.assert_matches_reference(writer, "swa_write", cases=dn.cases("swa_write")[:3])

        def test_after():
            pass
    ''',
}
ENTRY = "user.kern.writer"


def _rows(path) -> list[tuple[str, str, str, str]]:
    d = json.loads(path.read_text())
    return sorted((r["entry"], r["case"], r["verdict"], r["rule"]) for r in d["results"])


def _cell(path) -> dict:
    m = merge_reports([path])
    return next(r for r in m["rows"] if r["entry"] == ENTRY)["cells"]["cpu"]


@pytest.mark.slow  # two nested pytest runs, one of them with two xdist workers
def test_a_segfaulting_kernel_is_an_error_row_with_or_without_isolation(tmp_path):
    write_suite(tmp_path, SUITE)
    env = clean_env(DSV4_WORKER_DEVICE="cpu", DSV4_ARCH="cpu")
    # isolated (the ini option): the session goes on, the crash is its case's error
    r = run_pytest(tmp_path, "--dsv4-report", "iso.json", "-n", "0", "-o", "dsv4_isolate=true", env=env)
    out = r.stdout + r.stderr
    assert r.returncode == 1, out[-4000:]
    assert "1 failed, 1 passed" in out, out[-3000:]
    assert (tmp_path / "default.txt").read_text() == "True"
    rows = _rows(tmp_path / "iso.json")
    assert [x for x in rows if x[2] != "pass"] == [(ENTRY, CRASH, "error", "crash")], rows
    assert len(rows) == 3
    err = next(x for x in json.loads((tmp_path / "iso.json").read_text())["results"] if x["verdict"] == "error")
    assert "killed by SIGSEGV" in err["message"] and "kern.py" in err["details"]["stderr"]
    cell = _cell(tmp_path / "iso.json")
    assert (cell["verdict"], cell["cases"], cell["judged"]) == ("error", 3, 3)
    # not isolated, two xdist workers: the worker dies in test_writer, the report keeps a row for it
    r = run_pytest(tmp_path, "--dsv4-report", "raw.json", "-n", "2", env=env)
    out = r.stdout + r.stderr
    assert r.returncode == 1 and "crashed while running 'test_writer.py::test_writer'" in out, out[-4000:]
    assert (tmp_path / "default.txt").read_text() == "False"
    d = json.loads((tmp_path / "raw.json").read_text())
    assert [(x["entry"], x["stage"], x["case"], x["verdict"], x["rule"]) for x in d["results"]] == [
        (ENTRY, "swa_write", CRASH, "error", "crash")]
    assert "test_writer.py::test_writer" in d["results"][0]["message"] and "isolate=True" in d["results"][0]["message"]
    assert d["summary"]["error"] == 1 and d["meta"]["tests"] == {"passed": 1, "failed": 1}
    assert _cell(tmp_path / "raw.json")["verdict"] == "error"


def test_the_command_line_option_turns_isolation_on(tmp_path):
    write_suite(tmp_path, SUITE)
    r = run_pytest(tmp_path, "--dsv4-isolate", "-n", "0", "--collect-only", "kern.py")  # nothing to collect
    assert r.returncode == 5, r.stdout + r.stderr
    assert (tmp_path / "default.txt").read_text() == "True"


def _spool(folder, lines) -> None:
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "gw0-1.jsonl"), "w") as f:
        for line in lines:
            f.write(json.dumps(line) + "\n")


def test_an_announced_call_without_its_result_is_an_error_row_only_where_the_worker_crashed(tmp_path):
    def start(case):
        return {"start": {"entry": "k", "stage": "swa_write", "case": case, "family": "user", "device": "cpu",
                          "policies": {"scale_rule": "scale_clamp"}}}

    def result(case):
        return {"result": {"entry": "k", "stage": "swa_write", "case": case, "verdict": "pass", "rule": "bit_exact"}}

    st = State()
    st.crashed = {"t.py::crashed_in_call": "worker 'gw0' crashed while running 't.py::crashed_in_call'",
                  "t.py::crashed_after": "worker 'gw0' crashed while running 't.py::crashed_after'"}
    lines = []
    for nodeid, events in (("t.py::crashed_in_call", [start("a"), start("b")]),  # b never returned
                           ("t.py::crashed_after", [start("a"), result("a")]),  # judged, then died
                           ("t.py::no_crash", [start("a")])):  # no Result, but its worker lived
        lines += [dict(e, nodeid=nodeid) for e in events]
    _spool(tmp_path / "s", lines)
    assert recover_spooled(st, str(tmp_path / "s")) == 2
    got = sorted((nid, r.case, r.verdict, r.rule) for nid, rs in st.results_of.items() for r in rs)
    assert got == [("t.py::crashed_after", "a", "pass", "bit_exact"), ("t.py::crashed_in_call", "b", "error", "crash")]
    err = st.results_of["t.py::crashed_in_call"][0]
    assert err.policies == {"scale_rule": "scale_clamp"} and err.device == "cpu" and "crashed while running" in err.message
    assert not (tmp_path / "s").exists()
