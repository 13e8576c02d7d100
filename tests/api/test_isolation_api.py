"""``isolate=True`` on the public API (``dsv4_numerics.api.isolation``): a user's kernel that
segfaults, hangs or raises on some cases is judged in a crash-isolated child -- each fault is an
``error`` Result of its own case with the signal or the time-out, the other cases run and are
judged exactly as in-process; what the child cannot import is an ``InputError`` before any child
starts; outputs cross the process boundary with their dtype and geometry."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

import dsv4_numerics as dn
from dsv4_numerics.api import isolation
from dsv4_numerics.api.testing import failure_message
from dsv4_numerics.reference.errors import InputError
from dsv4_numerics.runner import pool

from tests.api import faulty_kernels as fk

pytestmark = pytest.mark.dsv4_unreported  # deliberately faulty kernels: not rows of the suite's own matrix
CASES = dn.cases(fk.STAGE)
# the stage's default cases 0-4: 0 and 4 pass, 1 segfaults, 2 hangs, 3 raises (fk.ACTIONS)
assert [c.name for c in CASES[1:4]] == list(fk.ACTIONS)


@pytest.fixture(autouse=True)
def _children_without_a_device_context(monkeypatch):
    """CPU kernels: their children skip the CUDA context a GPU host would give them."""
    monkeypatch.setenv(pool.CHILD_DEVICE_ENV, "cpu")


def _same(a, b) -> None:
    """Two Results of one case judged alike (timings aside)."""
    skip = {"duration_s", "details"}
    da, db = ({k: v for k, v in dataclasses.asdict(r).items() if k not in skip} for r in (a, b))
    assert da == db


@pytest.mark.slow  # two children started after faults and a 3 s time-out
def test_a_fault_a_hang_and_a_raise_are_errors_of_their_cases_and_the_rest_is_judged():
    res = dn.judge(fk.faulty, fk.STAGE, cases=CASES[:5], isolate=True, timeout_s=3)
    by = {r.case: r for r in res}
    assert [r.case for r in res] == [c.name for c in CASES[:5]]
    segv, hang, raised = (by[c.name] for c in CASES[1:4])
    assert (segv.verdict, segv.rule) == ("error", "crash")
    assert "SIGSEGV" in segv.message
    # the child's faulthandler names the kernel's line
    assert "faulty_kernels.py" in segv.details["stderr"] and "in faulty" in segv.details["stderr"]
    assert (hang.verdict, hang.rule) == ("error", "timeout") and "timed out after 3 s" in hang.message
    # an exception is the same `call` error as in-process, with the child's traceback
    here = dn.judge(fk.faulty, fk.STAGE, cases=[CASES[3]])[0]
    assert (raised.verdict, raised.rule, raised.message) == ("error", "call", here.message)
    assert "ValueError: faulty kernel rejects this case" in raised.message
    assert "time.sleep" not in raised.details["traceback"] and "in faulty" in raised.details["traceback"]
    # the cases around the faults ran (in fresh children) and are judged as in-process
    for c in (CASES[0], CASES[4]):
        assert by[c.name].verdict == "pass"
        _same(by[c.name], dn.judge(fk.faulty, fk.STAGE, cases=[c])[0])
    msg = failure_message(res, fk.STAGE)
    assert "3 of 5 cases failed or errored" in msg and "SIGSEGV" in msg and "stderr of the child" in msg


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: the fault is a device-side assert")
def test_a_device_fault_is_an_error_of_its_case_and_the_next_case_runs_in_a_fresh_child(monkeypatch):
    monkeypatch.delenv(pool.CHILD_DEVICE_ENV)
    res = dn.judge(fk.device_fault, fk.STAGE, cases=CASES[:3], device="cuda", isolate=True)
    assert [(r.verdict, r.rule) for r in res] == [("pass", "exact"), ("error", "device_fault"), ("pass", "exact")]
    assert res[1].case == fk.FAULT_ON and "device fault after this case" in res[1].message
    assert "device-side assert" in res[1].message or "CUDA error" in res[1].message


def test_entries_paths_and_explain_run_isolated():
    # an entry-like object bound to a module-level name: found by 'module:FAULTY_ENTRY'
    res = dn.judge(fk.FAULTY_ENTRY, fk.STAGE, cases=CASES[:2], isolate=True)
    assert [(r.entry, r.verdict, r.rule) for r in res] == [("faulty.entry", "pass", "exact"),
                                                         ("faulty.entry", "error", "crash")]
    # a dotted path with a class attribute, as a string
    res = dn.judge("tests.api.faulty_kernels:Kernels.good", fk.STAGE, cases=CASES[:1], isolate=True)
    assert [(r.entry, r.verdict) for r in res] == [("user.tests.api.faulty_kernels.Kernels.good", "pass")]
    # explain calls the kernel once per case in the child; a crashed case errors every policy set
    ex = dn.explain(fk.faulty, fk.STAGE, cases=CASES[:2], isolate=True)
    assert not ex.matched
    assert ex.combinations and all(c.counts["error"] == 1 and c.counts["pass"] == 1 for c in ex.combinations)
    assert "SIGSEGV" in ex.combinations[0].first_problem


def _closure():
    def inner(inputs):
        return fk.reference_outputs(inputs)

    return inner


class _Holder:
    def method(self, inputs):
        return fk.reference_outputs(inputs)


def test_what_the_child_cannot_import_is_an_input_error_before_any_child_starts(monkeypatch):
    def fail_if_started(*a, **k):
        raise AssertionError("a child was started")

    monkeypatch.setattr(pool, "run_isolated", fail_if_started)
    main = fk.reference_outputs.__class__(fk.reference_outputs.__code__, {}, "in_main")
    main.__module__ = "__main__"
    for fn, why in ((lambda inputs: {}, "a lambda has no name"),
                    (_closure(), "defined inside a function"),
                    (main, "defined in __main__"),
                    (_Holder().method, "a bound method is not a module-level name")):
        with pytest.raises(InputError) as e:
            dn.judge(fn, fk.STAGE, cases=CASES[:1], isolate=True)
        assert "judge: argument 'fn'" in str(e.value) and why in str(e.value) and "module:qualname" in str(e.value)
    with pytest.raises(InputError, match=r"argument 'fn' 'tests.api.faulty_kernels:nope' names no importable"):
        dn.judge("tests.api.faulty_kernels:nope", fk.STAGE, isolate=True)
    with pytest.raises(InputError, match="argument 'isolate' must be True, False or None"):
        dn.assert_matches_reference(fk.faulty, fk.STAGE, isolate="yes")
    for bad in (0, -1, float("inf"), "3", True):
        with pytest.raises(InputError, match="argument 'timeout_s' must be a positive number"):
            dn.explain(fk.faulty, fk.STAGE, isolate=True, timeout_s=bad)


def test_with_isolation_the_default_a_lambda_is_judged_here_with_a_warning(monkeypatch):
    monkeypatch.setattr(pool, "run_isolated", lambda *a, **k: pytest.fail("a child was started"))
    before = isolation.set_default(True)
    try:
        with pytest.warns(UserWarning, match="a lambda has no name.*judged in this process instead"):
            res = dn.judge(lambda inputs: fk.reference_outputs(inputs), fk.STAGE, cases=CASES[:1])
        assert [r.verdict for r in res] == ["pass"]
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert dn.judge(lambda inputs: fk.reference_outputs(inputs), fk.STAGE, cases=CASES[:1],
                            isolate=False)[0].verdict == "pass"
    finally:
        isolation.set_default(before)


def test_outputs_cross_with_their_dtype_geometry_and_values(tmp_path):
    pages = torch.arange(3 * 700, dtype=torch.uint8).reshape(3, 700)
    gapped = pages[:, :584 * 1].view(3, 1, 584)  # page stride 700 > 584: a gapped paged-cache view
    out = {"cache": gapped, "bf16": torch.tensor([1.5, -2.0], dtype=torch.bfloat16),
           "fp8": torch.tensor([0.5, 448.0]).to(torch.float8_e4m3fn), "same_storage": pages[1],
           "n": 3, "name": "x", "none": None, "odd": {1, 2}}
    back = isolation.load_outputs(isolation.save_outputs(out, tmp_path / "o.safetensors"))
    for k in ("cache", "bf16", "fp8", "same_storage"):
        assert back[k].dtype == out[k].dtype and back[k].shape == out[k].shape
        assert back[k].stride() == out[k].stride() and back[k].storage_offset() == out[k].storage_offset()
        assert torch.equal(back[k].view(torch.uint8), out[k].view(torch.uint8))
    assert back["cache"].untyped_storage().nbytes() == 3 * 700  # the gaps came along
    assert (back["n"], back["name"], back["none"]) == (3, "x", None)
    assert isinstance(back["odd"], isolation.Opaque) and type(back["odd"]).__name__ == "set"
    lst = isolation.load_outputs(isolation.save_outputs([1], tmp_path / "l.safetensors"))
    assert type(lst).__name__ == "list"
