"""Crash isolation (dsv4_numerics/kernel_worker.py), proved on CPU with fake kernels that abort,
segfault, hang or raise: the crash fails exactly its own case, the cases after it still run."""

from __future__ import annotations

import os

import torch

from dsv4_numerics.kernel_worker import run_isolated
from dsv4_numerics.reference.cases import Case

FAKE = "tests.kernels._fake_entries:FAKE"
JUDGE = "tests.kernels._fake_entries:fake_judge"


def _cases(tmp_path, actions):
    cases = [Case(f"c{i}-{a}", "fake", {"x": torch.tensor([float(i), -1.5])}, {"action": a})
             for i, a in enumerate(actions)]
    path = tmp_path / "cases.pt"
    torch.save(cases, path)
    return str(path), [c.name for c in cases]


def test_abort_and_segfault_fail_only_their_case(tmp_path):
    path, names = _cases(tmp_path, ["ok", "abort", "ok", "segv", "raise", "ok", "env"])
    # conftest pins an xdist worker with CUDA_VISIBLE_DEVICES; every child must see the same value
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="7")
    res = run_isolated(FAKE, names, device="cpu", cases_file=path, mode="raw", env=env,
                       workdir=str(tmp_path / "w"))
    assert set(res) == set(names)
    for i in (0, 2, 5):  # survivors ran, in fresh processes after each crash
        r = res[names[i]]
        assert r["verdict"] == "ran", r
        out = torch.load(r["outputs_file"])
        # y = 2x for x = [i, -1.5]: [2i, -3.0]
        assert out["y"].tolist() == [2.0 * i, -3.0]
    assert res[names[1]]["verdict"] == "error"
    assert res[names[1]]["rule"] == "crash"
    assert "SIGABRT" in res[names[1]]["message"]
    assert res[names[3]]["rule"] == "crash"
    assert "SIGSEGV" in res[names[3]]["message"]
    # an exception is an error of its case, not a crash of the worker
    assert res[names[4]]["verdict"] == "error"
    assert res[names[4]]["rule"] == "exception"
    assert "fake kernel rejected its input" in res[names[4]]["message"]
    assert torch.load(res[names[6]]["outputs_file"])["cvd"].tolist() == [7]


def test_hang_times_out_and_the_rest_runs_through_the_judge(tmp_path):
    path, names = _cases(tmp_path, ["ok", "hang", "ok"])
    res = run_isolated(FAKE, names, device="cpu", cases_file=path, judge=JUDGE,
                       case_timeout_s=3, workdir=str(tmp_path / "w"))
    assert res[names[0]]["verdict"] == "pass"
    assert res[names[1]]["verdict"] == "error"
    assert res[names[1]]["rule"] == "timeout"
    assert res[names[2]]["verdict"] == "pass"


def test_restart_budget_exhausted_reports_not_run(tmp_path):
    path, names = _cases(tmp_path, ["abort", "ok"])
    res = run_isolated(FAKE, names, device="cpu", cases_file=path, mode="raw", max_restarts=0,
                       workdir=str(tmp_path / "w"))
    assert res[names[0]]["rule"] == "crash"
    assert res[names[1]]["verdict"] == "error"
    assert res[names[1]]["rule"] == "not_run"


def test_setup_error_fails_every_case_with_the_reason(tmp_path):
    res = run_isolated("no.such.kernel", ["a", "b"], device="cpu", workdir=str(tmp_path / "w"))
    assert {r["rule"] for r in res.values()} == {"setup_error"}
    assert "unknown kernel entry 'no.such.kernel'" in res["a"]["message"]
    # without expected names a child that dies in setup yields no invented results
    assert run_isolated("no.such.kernel", None, device="cpu", workdir=str(tmp_path / "w2")) == {}
