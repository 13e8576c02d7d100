"""Crash isolation (``worker_pool``, ``worker_child`` and ``case_files`` of ``dsv4_numerics``),
proved on CPU with fake kernels that abort, segfault, hang or raise: the crash fails exactly its
own case, the cases after it still run; several entries' children run at once (``IsolatedPool``)
without one's crash touching another; the cases handed to children (``stage_cases_file``) are
exactly the stage's default cases."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dsv4_numerics.runner import case_files as cf
from dsv4_numerics.runner import pool as wp
from dsv4_numerics.runner.host_cpus import usable_cpus
from dsv4_numerics.runner.pool import IsolatedPool, default_jobs, run_isolated, run_isolated_many
from dsv4_numerics.runner.host_gpus import visible_gpu_ids
from dsv4_numerics.reference.cases import Case, default_cases, stages_with_cases
from dsv4_numerics.reference.errors import InputError

FAKE = "tests.kernels.fake_entries:FAKE"


@pytest.fixture(autouse=True)
def _children_without_a_device_context(monkeypatch):
    """These fakes run on the CPU: their children skip the CUDA context a GPU host would give each
    of the ~40 children these tests start (worker_child.CHILD_DEVICE_ENV)."""
    monkeypatch.setenv(wp.CHILD_DEVICE_ENV, "cpu")
JUDGE = "tests.kernels.fake_entries:fake_judge"


def _cases(tmp_path, actions):
    cases = [Case(f"c{i}-{a}", "fake", {"x": torch.tensor([float(i), -1.5])}, {"action": a})
             for i, a in enumerate(actions)]
    path = tmp_path / "cases.safetensors"
    cf.save_cases(cases, path)
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
        out = cf.load_outputs(r["outputs_file"])
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
    assert cf.load_outputs(res[names[6]]["outputs_file"])["cvd"].tolist() == [7]


def test_hang_times_out_and_the_rest_runs_through_the_judge(tmp_path):
    path, names = _cases(tmp_path, ["ok", "hang", "ok"])
    res = run_isolated(FAKE, names, device="cpu", cases_file=path, judge=JUDGE,
                       case_timeout_s=3, workdir=str(tmp_path / "w"))
    assert res[names[0]]["verdict"] == "pass"
    assert res[names[1]]["verdict"] == "error"
    assert res[names[1]]["rule"] == "timeout"
    assert res[names[2]]["verdict"] == "pass"


def test_a_job_runs_only_the_cases_it_names_and_a_crash_restarts_inside_them(tmp_path):
    """The matrix runs an attention entry's cases in groups (tests/kernels/conftest.py): a job
    given a subset must run exactly that subset, in its order, also across a crash restart."""
    path, names = _cases(tmp_path, ["ok", "ok", "abort", "ok", "ok", "ok"])
    subset = [names[4], names[2], names[3]]
    res = run_isolated(FAKE, subset, device="cpu", cases_file=path, mode="raw", workdir=str(tmp_path / "w"))
    assert list(res) == subset
    assert res[names[2]]["rule"] == "crash"
    assert res[names[4]]["verdict"] == res[names[3]]["verdict"] == "ran"
    events = [json.loads(line) for line in (tmp_path / "w").glob("*.jsonl").__next__().read_text().splitlines()]
    started = [e["case"] for e in events if e["event"] == "start"]
    assert started == subset  # the crash's restart went on inside the subset, nothing else ran


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


# ----------------------------------------------------------------------------- one child, many entries

def _entry(tmp_path, tag, actions):
    cases = [Case(f"{tag}{i}-{a}", "fake", {"x": torch.tensor([float(i), -1.5])}, {"action": a})
             for i, a in enumerate(actions)]
    path = tmp_path / f"{tag}.safetensors"
    cf.save_cases(cases, path)
    return str(path), [c.name for c in cases]


def _pids(workdir) -> dict[str, int]:
    """{case: pid of the child that ran it}, from the ``start`` events of the job's log."""
    out = {}
    for log in Path(workdir).glob("*.jsonl"):
        for line in log.read_text().splitlines():
            ev = json.loads(line)
            if ev.get("event") == "start":
                out[ev["case"]] = ev["pid"]
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.slow  # scheduled first under xdist (root conftest): one of the suite's longest tests
def test_a_session_reuses_its_child_and_a_crash_fails_only_its_case(tmp_path):
    """One WorkerSession across entries: the child is reused while nothing crashes; an abort or
    SIGKILL fails exactly its case, the rest of that entry and the next entry run in a fresh child
    (which later entries reuse); the crash message carries only the crashed job's stderr; a setup
    error leaves the child serving; a hang is killed; close() leaves no child alive."""
    sess = wp.WorkerSession(dict(os.environ), workdir=str(tmp_path / "s"))
    run = {}

    def job(tag, actions, **kwargs):
        path, names = _entry(tmp_path, tag, actions)
        wd = tmp_path / f"w{tag}"
        run[tag] = names
        res = run_isolated(FAKE, names, device="cpu", cases_file=path, judge=JUDGE, workdir=str(wd),
                           session=sess, **kwargs)
        assert set(res) == set(names)
        return res, _pids(wd)

    try:
        a, pa = job("a", ["noisy", "ok"])
        b, pb = job("b", ["ok", "abort", "ok"])
        c, pc = job("c", ["ok", "sigkill"])
        d, pd = job("d", ["ok"])
        assert all(r["verdict"] == "pass" for r in a.values())
        p1 = pa["a0-noisy"]
        assert pa["a1-ok"] == p1 and pb["b0-ok"] == p1  # reused within and across entries
        assert b["b0-ok"]["verdict"] == "pass" and b["b2-ok"]["verdict"] == "pass"
        crash = b["b1-abort"]
        assert crash["rule"] == "crash" and "SIGABRT" in crash["message"]
        assert "NOISE-FROM-a0-noisy" not in crash["message"]  # entry a's output is not b's crash
        p2 = pb["b2-ok"]
        assert p2 != p1 and pc["c0-ok"] == p2  # a fresh child for the rest, reused by c
        assert c["c0-ok"]["verdict"] == "pass"
        assert c["c1-sigkill"]["rule"] == "crash" and "SIGKILL" in c["c1-sigkill"]["message"]
        p3 = pd["d0-ok"]  # c's last case crashed: the next entry gets a fresh child and passes
        assert p3 not in (p1, p2) and d["d0-ok"]["verdict"] == "pass"
        assert sess.starts == 3 and sess.pid == p3
        assert not _alive(p1) and not _alive(p2)

        bad = run_isolated("no.such.kernel", ["x"], device="cpu", workdir=str(tmp_path / "wbad"),
                           session=sess)
        assert bad["x"]["rule"] == "setup_error"
        e, pe = job("e", ["hang", "ok"], case_timeout_s=3)
        assert pe["e0-hang"] == p3  # the setup error did not end the child
        assert e["e0-hang"]["rule"] == "timeout" and e["e1-ok"]["verdict"] == "pass"
        p4 = pe["e1-ok"]
        assert p4 != p3 and not _alive(p3) and sess.starts == 4
    finally:
        sess.close()
    assert sess.pid is None and not _alive(p4)
    with pytest.raises(wp.SessionClosed):
        run_isolated(FAKE, ["z"], device="cpu", cases_file=_entry(tmp_path, "z", ["ok"])[0],
                     workdir=str(tmp_path / "wz"), session=sess)


