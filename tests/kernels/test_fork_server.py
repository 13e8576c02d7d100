"""dsv4_numerics.runner.fork_server: kernel children forked from a server that imported torch once.

The crash-isolation tests (test_isolation.py, test_broker.py) run their children through it by
default; these check what forking must not change -- each child's own environment, working
directory, thread count and process -- and the ways out: the switch, a dead server, an environment
the server cannot serve."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from dsv4_numerics.runner import fork_server
from dsv4_numerics.runner import pool as wp
from dsv4_numerics.runner.case_files import load_outputs, save_cases
from dsv4_numerics.reference.cases import Case

FAKE = "tests.kernels.fake_entries:FAKE"
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(autouse=True)
def _fresh_servers(monkeypatch):
    monkeypatch.setenv(wp.CHILD_DEVICE_ENV, "cpu")
    monkeypatch.delenv(fork_server.ENV_SWITCH, raising=False)
    fork_server.close_all()
    yield
    fork_server.close_all()


def _proc(tmp_path, tag, env):
    """(pid, parent pid, torch threads, DSV4_FAKE_MARK, cwd) of a child running the ``proc`` action."""
    case = Case(f"{tag}-proc", "fake", {"x": torch.tensor([1.0])}, {"action": "proc"})
    path = tmp_path / f"{tag}.safetensors"
    save_cases([case], path)
    with wp.WorkerSession(env, workdir=str(tmp_path / f"s{tag}")) as sess:
        res = wp.run_isolated(FAKE, [case.name], device="cpu", cases_file=str(path), mode="raw",
                              workdir=str(tmp_path / f"w{tag}"), session=sess)
    out = load_outputs(res[case.name]["outputs_file"])
    pid, ppid, threads, mark = (int(v) for v in out["proc"])
    return pid, ppid, threads, mark, "".join(chr(int(c)) for c in out["cwd"])


def test_a_forked_child_has_its_own_environment_threads_and_directory(tmp_path, monkeypatch):
    # both thread variables: torch's pools take MKL's count where MKL is set (a runner exports both,
    # .ci/gpu-matrix: 2 each with 32 workers on 64 cores, where OMP's alone made this child's 2)
    base = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    a = _proc(tmp_path, "a", dict(base, DSV4_FAKE_MARK="7", CUDA_VISIBLE_DEVICES="5"))
    b = _proc(tmp_path, "b", dict(base, DSV4_FAKE_MARK="8"))
    servers = {s.proc.pid for s in fork_server.SERVERS.values()}
    assert len(servers) == 1
    (server,) = servers
    assert a[1] == server and b[1] == server  # forked by the server, not started by this process
    assert a[0] != b[0] and a[0] != server
    assert (a[2], a[3], b[3]) == (1, 7, 8)
    assert a[4] == REPO  # the children run from the repository root, as the plain ones do
    # another thread count is another server (torch sized its pools when the server imported it),
    # and its children have the threads a plain child of that environment has
    c = _proc(tmp_path, "c", dict(base, OMP_NUM_THREADS="2", MKL_NUM_THREADS="2", DSV4_FAKE_MARK="9"))
    assert c[3] == 9 and c[1] not in (server, os.getpid())
    assert len(fork_server.SERVERS) == 2
    monkeypatch.setenv(fork_server.ENV_SWITCH, "0")
    plain = _proc(tmp_path, "plain", dict(base, OMP_NUM_THREADS="2", MKL_NUM_THREADS="2", DSV4_FAKE_MARK="9"))
    assert plain[1] == os.getpid() and plain[2:] == c[2:]


def test_switched_off_the_child_is_started_by_this_process(tmp_path, monkeypatch):
    monkeypatch.setenv(fork_server.ENV_SWITCH, "0")
    pid, ppid, _, mark, _ = _proc(tmp_path, "off", dict(os.environ, DSV4_FAKE_MARK="4"))
    assert ppid == os.getpid() and mark == 4
    assert not fork_server.SERVERS


def test_a_dead_server_is_replaced_and_its_children_still_end(tmp_path):
    env = dict(os.environ, DSV4_FAKE_MARK="1")
    first = _proc(tmp_path, "1", env)
    (srv,) = fork_server.SERVERS.values()
    os.killpg(srv.proc.pid, signal.SIGKILL)
    srv.proc.wait()
    second = _proc(tmp_path, "2", env)
    assert second[1] not in (first[1], os.getpid())  # a new server
    # a child whose server died: its end is still seen (gone from the process table)
    sess = wp.WorkerSession(env, workdir=str(tmp_path / "orphan"))
    sess.warm()
    (live,) = [s for s in fork_server.SERVERS.values() if s.alive()]
    child = sess._proc
    assert isinstance(child, fork_server.ForkedChild) and child.poll() is None
    os.killpg(live.proc.pid, signal.SIGKILL)
    live.proc.wait()
    sess.close(grace_s=0)  # kills the child's group and waits for it
    assert child.poll() is not None


def test_the_server_ends_with_its_input_and_serves_nothing_it_cannot():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "dsv4_numerics.runner.fork_server"], input=b"", capture_output=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == b"ready"


_EXIT_SCRIPT = """
import atexit, os, sys, time
held = []
atexit.register(lambda: print("server-status", held[0].proc.returncode, flush=True))  # runs last
os.environ["DSV4_WORKER_DEVICE"] = "cpu"
from dsv4_numerics.runner import fork_server
from dsv4_numerics.runner import pool as wp
sess = wp.WorkerSession(dict(os.environ))
sess.warm()
deadline = time.monotonic() + 60
while sess.pid is None and time.monotonic() < deadline:
    time.sleep(0.05)
(srv,) = fork_server.SERVERS.values()
held.append(srv)
print(sess.pid, srv.proc.pid, flush=True)
"""  # ends without closing anything: the exit handlers end the session, then the server


def test_at_exit_the_sessions_end_then_the_server_which_waits_for_its_children():
    import subprocess
    import sys
    import time

    out = subprocess.run([sys.executable, "-c", _EXIT_SCRIPT], capture_output=True, text=True, timeout=120,
                         env={k: v for k, v in os.environ.items() if k != fork_server.ENV_SWITCH})
    assert out.returncode == 0, out.stderr[-2000:]
    first, last = out.stdout.splitlines()
    child, server = (int(x) for x in first.split())
    # the server ended by itself (status 0), after its child: not killed at the end of close_all's wait
    assert last == "server-status 0", out.stdout
    for pid in (child, server):  # both gone: the server ended after its child, and was waited for
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        else:
            raise AssertionError(f"process {pid} outlived its parent")
