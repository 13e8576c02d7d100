"""Crash isolation (dsv4_numerics/kernel_worker.py), proved on CPU with fake kernels that abort,
segfault, hang or raise: the crash fails exactly its own case, the cases after it still run; several
entries' children run at once (``IsolatedPool``) without one's crash touching another; the cases
handed to children (``stage_cases_file``) are exactly the stage's default cases."""

from __future__ import annotations

import os

import pytest
import torch

from dsv4_numerics import kernel_worker as kw
from dsv4_numerics.kernel_worker import IsolatedPool, default_jobs, run_isolated, run_isolated_many, visible_gpus
from dsv4_numerics.reference.cases import Case, default_cases, stages_with_cases
from dsv4_numerics.reference.errors import InputError

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


# ----------------------------------------------------------------------------- several entries at once

def _meet_cases(tmp_path, tag, actions, meet_dir, peers, wait_s):
    cases = [Case(f"{tag}{i}-{a}", "fake", {"x": torch.tensor([float(i), 0.25])},
                  {"action": a, "dir": str(meet_dir), "peers": peers, "wait_s": wait_s})
             for i, a in enumerate(actions)]
    path = tmp_path / f"{tag}.pt"
    torch.save(cases, path)
    return str(path), [c.name for c in cases]


def test_two_entries_run_concurrently_and_an_abort_fails_only_its_own_case(tmp_path):
    # both `meet` cases pass only if the two children are alive at the same time (each waits for
    # the other; run one after another, the first gives up after wait_s and errors)
    meet = tmp_path / "meet"
    meet.mkdir()
    pa, na = _meet_cases(tmp_path, "a", ["meet", "abort", "ok"], meet, 2, 120)
    pb, nb = _meet_cases(tmp_path, "b", ["meet", "ok"], meet, 2, 120)
    with IsolatedPool("cpu", jobs=2, gpus=["3", "5"]) as pool:
        pool.submit("A", FAKE, na, cases_file=pa, mode="raw", workdir=str(tmp_path / "wa"))
        pool.submit("B", FAKE, nb, cases_file=pb, mode="raw", workdir=str(tmp_path / "wb"))
        res = pool.results()
    assert list(res) == ["A", "B"]
    a, b = res["A"], res["B"]
    assert a[na[0]]["verdict"] == "ran", a[na[0]]
    assert b[nb[0]]["verdict"] == "ran", b[nb[0]]
    # the crash fails exactly its own case; the same entry continues, the other is untouched
    assert a[na[1]]["rule"] == "crash" and "SIGABRT" in a[na[1]]["message"]
    assert torch.load(a[na[2]]["outputs_file"])["y"].tolist() == [4.0, 0.5]
    assert torch.load(b[nb[1]]["outputs_file"])["y"].tolist() == [2.0, 0.5]
    met_a, met_b = (torch.load(r["outputs_file"]) for r in (a[na[0]], b[nb[0]]))
    assert met_a["y"].tolist() == [0.0, 0.5] and met_b["y"].tolist() == [0.0, 0.5]
    # concurrent children were spread over the two GPUs, one each
    assert sorted([int(met_a["cvd"]), int(met_b["cvd"])]) == [3, 5]
    # and given a share of the CPUs, not all of them each
    want = int(os.environ.get("OMP_NUM_THREADS") or max(1, (os.cpu_count() or 1) // 2))
    assert int(met_a["threads"]) == want and int(met_b["threads"]) == want


def test_jobs_1_runs_entries_one_after_another(tmp_path):
    # the converse, so the test above cannot pass vacuously: one at a time, nobody meets
    meet = tmp_path / "meet"
    meet.mkdir()
    pa, na = _meet_cases(tmp_path, "a", ["meet"], meet, 2, 1.5)
    pb, nb = _meet_cases(tmp_path, "b", ["meet"], meet, 3, 1.5)
    res = run_isolated_many({"A": {"entry": FAKE, "case_names": na, "cases_file": pa, "mode": "raw",
                                   "workdir": str(tmp_path / "wa")},
                             "B": {"entry": FAKE, "case_names": nb, "cases_file": pb, "mode": "raw",
                                   "workdir": str(tmp_path / "wb")}}, device="cpu", jobs=1)
    assert res["A"][na[0]]["rule"] == "exception"
    assert "only 1 of 2 children met" in res["A"][na[0]]["message"]
    assert "only 2 of 3 children met" in res["B"][nb[0]]["message"]  # A's file stays; B came later


def test_default_jobs_and_gpu_visibility(monkeypatch):
    assert default_jobs(1, 20, cpus=16) == 8 and default_jobs(2, 20, cpus=32) == 16
    assert default_jobs(2, 3, cpus=16) == 3 and default_jobs(0, 5, cpus=16) == 5
    assert default_jobs(1, 0, cpus=16) == 1 and default_jobs(8, 20, cpus=16) == 8
    assert default_jobs(1, 20, cpus=2) == 1
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2, 6")
    assert visible_gpus() == ["2", "6"]
    assert IsolatedPool("cuda")._spread == ["2", "6"]
    assert IsolatedPool("cuda:1")._spread == []  # an explicit device: every child on it
    with pytest.raises(InputError, match="jobs must be >= 1"):
        IsolatedPool("cpu", jobs=0)


def test_check_rejects_jobs_below_one(capsys):
    from dsv4_numerics.cli import main

    assert main(["check", "--jobs", "0", "--no-fixtures"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("check: --jobs must be >= 1 (kernel children run at once), got 0")
    assert "\n" not in err


# ----------------------------------------------------------------------------- cases, built once

def _same(a, b, where):
    """Bit-for-bit equality of built cases: tensors by dtype, shape, strides, offset and bytes."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert (a.dtype, a.shape, a.stride(), a.storage_offset()) == (b.dtype, b.shape, b.stride(),
                                                                      b.storage_offset()), where
        assert torch.equal(a.reshape(-1).contiguous().view(torch.uint8),
                           b.reshape(-1).contiguous().view(torch.uint8)), where
        return
    assert type(a) is type(b), (where, type(a), type(b))
    if isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    elif isinstance(a, float) and a != a:
        assert b != b, where
    else:
        assert a == b, (where, a, b)


def test_stage_cases_file_holds_exactly_the_default_cases_of_every_stage(tmp_path, monkeypatch):
    monkeypatch.setenv("DSV4_CASES_CACHE", str(tmp_path / "cache"))
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for stage in stages_with_cases():
            loaded = kw.load_cases(kw.stage_cases_file(stage))
            fresh = default_cases(stage)
            assert [c.name for c in loaded] == [c.name for c in fresh], stage
            for x, y in zip(fresh, loaded):
                assert type(y) is Case and (y.name, y.stage) == (x.name, x.stage)
                _same(x.inputs, y.inputs, f"{stage}/{x.name}.inputs")
                _same(x.params, y.params, f"{stage}/{x.name}.params")
    finally:
        torch.set_num_threads(old)


def test_stage_cases_file_is_built_once_and_rebuilt_when_unreadable(tmp_path, monkeypatch):
    monkeypatch.setenv("DSV4_CASES_CACHE", str(tmp_path / "cache"))
    built = []
    real = kw.build_cases_file
    monkeypatch.setattr(kw, "build_cases_file", lambda s, p: built.append(s) or real(s, p))
    p1 = kw.stage_cases_file("topk_global")
    assert built == ["topk_global"] and p1.startswith(str(tmp_path / "cache"))
    kw._CASES_FILES.clear()  # a new process: found on disk, not rebuilt
    assert kw.stage_cases_file("topk_global") == p1 and built == ["topk_global"]
    open(p1, "wb").write(b"truncated")
    kw._CASES_FILES.clear()
    assert kw.stage_cases_file("topk_global") == p1 and built == ["topk_global"] * 2
    assert [c.name for c in kw.load_cases(p1)] == [c.name for c in default_cases("topk_global")]
    with pytest.raises(KeyError, match="no default cases registered"):
        kw.stage_cases_file("no-such-stage")
    monkeypatch.setenv("DSV4_CASES_CACHE", "off")  # this process only, never the cache folder
    p3 = kw.stage_cases_file("topk_global")
    assert not p3.startswith(str(tmp_path)) and os.path.isfile(p3)