@pytest.mark.skipif(torch.cuda.is_available() or torch.version.cuda is not None,
                    reason="fakes a device fault with a CPU-only torch build, where torch.cuda.synchronize raises")
def test_a_device_fault_ends_the_child_and_the_next_case_runs_in_a_fresh_one(tmp_path):
    # device "cuda:0" with the fake judge (it ignores the device): every case passes, then the
    # child's after-case synchronize fails as a faulted context does: device_fault, poisoned, exit 3
    path, names = _entry(tmp_path, "f", ["ok", "ok"])
    with wp.WorkerSession(workdir=str(tmp_path / "s")) as sess:
        res = run_isolated(FAKE, names, device="cuda:0", cases_file=path, judge=JUDGE,
                           workdir=str(tmp_path / "w"), session=sess)
        assert [res[n]["rule"] for n in names] == ["device_fault"] * 2
        assert "device fault after this case" in res[names[0]]["message"]
        pids = _pids(tmp_path / "w")
        assert pids[names[0]] != pids[names[1]] and sess.starts == 2
        assert sess.pid is None and not any(_alive(p) for p in pids.values())
        log = (tmp_path / "w" / "tests.kernels.fake_entries_FAKE.jsonl").read_text()
        assert log.count('"poisoned"') == 2


def test_each_job_gets_the_environment_it_asks_for(tmp_path):
    path, names = _entry(tmp_path, "v", ["env"])
    with wp.WorkerSession(workdir=str(tmp_path / "s")) as sess:
        seen = []
        for cvd in ("7", "9", "9"):
            wd = tmp_path / f"w{len(seen)}"
            res = run_isolated(FAKE, names, device="cpu", cases_file=path, mode="raw", workdir=str(wd),
                               env=dict(os.environ, CUDA_VISIBLE_DEVICES=cvd), session=sess)
            seen.append((int(cf.load_outputs(res[names[0]]["outputs_file"])["cvd"]), _pids(wd)[names[0]]))
        assert [v for v, _ in seen] == [7, 9, 9]
        # another environment needs another child; the same one reuses it
        assert seen[0][1] != seen[1][1] and seen[1][1] == seen[2][1] and sess.starts == 2



