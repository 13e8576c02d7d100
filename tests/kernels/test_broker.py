"""The kernel broker (``dsv4_numerics.runner.broker``): kernel children that every xdist worker of a
run shares, a few per GPU. Proved on the CPU with the fake kernels of the isolation tests: jobs of
several clients run in at most ``per_gpu`` children per GPU, each pinned to its GPU; a crash fails
only its case and restarts one child; bad switches and arguments are named; and a real
``pytest -n 2`` matrix run goes through it."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from multiprocessing.connection import Client
from pathlib import Path

import pytest
import torch

from dsv4_numerics.runner import broker as wb
from dsv4_numerics.runner import pool as wp
from dsv4_numerics.runner.case_files import load_outputs, save_cases
from dsv4_numerics.reference.cases import Case
from dsv4_numerics.reference.errors import InputError

FAKE = "tests.kernels.fake_entries:FAKE"
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _cpu_children(monkeypatch):
    monkeypatch.setenv(wp.CHILD_DEVICE_ENV, "cpu")  # the fakes need no CUDA context
    for k in (wb.ADDRESS_ENV, wb.KEY_ENV, wb.SWITCH_ENV, wb.PER_GPU_ENV):
        # set, then deleted: monkeypatch then restores the variable's absence after the test, even
        # where the code under test (maybe_start) writes os.environ itself -- a broker address left
        # behind would send this xdist worker's later matrix items to a closed broker
        monkeypatch.setenv(k, "")
        monkeypatch.delenv(k)


def _cases(tmp_path, actions, **params):
    cases = [Case(f"c{i}-{a}", "fake", {"x": torch.tensor([float(i), -1.5])}, {"action": a, **params})
             for i, a in enumerate(actions)]
    path = tmp_path / f"cases-{'-'.join(actions)}.safetensors"
    save_cases(cases, path)
    return str(path), [c.name for c in cases]


def test_jobs_of_several_workers_share_per_gpu_children_pinned_to_their_gpus(tmp_path, monkeypatch):
    meet = tmp_path / "meet"
    meet.mkdir()
    # four jobs at once that each wait until 4 children run together: they pass only if the
    # broker runs them concurrently, two per "GPU"
    path, names = _cases(tmp_path, ["meet"], dir=str(meet), peers=4, wait_s=60)
    with wb.KernelBroker(2, gpus=["3", "5"], workdir=str(tmp_path / "children")) as broker:
        key = broker.authkey
        replies: list = []

        def client(i):  # one connection per "worker", as each xdist worker holds its own
            with Client(broker.address, family="AF_UNIX", authkey=key) as conn:
                wb.send_json(conn, {"op": "run", "entry": FAKE, "case_names": names,
                                    "kwargs": {"device": "cpu", "cases_file": path, "mode": "raw",
                                               "workdir": str(tmp_path / f"w{i}")}})
                replies.append(wb.recv_json(conn))

        threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert len(replies) == 4 and all(r["ok"] for r in replies), replies
        outs = [load_outputs(r["result"][names[0]]["outputs_file"]) for r in replies]
        assert sorted(int(o["cvd"]) for o in outs) == [3, 3, 5, 5]  # two children per GPU, pinned
        # a client with a wrong key is refused, and the broker goes on serving the others
        from multiprocessing import AuthenticationError

        with pytest.raises((AuthenticationError, EOFError, ConnectionError)):
            Client(broker.address, family="AF_UNIX", authkey=b"not the key")
        # later jobs reuse the same children: no fifth start
        monkeypatch.setenv(wb.ADDRESS_ENV, broker.address)
        monkeypatch.setenv(wb.KEY_ENV, key.hex())
        p2, n2 = _cases(tmp_path, ["ok", "ok"])
        res = wb.run_isolated(FAKE, n2, device="cpu", cases_file=p2, mode="raw", workdir=str(tmp_path / "w9"))
        assert [res[n]["verdict"] for n in n2] == ["ran", "ran"]
        assert broker.children_started == 4 and broker.jobs_served == 5
    assert not Path(broker.address).exists()  # closed: socket removed, children ended
    assert all(s.pid is None for s in broker.pool.sessions)


def test_a_crash_fails_only_its_case_and_restarts_one_child(tmp_path, monkeypatch):
    path, names = _cases(tmp_path, ["ok", "abort", "ok"])
    with wb.KernelBroker(1, gpus=[], workdir=str(tmp_path / "children")) as broker:
        monkeypatch.setenv(wb.ADDRESS_ENV, broker.address)
        monkeypatch.setenv(wb.KEY_ENV, broker.authkey.hex())
        res = wb.run_isolated(FAKE, names, device="cpu", cases_file=path, mode="raw", workdir=str(tmp_path / "w"))
        assert [res[n]["verdict"] for n in names] == ["ran", "error", "ran"]
        assert res[names[1]]["rule"] == "crash" and "SIGABRT" in res[names[1]]["message"]
        assert broker.children_started == 2  # the crashed child and its successor
        # a job the broker cannot even set up is an error of that job, with the broker's traceback
        with pytest.raises(wb.BrokerError, match="could not run the job"):
            wb.run_isolated(FAKE, names, device="cpu", cases_file=path, no_such_argument=1)


def test_switch_arguments_and_a_missing_broker_are_named(monkeypatch, tmp_path):
    assert wb.switch() == "auto"
    for v, want in (("on", "on"), ("1", "on"), ("OFF", "off"), ("auto", "auto")):
        monkeypatch.setenv(wb.SWITCH_ENV, v)
        assert wb.switch() == want
    monkeypatch.setenv(wb.SWITCH_ENV, "sometimes")
    with pytest.raises(InputError, match=wb.SWITCH_ENV):
        wb.switch()
    monkeypatch.setenv(wb.SWITCH_ENV, "off")
    assert wb.maybe_start(16) is None
    monkeypatch.setenv(wb.SWITCH_ENV, "auto")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # no GPU visible: auto stays off
    assert wb.maybe_start(16) is None
    monkeypatch.setenv(wb.SWITCH_ENV, "on")
    assert wb.maybe_start(0) is None  # no workers: nothing to share
    with pytest.raises(InputError, match="per_gpu"):
        wb.KernelBroker(0, gpus=[])
    with pytest.raises(InputError, match="session"):
        wb.run_isolated(FAKE, None, session=object())
    assert [wb.default_per_gpu(w, g) for w, g in ((16, 1), (32, 2), (32, 4), (64, 4), (2, 1), (64, 1))] == [8, 8, 4, 8, 2, 32]
    monkeypatch.setenv(wb.ADDRESS_ENV, str(tmp_path / "nothing-here"))
    monkeypatch.setenv(wb.KEY_ENV, "00")
    with pytest.raises(wb.BrokerUnreachable, match="no kernel broker at"):
        wb.warm()


def test_maybe_start_hands_its_address_to_the_workers(monkeypatch):
    monkeypatch.setenv(wb.SWITCH_ENV, "on")
    monkeypatch.setenv(wb.PER_GPU_ENV, "3")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    broker = wb.maybe_start(4)
    try:
        assert broker is not None and broker.gpus == [] and broker.pool.jobs == 3
        assert os.environ[wb.ADDRESS_ENV] == broker.address and bytes.fromhex(os.environ[wb.KEY_ENV]) == broker.authkey
        wb.warm()  # through the environment, as a worker does
        assert len(broker.pool.sessions) == 3
    finally:
        broker.close()
        wb.CONNECTIONS.clear()  # this test's connection, not left to the next


@pytest.mark.slow
def test_an_xdist_run_of_the_matrix_goes_through_the_broker(tmp_path):
    """End to end, as the GPU runner does: ``pytest -n 2`` with the broker on runs a real entry's
    matrix items in the controller's children (one here), ends them once the last matrix item is
    torn down, and says so in its summary."""
    from dsv4_numerics.kernels import registry

    entry = next((e for e in registry.all_entries() if e.name == "vllm_cpu.mla_decode"), None)
    ok, reason = entry.available() if entry else (False, "not registered")
    if not ok:
        pytest.skip(f"vllm_cpu.mla_decode: {reason}")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "DSV4_KERNEL_BROKER"))}
    env.update({wb.SWITCH_ENV: "on", wb.PER_GPU_ENV: "1", "DSV4_TIMELINE": ""})
    from dsv4_numerics.runner.releases import staged_releases

    rels = staged_releases(entry)
    if rels:  # several releases staged: each runs in its release's own child, not the broker's
        env["DSV4_STAGED"] = str(rels[-1][1])
    env.pop("DSV4_TIMELINE")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "-q", "-p", "no:cacheprovider",
                           "tests/kernels/test_matrix.py", "-k", "vllm_cpu.mla_decode"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    line = next((x for x in out.splitlines() if x.startswith("kernel broker:")), None)
    assert line is not None, out[-3000:]
    jobs, children = int(line.split()[2]), int(line.split()[6])
    assert jobs >= 1 and children == 1, line
    # the matrix items were the broker's only users: its children ended after the last of them,
    # before the session's end, and no test found the broker gone
    assert line.endswith("its children ended after its last user's teardown"), line
    assert "kernel broker unreachable" not in out
    assert " passed" in out


def test_a_worker_whose_broker_is_gone_runs_its_own_child(tmp_path, monkeypatch):
    """The matrix's group runner (tests/kernels/conftest.py ``run_group``): through the broker when
    one answers; with a stale address (a broker that is gone), in the worker's own child, with a
    warning, and without the address for the rest of the session."""
    from .conftest import run_group

    path, names = _cases(tmp_path, ["ok"])
    kw = dict(device="cpu", cases_file=path, mode="raw")
    own: list = []

    def own_session():
        own.append(wp.WorkerSession(workdir=str(tmp_path / "own")))
        return own[-1]

    with wb.KernelBroker(1, gpus=[], workdir=str(tmp_path / "children")) as broker:
        monkeypatch.setenv(wb.ADDRESS_ENV, broker.address)
        monkeypatch.setenv(wb.KEY_ENV, broker.authkey.hex())
        res = run_group(FAKE, names, own_session, workdir=str(tmp_path / "w1"), **kw)
        assert res[names[0]]["verdict"] == "ran" and broker.jobs_served == 1 and not own
    monkeypatch.setenv(wb.ADDRESS_ENV, str(tmp_path / "gone.sock"))
    with pytest.warns(UserWarning, match="kernel broker unreachable, this worker runs its own kernel child"):
        res = run_group(FAKE, names, own_session, workdir=str(tmp_path / "w2"), **kw)
    try:
        assert res[names[0]]["verdict"] == "ran" and len(own) == 1 and own[0].starts == 1
        assert not wb.available()  # the next group goes straight to the worker's own child
    finally:
        own[0].close()


def test_an_interrupted_run_kills_the_shared_children_at_once(tmp_path):
    """close(cancel=True) -- what the root conftest does after a SIGINT -- does not wait for a
    running job (here a hang with a 120 s case limit): the children are killed now."""
    import time

    path, names = _cases(tmp_path, ["hang"])
    broker = wb.KernelBroker(1, gpus=[], workdir=str(tmp_path / "children")).start()
    done: list = []
    t = threading.Thread(target=lambda: done.append(broker.run(FAKE, names, device="cpu", cases_file=path,
                                                               mode="raw", case_timeout_s=120,
                                                               workdir=str(tmp_path / "w"))), daemon=True)
    t.start()
    deadline = time.monotonic() + 60
    while not (broker.pool.sessions and broker.pool.sessions[0].pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    pid = broker.pool.sessions[0].pid
    assert pid is not None
    time.sleep(1.0)  # the job is running: the child has the hang in hand
    t0 = time.monotonic()
    broker.close(cancel=True)
    assert time.monotonic() - t0 < 15
    t.join(30)
    assert all(s.pid is None for s in broker.pool.sessions)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
