"""Selecting the case set: ``DSV4_CASES=default|full`` for the pytest matrix and the
isolated children (``case_files.stage_cases_file``), ``dsv4-numerics check --cases`` for
``check``. The full decode/prefill sets themselves: ``tests/attention/test_sweep_cases.py``."""

from __future__ import annotations

import json
import textwrap

import pytest

from dsv4_numerics.runner import case_files as kw
from dsv4_numerics.cli import main
from dsv4_numerics.oracles import matrix as matrix_mod
from dsv4_numerics.oracles.report import Result
from dsv4_numerics.reference import cases as cases_mod
from dsv4_numerics.reference.errors import InputError

ENTRIES_PY = textwrap.dedent('''
    from dsv4_numerics.kernels.registry import KernelEntry

    ENTRIES = [KernelEntry(name="fake.decode", stage="decode", family="reference", source="fake", archs=("cpu",),
                           dtypes=("bfloat16",), policies={}, tolerance_scope="fake.decode", probe=lambda: None,
                           call=lambda case: {})]
''')


def test_selected_case_size_reads_the_environment(monkeypatch):
    monkeypatch.delenv(kw.ENV_CASES, raising=False)
    assert kw.selected_case_size() == "default"
    monkeypatch.setenv(kw.ENV_CASES, " Full ")
    assert kw.selected_case_size() == "full"
    monkeypatch.setenv(kw.ENV_CASES, "huge")
    with pytest.raises(InputError, match=r"DSV4_CASES='huge': must be one of \['default', 'full'\]"):
        kw.selected_case_size()


def test_stage_cases_file_is_keyed_by_size(tmp_path, monkeypatch):
    monkeypatch.setenv("DSV4_CASES_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv(kw.ENV_CASES, "default")
    default = kw.stage_cases_file("topk_global")
    full = kw.stage_cases_file("topk_global", "full")
    assert default != full and "topk_global_full-" in full
    monkeypatch.setenv(kw.ENV_CASES, "full")
    assert kw.stage_cases_file("topk_global") == full
    # a stage without a full builder: its full set is its default set
    assert [c.name for c in kw.load_cases(full)] == [c.name for c in kw.load_cases(default)]


@pytest.mark.parametrize("size", [None, "full"])
def test_check_cases_selects_the_set_of_in_process_entries(size, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv(kw.ENV_CASES, "default")  # restored after the test (check --cases sets it)
    f = tmp_path / "entries.py"
    f.write_text(ENTRIES_PY)
    built, handed = [], []
    monkeypatch.setattr(cases_mod, "stage_cases", lambda stage, s="default": built.append((stage, s)) or ["FULL"])

    def run_entry(entry, cases=None, device=None):
        handed.append(cases)
        return [Result(entry=entry.name, stage=entry.stage, case="c0", verdict="pass", rule="stub")]

    monkeypatch.setattr(matrix_mod, "run_entry", run_entry)
    report = tmp_path / "check.json"
    args = ["check", "-q", "--device", "cpu", "--json", str(report), "--no-fixtures", "--no-external",
            "--entries-from", str(f), "--entry", "fake.decode"] + (["--cases", size] if size else [])
    assert main(args) == 0
    capsys.readouterr()
    assert json.loads(report.read_text())["meta"]["cases"] == (size or "default")
    assert (built, handed) == (([("decode", "full")], [["FULL"]]) if size else ([], [None]))