def test_pytests_per_test_variable_never_restarts_the_child(tmp_path):
    """pytest rewrites PYTEST_CURRENT_TEST before every test: a matrix item asking for "this
    process's environment" must still find the child the previous item used (it restarted for
    every item once: ~5-15 s of imports and CUDA context per matrix item on a GPU host)."""
    path, names = _entry(tmp_path, "p", ["env"])
    with wp.WorkerSession(workdir=str(tmp_path / "s")) as sess:
        pids = []
        for k in range(3):
            env = dict(os.environ, PYTEST_CURRENT_TEST=f"tests/x.py::test_{k} (call)")
            run_isolated(FAKE, names, device="cpu", cases_file=path, mode="raw", workdir=str(tmp_path / f"w{k}"),
                         env=env, session=sess)
            pids.append(_pids(tmp_path / f"w{k}")[names[0]])
        assert len(set(pids)) == 1 and sess.starts == 1
        assert "PYTEST_CURRENT_TEST" not in sess.env

def test_reuse_off_gives_every_entry_a_child_of_its_own(tmp_path, monkeypatch):
    monkeypatch.setenv("DSV4_KERNEL_REUSE", "0")
    path, names = _entry(tmp_path, "r", ["ok"])
    with wp.WorkerSession(workdir=str(tmp_path / "s")) as sess:
        assert sess.reuse is False
        pids = []
        for k in range(2):
            res = run_isolated(FAKE, names, device="cpu", cases_file=path, judge=JUDGE,
                               workdir=str(tmp_path / f"w{k}"), session=sess)
            assert res[names[0]]["verdict"] == "pass"
            pids.append(_pids(tmp_path / f"w{k}")[names[0]])
            assert sess.pid is None and not _alive(pids[-1])  # ended right after its entry
        assert pids[0] != pids[1] and sess.starts == 2


def test_pool_sessions_take_the_queue_by_environment_and_close_their_children(tmp_path):
    path, names = _entry(tmp_path, "q", ["env"])
    with IsolatedPool("cpu", jobs=1) as pool:
        for key, cvd in (("A", "4"), ("B", "6"), ("C", "4")):
            pool.submit(key, FAKE, names, cases_file=path, mode="raw", workdir=str(tmp_path / key),
                        env=dict(os.environ, CUDA_VISIBLE_DEVICES=cvd))
        res = pool.results()
    assert list(res) == ["A", "B", "C"]
    assert [int(cf.load_outputs(res[k][names[0]]["outputs_file"])["cvd"]) for k in "ABC"] == [4, 6, 4]
    # C (same environment as A) was taken before B: one restart, not two
    assert pool.sessions[0].starts == 2
    pids = {_pids(tmp_path / k)[names[0]] for k in "ABC"}
    assert len(pids) == 2 and not any(_alive(p) for p in pids)


