"""The CLI: regen/verify/check/import/list through main(argv), the check JSON schema, and
one-line errors without tracebacks (subprocess)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import pytest

from dsv4_numerics.fixtures import catalog as catalog_mod
from dsv4_numerics.runner import check as check_mod
from dsv4_numerics.fixtures import golden, store
from dsv4_numerics.cli import main

from .fakes import toy_catalog


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setattr(catalog_mod, "default_catalog", lambda: toy_catalog())


def _snap(root):
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_regen_twice_identical_bytes_via_cli(tmp_path, toy, capsys):
    assert main(["fixtures", "regen", "--root", str(tmp_path), "-q"]) == 0
    first = _snap(tmp_path)
    assert "manifest.json" in first and len(first) == 1 + 3 + 5  # 3 shared inputs files, 5 outputs
    assert main(["fixtures", "regen", "--root", str(tmp_path), "-q"]) == 0
    assert _snap(tmp_path) == first
    assert "regen: 5 unchanged" in capsys.readouterr().out


def test_regen_refuses_change_without_accept(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(catalog_mod, "default_catalog", lambda: toy_catalog())
    main(["fixtures", "regen", "--root", str(tmp_path), "-q"])
    before = _snap(tmp_path)
    monkeypatch.setattr(catalog_mod, "default_catalog", lambda: toy_catalog(shift=3))
    capsys.readouterr()
    assert main(["fixtures", "regen", "--root", str(tmp_path), "-q"]) == 1
    cap = capsys.readouterr()
    assert "CHANGED    toy_numeric.one" in cap.out and "REFUSED" in cap.err
    assert _snap(tmp_path) == before
    assert main(["fixtures", "regen", "--root", str(tmp_path), "-q", "--accept"]) == 0
    assert _snap(tmp_path) != before


def _corrupt(root, name="toy_bytes.tiny.scale_clamp.out.safetensors"):
    p = root / "data" / name
    data = bytearray(p.read_bytes())
    off = len(data) - 1
    data[off] ^= 0xFF
    p.write_bytes(bytes(data))
    return off


def test_corrupt_byte_fails_verify_and_check_naming_fixture_file_offset(tmp_path, toy, capsys):
    main(["fixtures", "regen", "--root", str(tmp_path), "-q"])
    assert main(["fixtures", "verify", "--root", str(tmp_path), "-q"]) == 0
    off = _corrupt(tmp_path)
    capsys.readouterr()
    assert main(["fixtures", "verify", "--root", str(tmp_path), "-q"]) == 1
    out = capsys.readouterr().out
    line = next(l for l in out.splitlines() if "toy_bytes.tiny.scale_clamp" in l and l.lstrip().startswith("FAIL"))
    assert "data/toy_bytes.tiny.scale_clamp.out.safetensors" in line and f"first differs at byte {off}" in line
    assert "verify: 4 ok, 1 failed (toy_bytes.tiny.scale_clamp)" in out
    report = tmp_path / "check.json"
    assert main(["check", "--root", str(tmp_path), "--no-kernels", "-q", "--json", str(report)]) == 1
    out = capsys.readouterr().out
    assert "fixture toy_bytes.tiny.scale_clamp (reference): FAIL" in out and f"first differs at byte {off}" in out
    assert "check: FAILED" in out
    d = json.loads(report.read_text())
    assert d["ok"] is False and d["exit_code"] == 1
    (bad,) = [f for f in d["fixtures"] if f["verdict"] != "pass"]
    assert bad["name"] == "toy_bytes.tiny.scale_clamp"


def _check_schema(d):
    assert d["schema"] == "dsv4-numerics/check/2"
    assert set(d) == {"schema", "ok", "exit_code", "meta", "summary", "judged", "failures", "requirements", "rows",
                      "fixtures", "results", "departures"}
    assert isinstance(d["departures"], list)
    assert isinstance(d["ok"], bool) and d["exit_code"] in (0, 1)
    assert isinstance(d["judged"], int) and d["judged"] == sum(r["judged"] for r in d["rows"])
    assert d["ok"] is (d["exit_code"] == 0) and (d["judged"] > 0 or not d["ok"])
    assert {"dsv4_numerics", "torch", "python", "device", "hardware", "fixtures_root", "duration_s"} <= set(d["meta"])
    assert set(d["summary"]) == set(check_mod.ROW_VERDICTS)
    for r in d["rows"]:
        assert set(r) == {"entry", "kind", "package", "stage", "cases", "judged", "verdict", "worst_ulps", "headroom",
                          "note", "seconds", "release", "declared_absent"}
        assert isinstance(r["release"], str) and isinstance(r["declared_absent"], bool)
        assert isinstance(r["seconds"], float) and r["seconds"] >= 0
        assert 0 <= r["judged"] <= max(r["cases"], 0) and (r["verdict"] != "unavailable" or r["judged"] == 0)
        assert r["kind"] in ("kernel", "reference-fixtures", "recorded-fixtures")
        assert r["verdict"] in check_mod.ROW_VERDICTS and isinstance(r["cases"], int)
        for k in ("worst_ulps", "headroom"):
            assert r[k] is None or isinstance(r[k], (int, float)) or r[k] in ("inf", "-inf", "nan")
    for f in d["fixtures"]:
        assert set(f) == {"name", "kind", "stage", "verdict", "problems", "entry"}
    for r in d["results"]:
        assert {"entry", "stage", "case", "verdict", "rule", "worst_ulps", "headroom", "message"} <= set(r)
    assert sum(d["summary"].values()) == len(d["rows"])


@pytest.mark.slow  # scheduled first under xdist (root conftest): one of the suite's longest tests
def test_check_json_schema_and_table(tmp_path, toy, capsys):
    main(["fixtures", "regen", "--root", str(tmp_path), "-q"])
    capsys.readouterr()
    report = tmp_path / "r.json"
    # on a GPU host every available kernel would run here (the whole matrix again, 170 s on an H200,
    # which the matrix tests already judge): one entry is enough for the schema and the table
    import torch

    only = ["--entry", "flashmla.sparse_decode.sm90"] if torch.cuda.is_available() else []
    rc = main(["check", "--root", str(tmp_path), "-q", "--json", str(report), *only])
    out = capsys.readouterr().out
    d = json.loads(report.read_text())
    _check_schema(d)
    assert rc == d["exit_code"]
    assert out.splitlines()[0].split() == ["entry", "stage", "cases", "verdict", "worst", "ulp", "headroom", "note"]
    rows = {(r["entry"], r["stage"]): r for r in d["rows"]}
    ref = rows[("fixtures:reference", "toy_bytes")]
    assert ref["cases"] == 4 and ref["judged"] == 4 and ref["verdict"] == "pass" and ref["worst_ulps"] == 0
    assert ref["package"] == "dsv4-numerics" and d["judged"] >= 5
    assert f"rows; {d['judged']} cases judged" in next(l for l in out.splitlines() if l.startswith("summary: "))
    assert rows[("fixtures:reference", "toy_numeric")]["cases"] == 1
    # every registered kernel entry is listed (available or with the probe's reason)
    from dsv4_numerics.kernels import registry

    for e in ([] if only else registry.all_entries()):
        r = rows[(e.name, e.stage)]
        assert r["verdict"] != "unavailable" or r["note"]


def test_import_and_list_via_cli(tmp_path, toy, capsys):
    from .test_golden import kernel_fixture

    src, dst = tmp_path / "gpu", tmp_path / "repo"
    kernel_fixture(src)
    assert main(["fixtures", "regen", "--root", str(dst), "-q"]) == 0
    assert main(["fixtures", "import", str(src), "--root", str(dst)]) == 0
    capsys.readouterr()
    assert main(["fixtures", "list", "--root", str(dst)]) == 0
    out = capsys.readouterr().out
    assert "kernel.fake.kernel.sm90.one" in out and "fake.kernel on NVIDIA H200 (sm90)" in out
    assert "6 pinned" in out


def _run_here(capsys, *args) -> subprocess.CompletedProcess:
    """``dsv4-numerics ARGS`` through ``cli.main`` in this process: exit status (argparse's
    ``SystemExit`` included), stdout and stderr, as :func:`_run` gives them."""
    capsys.readouterr()
    try:
        rc = main(list(args))
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else 2
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(list(args), rc, out, err)


def _run(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "dsv4_numerics.cli", *args], capture_output=True, text=True,
                          timeout=120, cwd=cwd)


@pytest.mark.parametrize("setup, args, msg", [
    ("bad-manifest", ["fixtures", "verify", "--root", "{root}"], "is not valid JSON"),
    ("bad-manifest", ["check", "--no-kernels", "--root", "{root}"], "is not valid JSON"),
    ("none", ["fixtures", "regen", "--record-kernel", "no.such.kernel", "--out-dir", "{root}"], "--record-kernel 'no.such.kernel' matches no kernel entry"),
    ("none", ["check", "--entry", "no.such.kernel", "--no-fixtures"], "--entry 'no.such.kernel' matches no kernel entry"),
    ("none", ["inspect", "{root}/missing.bin"], "does not exist"),
    ("none", ["fixtures", "import", "{root}/nowhere"], "is not a directory"),
    ("none", ["check", "--json", "{root}/no/such/dir/r.json"], "does not exist"),
    ("none", ["bench"], "the following arguments are required"),
    ("corrupt-file", ["fixtures", "list", "--root", "{root}"], ""),
])
def test_user_errors_end_in_one_line_without_traceback(tmp_path, setup, args, msg, capsys):
    # in this process (``main`` is what the console script runs; test_version_and_help runs the real
    # process): a subprocess per case spent ~5 s importing torch on a loaded GPU host
    if setup == "bad-manifest":
        (tmp_path / "manifest.json").write_text('{"schema": 1, "fixtures": ')
    if setup == "corrupt-file":  # list reads only the manifest: it must still work
        golden.regen(tmp_path, toy_catalog())
        _corrupt(tmp_path)
    r = _run_here(capsys, *[a.format(root=tmp_path) for a in args])
    if setup == "corrupt-file":
        assert r.returncode == 0, r.stderr
        return
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("dsv4-numerics: error: ") and msg in r.stderr


def test_corrupt_fixture_header_is_one_line_in_verify(tmp_path, toy, capsys):
    golden.regen(tmp_path, toy_catalog())
    p = tmp_path / "data" / "toy_numeric.one.out.safetensors"
    p.write_bytes(b"\xff" * 16)  # header length 2**64-1: unreadable
    assert main(["fixtures", "verify", "--root", str(tmp_path), "-q"]) == 1
    out = capsys.readouterr().out
    assert "toy_numeric.one" in out and "does not match its manifest sha256" in out


def test_version_and_help():
    r = _run("--version")
    assert r.returncode == 0 and r.stdout.startswith("dsv4-numerics ")
    r = _run("fixtures", "regen", "--help")
    assert r.returncode == 0 and "--record-kernel" in r.stdout and "--out-dir" in r.stdout


def test_bench_delegates_argv_to_the_module(monkeypatch):
    import types

    seen = {}
    fake = types.ModuleType("dsv4_numerics.bench.cpu")
    fake.main = lambda argv: seen.setdefault("argv", argv) and 0
    monkeypatch.setitem(sys.modules, "dsv4_numerics.bench.cpu", fake)
    assert main(["bench", "cpu", "--sizes", "64", "--repeats", "1"]) == 0
    assert seen["argv"] == ["--sizes", "64", "--repeats", "1"]


def test_kernels_listing_names_every_entry(capsys):
    from dsv4_numerics.kernels import registry

    assert main(["kernels"]) == 0
    out = capsys.readouterr().out
    for e in registry.all_entries():
        ok, reason = e.available()
        line = next(l for l in out.splitlines() if l.startswith(e.name + " "))
        assert ("available" in line) if ok else (f"unavailable: {reason}" in line)
        assert " dsv4-numerics " in line  # the package column
    assert main(["kernels", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    # installed external packages (e.g. the example project in CI) add rows of their own
    assert {r["name"] for r in rows if r["package"] == "dsv4-numerics"} == set(registry.names())
