"""No green without a verdict, and external kernel entries in ``check`` / ``kernels``.

Every path here must end non-zero: ``check`` that judged nothing, a missing ``--root``, a
required entry that is unavailable or only skipped, a glob matching nothing, ``fixtures verify``
with nothing to verify; and a broken external entry is an ``error`` row naming its package,
never a crash. The fake entries live in a temp ``.py`` file (``--entries-from``) or a temp
``*.dist-info`` (entry point) on ``PYTHONPATH`` of a subprocess; nothing is pip-installed.
Kernel judging is replaced by a stub ``run_entry`` (in-process tests) so no stage is computed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from dsv4_numerics.cli import main
from dsv4_numerics.fixtures import catalog as catalog_mod
from dsv4_numerics.fixtures import golden
from dsv4_numerics.oracles import matrix as matrix_mod
from dsv4_numerics.oracles.report import Result

from .fakes import toy_catalog

# A CPU entry whose probe passes, one whose probe fails, one whose probe raises, one invalid
# declaration, one clashing with a built-in name. Stage "swa_write" (a real stage name); the
# kernel is never called: run_entry is stubbed in-process, and the subprocess tests never run it.
ENTRIES_PY = textwrap.dedent('''
    from dsv4_numerics.kernels.registry import KernelEntry

    def _e(name, probe, archs=("cpu",), family="reference"):
        return KernelEntry(name=name, stage="swa_write", family=family, source="fake", archs=archs,
                           dtypes=("bfloat16",), policies={}, tolerance_scope=name, probe=probe,
                           call=lambda case: {})

    def _raise():
        raise RuntimeError("driver exploded")

    ENTRIES = [
        _e("fake.ok", lambda: None),
        _e("fake.unavail", lambda: "needs the fake accelerator (none here)", archs=("sm90",)),
        _e("fake.raises", _raise),
        _e("fake.badfamily", lambda: None, family="NotAFamily"),
    ]
''')


@pytest.fixture
def entries_file(tmp_path):
    p = tmp_path / "fake_entries.py"
    p.write_text(ENTRIES_PY)
    return p


@pytest.fixture
def stub_judge(monkeypatch):
    """run_entry stub: every default case of a judged entry becomes a Result with ``verdict``."""
    state = {"verdict": "pass", "calls": []}

    def run_entry(entry, cases=None, device=None):
        state["calls"].append(entry.name)
        return [Result(entry=entry.name, stage=entry.stage, case=f"c{i}", verdict=state["verdict"], rule="stub")
                for i in range(2)]

    monkeypatch.setattr(matrix_mod, "run_entry", run_entry)
    return state


def _check(capsys, tmp_path, *args):
    report = tmp_path / "check.json"
    # --device cpu: kernels run in-process through the stubbed run_entry, also on a GPU runner
    rc = main(["check", "-q", "--device", "cpu", "--json", str(report), *args])
    out = capsys.readouterr().out
    return rc, out, json.loads(report.read_text())


def test_check_that_judged_nothing_fails(tmp_path, capsys, entries_file, stub_judge):
    empty = tmp_path / "empty"
    empty.mkdir()
    # only the unavailable fake entry, no fixtures: nothing reaches a verdict
    rc, out, d = _check(capsys, tmp_path, "--root", str(empty), "--no-external", "--entries-from", str(entries_file),
                        "--entry", "fake.unavail")
    assert rc == 1 and d["ok"] is False and d["exit_code"] == 1 and d["judged"] == 0
    assert "nothing was judged" in d["failures"][0] and "FAILED: nothing was judged" in out
    assert "rows; 0 cases judged" in out and "\ncheck: FAILED\n" in out
    assert stub_judge["calls"] == []


def test_check_judging_something_passes_and_counts_judged(tmp_path, capsys, entries_file, stub_judge):
    empty = tmp_path / "empty"
    empty.mkdir()
    rc, out, d = _check(capsys, tmp_path, "--root", str(empty), "--no-external", "--entries-from", str(entries_file),
                        "--entry", "fake.ok", "--require", "fake.ok")
    assert rc == 0 and d["ok"] is True and d["judged"] == 2 and d["failures"] == []
    (row,) = [r for r in d["rows"] if r["entry"] == "fake.ok"]
    assert row["verdict"] == "pass" and row["judged"] == 2 and row["package"] == str(entries_file)
    assert d["requirements"] == [{"require": "fake.ok", "entry": "fake.ok", "judged": 2, "ok": True, "reason": ""}]
    assert "required: 1 of 1 required entries judged" in out


def test_required_entry_unavailable_fails_with_probe_reason(tmp_path, capsys, entries_file, stub_judge, monkeypatch):
    monkeypatch.setattr(catalog_mod, "default_catalog", lambda: toy_catalog())
    root = tmp_path / "fx"
    golden.regen(root, toy_catalog())
    # fixtures pass (judged > 0) and fake.ok passes: only the requirement fails the run
    rc, out, d = _check(capsys, tmp_path, "--root", str(root), "--no-external", "--entries-from", str(entries_file),
                        "--entry", "fake.ok", "--require", "fake.un*")
    assert rc == 1 and d["ok"] is False and d["judged"] > 0
    (req,) = d["requirements"]
    assert req["entry"] == "fake.unavail" and req["ok"] is False
    assert "needs the fake accelerator (none here)" in req["reason"]
    line = next(l for l in out.splitlines() if l.startswith("FAILED: required entry fake.unavail"))
    assert "needs the fake accelerator (none here)" in line


def test_required_entry_all_skipped_fails(tmp_path, capsys, entries_file, stub_judge):
    stub_judge["verdict"] = "skip"
    empty = tmp_path / "empty"
    empty.mkdir()
    rc, out, d = _check(capsys, tmp_path, "--root", str(empty), "--no-external", "--entries-from", str(entries_file),
                        "--entry", "fake.ok", "--require", "fake.ok")
    assert rc == 1 and d["judged"] == 0
    (row,) = [r for r in d["rows"] if r["entry"] == "fake.ok"]
    assert row["verdict"] == "skip" and row["cases"] == 2 and row["judged"] == 0
    assert any("required entry fake.ok (fake.ok) was not judged: all 2 cases skipped" in f for f in d["failures"])


def test_require_available_on_cpu(tmp_path, capsys, entries_file, stub_judge, monkeypatch):
    from dsv4_numerics.kernels import probe

    # the hardware seen is a CPU-only host, also when this runs on a GPU runner
    monkeypatch.setattr(probe, "arch_reason", lambda archs: None if "cpu" in archs else "needs a GPU (CPU-only host)")
    empty = tmp_path / "empty"
    empty.mkdir()
    # fake.ok (archs cpu) matches this machine and is judged; fake.unavail (sm90) does not match
    rc, out, d = _check(capsys, tmp_path, "--root", str(empty), "--no-external", "--entries-from", str(entries_file),
                        "--entry", "fake.ok", "--require-available")
    assert {r["entry"] for r in d["requirements"]} >= {"fake.ok"} and "fake.unavail" not in {
        r["entry"] for r in d["requirements"]}
    assert rc == 1  # fake.raises (archs cpu) is required too and errored
    assert any("fake.raises" in f and "driver exploded" in f for f in d["failures"])


def test_broken_external_entries_are_error_rows_naming_the_package(tmp_path, capsys, entries_file, stub_judge):
    empty = tmp_path / "empty"
    empty.mkdir()
    rc, out, d = _check(capsys, tmp_path, "--root", str(empty), "--no-external", "--entries-from", str(entries_file),
                        "--entry", "fake.ok", "--entry", "fake.raises", "--entry", "fake.badfamily")
    rows = {r["entry"]: r for r in d["rows"]}
    assert rows["fake.ok"]["verdict"] == "pass"
    for name, text in (("fake.raises", "probe raised RuntimeError: driver exploded"),
                       ("fake.badfamily", "invalid entry declaration")):
        assert rows[name]["verdict"] == "error" and rows[name]["package"] == str(entries_file)
        assert f"package {entries_file}" in rows[name]["note"] and text in rows[name]["note"]
    assert rc == 1


@pytest.mark.parametrize("args, msg", [
    (["check", "--root", "{tmp}/nonexistent", "--no-kernels"], "--root {tmp}/nonexistent: no such directory"),
    (["fixtures", "verify", "--root", "{tmp}/nonexistent"], "--root {tmp}/nonexistent: no such directory"),
    (["check", "--no-fixtures", "--no-external", "--require", "no.such.*"], "--require 'no.such.*' matches no kernel entry"),
    (["check", "--no-fixtures", "--entries-from", "{tmp}/missing.py"], "--entries-from {tmp}/missing.py: no such file"),
    (["check", "--no-fixtures", "--entries-from", "no_such_module_xyz"], "no importable module"),
    (["check", "--no-kernels", "--require", "x"], "cannot go with --no-kernels"),
])
def test_usage_errors_exit_2_in_one_line(tmp_path, capsys, args, msg):
    assert main([a.format(tmp=tmp_path) for a in args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and msg.format(tmp=tmp_path) in err


def test_verify_with_nothing_to_verify_fails_naming_the_path(tmp_path, capsys):
    assert main(["fixtures", "verify", "--root", str(tmp_path)]) == 1
    assert f"nothing to verify: no manifest.json under {tmp_path}" in capsys.readouterr().err
    (tmp_path / "manifest.json").write_text(json.dumps({"schema": 1, "fixtures": {}}))
    assert main(["fixtures", "verify", "--root", str(tmp_path)]) == 1
    assert f"{tmp_path / 'manifest.json'} lists no fixtures" in capsys.readouterr().err


def test_golden_verify_rejects_a_missing_root(tmp_path):
    from dsv4_numerics.reference.errors import InputError

    with pytest.raises(InputError, match="does not exist"):
        golden.verify(tmp_path / "nope", None)


# ----------------------------------------------------------------------------- installed entries
def _fake_dist(tmp_path, value: str, module_src: str) -> dict:
    """A fake installed distribution 'fake-kernels' on PYTHONPATH (dist-info + module)."""
    site = tmp_path / "site"
    di = site / "fake_kernels-1.0.dist-info"
    di.mkdir(parents=True)
    (di / "METADATA").write_text("Metadata-Version: 2.1\nName: fake-kernels\nVersion: 1.0\n")
    (di / "entry_points.txt").write_text(f"[dsv4_numerics.kernels]\n{value}\n")
    (site / "fake_kernels_mod.py").write_text(module_src)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "DSV4_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(site)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


@pytest.mark.slow  # scheduled first under xdist (root conftest): one of the suite's longest tests
def test_installed_entries_listed_with_package_and_broken_ones_are_rows(tmp_path):
    src = ENTRIES_PY + textwrap.dedent('''
        def provide():
            return ENTRIES[:2]

        CLASH = _e("flashmla.sparse_decode.sm90", lambda: None)
        NOT_AN_ENTRY = 42
    ''')
    env = _fake_dist(tmp_path, "good = fake_kernels_mod:provide\nclash = fake_kernels_mod:CLASH\n"
                               "wrong = fake_kernels_mod:NOT_AN_ENTRY\nbroken = fake_kernels_mod_missing:X", src)
    r = subprocess.run([sys.executable, "-m", "dsv4_numerics.cli", "kernels", "--json"], capture_output=True, text=True,
                       env=env, timeout=120, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    rows = {(x["name"], x["package"]): x for x in json.loads(r.stdout)}
    assert rows[("fake.ok", "fake-kernels")]["available"] is True
    assert "needs the fake accelerator" in rows[("fake.unavail", "fake-kernels")]["reason"]
    assert "clashes" in rows[("flashmla.sparse_decode.sm90", "fake-kernels")]["reason"]
    assert "got int" in rows[("wrong", "fake-kernels")]["reason"]
    assert "ModuleNotFoundError" in rows[("broken", "fake-kernels")]["reason"]
    # check judges nothing here (no run), but lists every problem as an error row naming the package
    r = subprocess.run([sys.executable, "-m", "dsv4_numerics.cli", "check", "-q", "--no-fixtures", "--json", "c.json",
                        "--entry", "fake.unavail"], capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    d = json.loads((tmp_path / "c.json").read_text())
    assert [x["verdict"] for x in d["rows"] if x["entry"] == "fake.unavail"] == ["unavailable"]
    # --no-external hides them
    r = subprocess.run([sys.executable, "-m", "dsv4_numerics.cli", "kernels", "--json", "--no-external"],
                       capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path)
    assert r.returncode == 0 and all(x["package"] != "fake-kernels" for x in json.loads(r.stdout))


def test_interrupted_check_still_writes_what_it_judged(tmp_path, capsys, entries_file, monkeypatch):
    """SIGINT (a runner's ``timeout --signal=INT``) while the second entry runs: the first entry's
    verdicts are printed and written, the rest are ``error`` rows saying they were interrupted,
    and the exit status is 130."""
    def run_entry(entry, cases=None, device=None):
        if entry.name == "fake.raises_later":
            raise KeyboardInterrupt
        return [Result(entry=entry.name, stage=entry.stage, case="c0", verdict="pass", rule="stub")]

    monkeypatch.setattr(matrix_mod, "run_entry", run_entry)
    more = entries_file.read_text() + "ENTRIES.append(_e('fake.raises_later', lambda: None))\n"
    more += "ENTRIES.append(_e('fake.after', lambda: None))\n"
    entries_file.write_text(more)
    empty = tmp_path / "empty"
    empty.mkdir()
    report = tmp_path / "check.json"
    rc = main(["check", "-q", "--device", "cpu", "--json", str(report), "--root", str(empty), "--no-external",
               "--entries-from", str(entries_file), "--entry", "fake.ok", "--entry", "fake.raises_later",
               "--entry", "fake.after"])
    cap = capsys.readouterr()
    d = json.loads(report.read_text())
    assert rc == 130 and d["ok"] is False and d["meta"]["interrupted"] is True
    verdicts = {r["entry"]: (r["verdict"], r["note"]) for r in d["rows"]}
    assert verdicts["fake.ok"][0] == "pass" and [r["case"] for r in d["results"]] == ["c0"]
    for name in ("fake.raises_later", "fake.after"):
        assert verdicts[name][0] == "error" and "interrupted" in verdicts[name][1]
    assert "interrupted: 2 kernel entries had no result" in d["failures"]
    assert "interrupted: 2 kernel entries had no result" in cap.err and "fake.ok" in cap.out


@pytest.fixture
def pool_jobs(monkeypatch):
    """``worker_pool.IsolatedPool`` replaced by a recorder: ``{pool key: (entry, case names,
    probe)}`` of every job ``check`` hands it, each answered with a pass per case."""
    from dsv4_numerics.runner import pool as worker_pool

    submitted: dict = {}

    class FakePool:
        def __init__(self, device, jobs):
            pass

        def start(self, warm=False):
            pass

        def submit(self, key, entry, case_names=None, **kw):
            submitted[key] = (entry, case_names, kw.get("probe"))

        def result(self, key):
            entry, names, _ = submitted[key]
            return {n: {"entry": entry, "stage": "decode", "case": n, "verdict": "pass", "rule": "stub"} for n in names}

        def close(self, cancel=False):
            pass

    monkeypatch.setattr(worker_pool, "IsolatedPool", FakePool)
    return submitted


def test_check_judges_an_attention_entry_in_case_groups_and_merges_them(pool_jobs):
    """On a GPU host `check` hands an attention entry's cases to the pool in groups of
    GROUP_CASES (one slow entry spreads over the children); the rows merge the groups back."""
    from dsv4_numerics.runner import check as check_mod
    from dsv4_numerics.runner.case_files import load_cases, stage_cases_file

    submitted = pool_jobs
    names = [c.name for c in load_cases(stage_cases_file("decode"))]
    rows, results = check_mod.run_kernels("cuda", ["flashmla.sparse_decode.sm90"], lambda m: None, jobs=2)
    n = check_mod.GROUP_CASES
    assert list(submitted) == [f"flashmla.sparse_decode.sm90#{i}" for i in range(-(-len(names) // n))]
    assert [c for _, cs, _ in submitted.values() for c in cs] == names and all(p for *_, p in submitted.values())
    (row,) = rows
    assert row.verdict == "pass" and row.cases == len(names) and [r.case for r in results] == names


def test_case_globs_select_the_cases_handed_to_the_children_and_name_a_glob_that_matches_nothing(pool_jobs):
    """check --case: the isolated jobs carry only the matching names (in groups as before), an
    entry whose stage has none is a skip row saying so, and a glob matching no case of the
    selected entries' stages is a one-line usage error."""
    from dsv4_numerics.runner import check as check_mod
    from dsv4_numerics.runner.case_files import load_cases, stage_cases_file
    from dsv4_numerics.reference.errors import InputError

    names = [c.name for c in load_cases(stage_cases_file("decode"))]
    want = [n for n in names if n.startswith("sweep-")]
    assert 0 < len(want) < len(names)
    other = "vllm_triton.compute_swa_indices_and_lens"  # stage swa_indices: no sweep-* case
    assert not any(c.name.startswith("sweep-") for c in load_cases(stage_cases_file("swa_indices")))
    rows, results = check_mod.run_kernels("cuda", ["flashmla.sparse_decode.sm90", other],
                                          lambda m: None, jobs=2, case_globs=["sweep-*"])
    assert [c for _, cs, _ in pool_jobs.values() for c in cs] == want
    decode, skipped = rows
    assert decode.verdict == "pass" and decode.cases == len(want) and [r.case for r in results] == want
    assert skipped.entry == other and skipped.verdict == "skip" and "matches --case sweep-*" in skipped.note
    with pytest.raises(InputError, match="--case 'no-such-\\*' matches no case"):
        check_mod.run_check(entries=["flashmla.sparse_decode.sm90"], fixtures=False, case_globs=["no-such-*"])
    with pytest.raises(InputError, match="cannot be combined with --no-kernels"):
        check_mod.run_check(kernels=False, case_globs=["sweep-*"])