def test_a_free_session_takes_the_job_whose_entry_its_children_ran_and_leaves_others_theirs():
    """The pool's choice (``IsolatedPool._pick``, no child started): environment first, then the
    entry run before, then its family; a job another idle session suits better is left to it;
    without an idle rival the best-suited job is taken; whatever the queue, some idle session
    takes a job."""
    pool = IsolatedPool("cpu", jobs=2)
    env = dict(pool.base_env)
    pool.sessions = [wp.WorkerSession(pool._slot_env(i, env)) for i in range(2)]
    pool._ran = {0: {"a.x"}, 1: {"b.y"}}

    def queue(*entries, other_env=()):
        pool._job_env.clear()  # the keys k0, k1, ... are reused below for other jobs
        pool._queue = [(f"k{i}", (e, None), {}, dict(env, DSV4_ENTRIES_FROM="x") if e in other_env else env)
                       for i, e in enumerate(entries)]

    queue("b.y", "a.x", "a.z", "c.w")
    pool._idle = {1}
    assert pool._pick(0) == 1  # a.x: run before here
    pool._idle = {0}
    assert pool._pick(1) == 0  # b.y
    queue("b.y", "c.w")
    pool._idle = {1}
    assert pool._pick(0) == 1  # b.y is session 1's (idle): c.w suits both alike
    queue("b.y")
    assert pool._pick(0) is None  # left to session 1, which takes it
    pool._idle = {0}
    assert pool._pick(1) == 0
    pool._idle = set()
    assert pool._pick(0) == 0  # no idle rival: taken
    queue("a.z", "c.w")
    pool._idle = {1}
    assert pool._pick(0) == 0  # a.z: same family as a.x
    queue("a.x", "c.w", other_env=("a.x",))
    assert pool._pick(0) == 1  # a.x would restart the child: the environment comes first
    import random

    rng = random.Random(0)
    names = ["a.x", "a.z", "b.y", "b.q", "c.w"]
    for _ in range(200):  # some idle session always takes a job
        pool._ran = {0: set(rng.sample(names, rng.randint(0, 3))), 1: set(rng.sample(names, rng.randint(0, 3)))}
        queue(*rng.choices(names, k=rng.randint(1, 4)))
        for idle in ({0, 1}, {0}, {1}):
            pool._idle = set(idle)
            assert any(pool._pick(s) is not None for s in idle), (pool._ran, pool._queue, idle)


def test_pool_kills_its_children_when_the_caller_raises(tmp_path):
    path, names = _entry(tmp_path, "h", ["hang"])
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="caller failed"):
        with IsolatedPool("cpu", jobs=1) as pool:
            pool.submit("H", FAKE, names, cases_file=path, mode="raw", workdir=str(tmp_path / "h"),
                        case_timeout_s=600)
            pool.start()
            while names[0] not in _pids(tmp_path / "h"):  # the child is inside the hanging case
                assert time.monotonic() - t0 < 120
                time.sleep(0.05)
            raise RuntimeError("caller failed")
    assert time.monotonic() - t0 < 120  # not the 600 s case timeout
    assert not _alive(_pids(tmp_path / "h")[names[0]])
    assert pool.sessions[0].closed


