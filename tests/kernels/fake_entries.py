"""Fake entry-like objects for the crash-isolation tests (run in a child process on CPU).

Each case's ``params["action"]`` says what the fake kernel does: return a value, abort the
process (``os.abort``, as a failed C++ check does; ``sigkill``, as the OOM killer does), print a
marker line to stderr and return (``noisy``), dereference NULL (a segfault, as an illegal
address does on the host side), hang, raise, or report the inherited ``CUDA_VISIBLE_DEVICES``;
``proc`` reports the child's pid, parent pid, torch threads, ``DSV4_FAKE_MARK`` and cwd; ``meet`` waits (at most ``params["wait_s"]``) until ``params["peers"]`` processes have reached a
``meet`` in the folder ``params["dir"]`` and raises if they do not: it passes only when that
many children run at the same time.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time
from types import SimpleNamespace

import torch


def _call(case):
    action = case.params["action"]
    if action == "ok":
        return {"y": case.inputs["x"] * 2}
    if action == "abort":
        os.abort()
    if action == "segv":
        ctypes.string_at(0)  # reads address 0: SIGSEGV
    if action == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)  # as the OOM killer does
    if action == "noisy":
        print(f"NOISE-FROM-{case.name}", file=sys.stderr, flush=True)
        return {"y": case.inputs["x"] * 2}
    if action == "hang":
        time.sleep(3600)
    if action == "raise":
        raise ValueError("fake kernel rejected its input")
    if action == "proc":  # who the child is: pid, parent, intra-op threads, a marker variable, cwd
        return {"proc": torch.tensor([os.getpid(), os.getppid(), torch.get_num_threads(),
                                      int(os.environ.get("DSV4_FAKE_MARK", "-1"))]),
                "cwd": torch.tensor([ord(c) for c in os.getcwd()])}
    if action == "env":
        return {"cvd": torch.tensor([int(os.environ.get("CUDA_VISIBLE_DEVICES", "-1"))])}
    if action == "meet":
        folder = case.params["dir"]
        open(os.path.join(folder, str(os.getpid())), "w").close()
        deadline = time.monotonic() + float(case.params["wait_s"])
        while len(os.listdir(folder)) < int(case.params["peers"]):
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {len(os.listdir(folder))} of {case.params['peers']} children met")
            time.sleep(0.02)
        return {"y": case.inputs["x"] * 2,
                "cvd": torch.tensor([int(os.environ.get("CUDA_VISIBLE_DEVICES", "-1"))]),
                "threads": torch.tensor([torch.get_num_threads()])}
    raise AssertionError(f"unknown action {action}")


FAKE = SimpleNamespace(name="fake.isolation", stage="fake", call=_call)


def fake_judge(entry, cases=None, device=None):
    """A judge with ``oracles.matrix.run_entry``'s signature: calls the entry, passes if
    ``y == 2 x`` exactly."""
    out = []
    for case in cases:
        got = entry.call(case)
        ok = bool(torch.equal(got["y"], case.inputs["x"] * 2))
        out.append({"case": case.name, "verdict": "pass" if ok else "fail", "rule": "exact"})
    return out

# an entry whose availability probe fails (a probing job must run none of its cases), and one
# whose probe passes
MISSING = SimpleNamespace(name="fake.missing", stage="fake", call=_call,
                          available=lambda: (False, "needs the fake package (not installed)"))
PRESENT = SimpleNamespace(name="fake.present", stage="fake", call=_call, available=lambda: (True, ""))
