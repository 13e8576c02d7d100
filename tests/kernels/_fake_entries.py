"""Fake entry-like objects for the crash-isolation tests (run in a child process on CPU).

Each case's ``params["action"]`` says what the fake kernel does: return a value, abort the
process (``os.abort``, as a failed C++ check does), dereference NULL (a segfault, as an illegal
address does on the host side), hang, raise, or report the inherited ``CUDA_VISIBLE_DEVICES``.
"""

from __future__ import annotations

import ctypes
import os
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
    if action == "hang":
        time.sleep(3600)
    if action == "raise":
        raise ValueError("fake kernel rejected its input")
    if action == "env":
        return {"cvd": torch.tensor([int(os.environ.get("CUDA_VISIBLE_DEVICES", "-1"))])}
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