def test_serve_protocol_runs_jobs_in_one_process_and_rejects_a_bad_line(tmp_path):
    path, names = _entry(tmp_path, "p", ["ok"])
    logs = [tmp_path / "one.jsonl", tmp_path / "two.jsonl"]
    lines = "".join(json.dumps({"entry": FAKE, "out": str(p), "device": "cpu", "cases": path,
                                "mode": "judge", "judge": JUDGE}) + "\n" for p in logs)
    env = wp.child_environment(None)
    done = subprocess.run([sys.executable, "-m", "dsv4_numerics.runner.child", "--serve"], input=lines,
                          text=True, capture_output=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    evs = [[json.loads(x) for x in p.read_text().splitlines()] for p in logs]
    assert [[e["event"] for e in ev] for ev in evs] == [["cases", "start", "result", "done"]] * 2
    assert evs[0][1]["pid"] == evs[1][1]["pid"]
    assert evs[1][2]["results"][0]["verdict"] == "pass"
    bad = subprocess.run([sys.executable, "-m", "dsv4_numerics.runner.child", "--serve"],
                         input='{"entry": "x"}\n', text=True, capture_output=True, env=env, timeout=300)
    assert bad.returncode == 2 and "bad job line" in bad.stderr and "entry, out" in bad.stderr


# ----------------------------------------------------------------------------- several entries at once

def _meet_cases(tmp_path, tag, actions, meet_dir, peers, wait_s):
    cases = [Case(f"{tag}{i}-{a}", "fake", {"x": torch.tensor([float(i), 0.25])},
                  {"action": a, "dir": str(meet_dir), "peers": peers, "wait_s": wait_s})
             for i, a in enumerate(actions)]
    path = tmp_path / f"{tag}.safetensors"
    cf.save_cases(cases, path)
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
    assert cf.load_outputs(a[na[2]]["outputs_file"])["y"].tolist() == [4.0, 0.5]
    assert cf.load_outputs(b[nb[1]]["outputs_file"])["y"].tolist() == [2.0, 0.5]
    met_a, met_b = (cf.load_outputs(r["outputs_file"]) for r in (a[na[0]], b[nb[0]]))
    assert met_a["y"].tolist() == [0.0, 0.5] and met_b["y"].tolist() == [0.0, 0.5]
    # concurrent children were spread over the two GPUs, one each
    assert sorted([int(met_a["cvd"]), int(met_b["cvd"])]) == [3, 5]
    # and given a share of the CPUs, not all of them each
    want = int(os.environ.get("OMP_NUM_THREADS") or max(1, usable_cpus() // 2))
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
    # B came later, in the same long-lived child: it finds only the file A's process left
    assert "only 1 of 3 children met" in res["B"][nb[0]]["message"]


def test_default_jobs_and_gpu_visibility(monkeypatch):
    assert default_jobs(1, 20, cpus=16) == 8 and default_jobs(2, 20, cpus=32) == 16
    assert default_jobs(2, 3, cpus=16) == 3 and default_jobs(0, 5, cpus=16) == 5
    assert default_jobs(1, 0, cpus=16) == 1 and default_jobs(8, 20, cpus=16) == 8
    assert default_jobs(1, 20, cpus=2) == 1
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2, 6")
    assert visible_gpu_ids(torch_fallback=True) == ["2", "6"]
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
            loaded = cf.load_cases(cf.stage_cases_file(stage))
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
    real = cf.build_cases_file
    monkeypatch.setattr(cf, "build_cases_file", lambda s, p, size="default": built.append(s) or real(s, p, size))
    p1 = cf.stage_cases_file("topk_global")
    assert built == ["topk_global"] and p1.startswith(str(tmp_path / "cache"))
    cf.CASES_FILES.clear()  # a new process: found on disk, not rebuilt
    assert cf.stage_cases_file("topk_global") == p1 and built == ["topk_global"]
    open(p1, "wb").write(b"truncated")
    cf.CASES_FILES.clear()
    assert cf.stage_cases_file("topk_global") == p1 and built == ["topk_global"] * 2
    assert [c.name for c in cf.load_cases(p1)] == [c.name for c in default_cases("topk_global")]
    with pytest.raises(KeyError, match="no default cases registered"):
        cf.stage_cases_file("no-such-stage")
    monkeypatch.setenv("DSV4_CASES_CACHE", "off")  # this process only, never the cache folder
    p3 = cf.stage_cases_file("topk_global")
    assert not p3.startswith(str(tmp_path)) and os.path.isfile(p3)


def test_case_names_come_from_the_sidecar_and_a_changed_file_is_loaded_again(tmp_path, monkeypatch):
    """``case_names`` (what pytest's collection reads in every worker) from the JSON sidecar written
    after the case file; a sidecar whose byte count is not the file's (the file was replaced or cut)
    is not trusted: the file is validated by loading it (and rebuilt if it does not load)."""
    monkeypatch.setenv("DSV4_CASES_CACHE", str(tmp_path / "cache"))
    want = [c.name for c in default_cases("topk_global")]
    p = Path(cf.stage_cases_file("topk_global"))
    side = cf.names_path(p)
    assert side.is_file() and json.loads(side.read_text()) == {"names": want, "bytes": p.stat().st_size}
    loads = []
    real_load = cf.load_cases
    monkeypatch.setattr(cf, "load_cases", lambda path: loads.append(path) or real_load(path))
    assert cf.case_names("topk_global") == want and not loads  # no tensors loaded
    side.write_text(json.dumps({"names": ["stale"], "bytes": p.stat().st_size + 1}))
    assert cf.case_names("topk_global") == want and loads == [str(p)]  # the file itself, not the stale names
    cf.CASES_FILES.clear()  # a new process: the file loads, so it is kept and gets a fresh sidecar
    assert cf.stage_cases_file("topk_global") == str(p)
    assert json.loads(side.read_text())["names"] == want


def test_the_case_key_covers_every_reference_module_subpackages_included(tmp_path, monkeypatch):
    """A change to any module of the ``reference`` package -- the case builders live in its
    ``cases/`` subpackage -- gives the case files a new key (a stale file is never handed out)."""
    from dsv4_numerics import reference

    root = Path(reference.__file__).resolve().parent
    copy = tmp_path / "reference"
    for f in root.rglob("*.py"):
        dst = copy / f.relative_to(root)
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_bytes(f.read_bytes())
    monkeypatch.setattr(reference, "__file__", str(copy / "__init__.py"))
    k0 = cf.cases_key("decode")
    assert cf.cases_key("decode") == k0 and cf.cases_key("prefill") != k0
    builder = copy / "cases" / "attention.py"
    assert builder.is_file()
    builder.write_text(builder.read_text() + "\n# a change\n")
    assert cf.cases_key("decode") == k0  # hashed once per process: the modules it imported
    cf.SOURCES_MEMO.pop(copy)  # the next process
    assert cf.cases_key("decode") != k0


def test_a_warm_pool_starts_its_children_before_the_first_entry(tmp_path):
    """``start(warm=True)`` (what ``check`` does before probing the entries): every session's child
    is started at once, before any entry is submitted, and the entries submitted afterwards run in
    those same children (no second start)."""
    with IsolatedPool("cpu", jobs=2, gpus=["0", "1"], workdir=str(tmp_path / "p")) as pool:
        pool.start(warm=True)
        deadline = time.monotonic() + 60
        while not all(s.pid for s in pool.sessions) and time.monotonic() < deadline:
            time.sleep(0.05)
        pids = [s.pid for s in pool.sessions]
        assert all(pids) and len(set(pids)) == 2
        for tag in ("a", "b", "c"):
            path, names = _entry(tmp_path, tag, ["ok", "ok"])
            pool.submit(tag, FAKE, names, cases_file=path, judge=JUDGE, workdir=str(tmp_path / f"w{tag}"))
        res = pool.results()
        assert all(r["verdict"] == "pass" for v in res.values() for r in v.values())
        ran = {p for tag in ("a", "b", "c") for p in _pids(tmp_path / f"w{tag}").values()}
        assert ran <= set(pids) and all(s.starts == 1 for s in pool.sessions)


def test_a_probing_job_reports_an_unavailable_entry_and_runs_nothing(tmp_path):
    """``probe=True`` (how ``check`` hands entries over unprobed): the child runs the entry's
    availability probe first; a failing probe gives ``{UNAVAILABLE: reason}`` and no case runs;
    a passing one runs the cases as usual, in the same session."""
    from dsv4_numerics.runner.pool import UNAVAILABLE, WorkerSession

    path, names = _entry(tmp_path, "p", ["ok", "ok"])
    with WorkerSession(dict(os.environ), workdir=str(tmp_path / "s")) as sess:
        miss = run_isolated("tests.kernels.fake_entries:MISSING", None, device="cpu", cases_file=path,
                            judge=JUDGE, workdir=str(tmp_path / "m"), session=sess, probe=True)
        assert miss == {UNAVAILABLE: {"verdict": "unavailable", "message": "needs the fake package (not installed)"}}
        assert not _pids(tmp_path / "m")  # no case started
        ok = run_isolated("tests.kernels.fake_entries:PRESENT", names, device="cpu", cases_file=path,
                          judge=JUDGE, workdir=str(tmp_path / "o"), session=sess, probe=True)
        assert set(ok) == set(names) and all(r["verdict"] == "pass" for r in ok.values())
        assert sess.starts == 1


def test_a_job_answered_before_the_parent_looks_is_not_taken_for_silence(tmp_path, monkeypatch):
    """A warm child can answer a quick job (an unavailable entry's probe) before the parent reads
    its log for the first time: that answer counts (the job returns at once, its child is kept),
    instead of the job looking silent until its time limit and its child being killed. Here the
    session's ``send`` returns only once the child has answered."""
    from dsv4_numerics.runner.pool import UNAVAILABLE, WorkerSession

    path, _ = _entry(tmp_path, "m", ["ok"])
    orig = WorkerSession.send

    def send_then_wait_for_the_answer(self, job):
        out = orig(self, job)
        log, deadline = Path(job["out"]), time.monotonic() + 120
        while '"unavailable"' not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.02)
        return out

    monkeypatch.setattr(WorkerSession, "send", send_then_wait_for_the_answer)
    monkeypatch.setattr(wp, "DEFAULT_STARTUP_TIMEOUT_S", 20.0)
    with WorkerSession(dict(os.environ), workdir=str(tmp_path / "s")) as sess:
        for tag in ("a", "b"):  # the second job reaches a warm child: answered at once
            t0 = time.monotonic()
            res = run_isolated("tests.kernels.fake_entries:MISSING", None, device="cpu", cases_file=path,
                               probe=True, case_timeout_s=20.0, workdir=str(tmp_path / tag), session=sess)
            assert list(res) == [UNAVAILABLE], res
            assert time.monotonic() - t0 < 15, "the answered job waited for its time limit"
        assert sess.starts == 1  # never killed for silence
