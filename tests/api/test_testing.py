"""The public API (dsv4_numerics.api.testing): cases, judge, assert_matches_reference, explain."""

from __future__ import annotations

import pytest
import torch

import dsv4_numerics as dn
from dsv4_numerics.reference.caches import model1 as cache_model1
from dsv4_numerics.api.testing import SIZES, SMALL_CASES
from dsv4_numerics.reference.cases import default_cases, has_full_cases, stage_cases
from dsv4_numerics.reference.errors import InputError

from ..mutants import MUTANTS, reference_entry

# these tests judge deliberately wrong kernels: their Results are not the suite's matrix
pytestmark = pytest.mark.dsv4_unreported

SMALL_SWA = None


def _swa():
    global SMALL_SWA
    if SMALL_SWA is None:
        SMALL_SWA = dn.cases("swa_write", size="small")
    return SMALL_SWA


def _writer(rule):
    def fn(inputs):
        return {"cache": cache_model1.insert(inputs["cache"], inputs["k"], inputs["slot_mapping"], inputs["block_size"],
                                             rule=rule)}
    return fn


def test_cases_are_the_matrix_cases():
    got, ref = dn.cases("swa_write"), default_cases("swa_write")
    assert [c.name for c in got] == [c.name for c in ref]
    assert all(torch.equal(a.inputs["k"], b.inputs["k"]) for a, b in zip(got, ref))
    assert [c.name for c in dn.cases("swa_write", size="small")] == [c.name for c in ref[:2]]
    assert "swa_write" in dn.stages() and "[bytes]" in dn.stages()["swa_write"]


def test_public_case_sizes_are_the_documented_ones():
    # the sizes the docstring and the README name; a new size needs a case in the test below
    assert SIZES == ("default", "small", "full")
    assert all(f'"{z}"' in dn.cases.__doc__ for z in SIZES)


@pytest.mark.parametrize("stage", sorted(dn.stages()))
def test_public_cases_every_size_of_every_stage(stage):
    # through the public call, not the reference function under it
    got = {z: dn.cases(stage, size=z) for z in SIZES}
    for z, cs in got.items():
        assert cs, (stage, z)
        assert all(c.stage == stage for c in cs), (stage, z)
        names = [c.name for c in cs]
        assert len(set(names)) == len(names), (stage, z, names)
    names = {z: [c.name for c in cs] for z, cs in got.items()}
    # what `check` / the matrix run for the same size (`check --cases default|full`)
    assert names["default"] == [c.name for c in stage_cases(stage, "default")]
    assert names["full"] == [c.name for c in stage_cases(stage, "full")]
    assert names["small"] == names["default"][:SMALL_CASES]
    # full: the default cases first, then the sweep (a stage without a sweep: its default set)
    assert names["full"][:len(names["default"])] == names["default"]
    if has_full_cases(stage):
        assert len(names["full"]) > len(names["default"])
    else:
        assert names["full"] == names["default"]


@pytest.mark.parametrize("call, needle", [
    (lambda: dn.cases("swa_wrte"), "known stages"),
    (lambda: dn.cases("swa_write", size="huge"), "known sizes"),
    (lambda: dn.judge(_writer("amax_clamp"), "nope"), "known stages"),
    (lambda: dn.judge(_writer("amax_clamp"), "swa_write", policies={"scale_rul": "x"}), "known policies"),
    (lambda: dn.judge(_writer("amax_clamp"), "swa_write", policies={"scale_rule": "x"}), "['amax_clamp', 'scale_clamp']"),
])
def test_bad_arguments_name_the_known_ones(call, needle):
    with pytest.raises(InputError, match=None) as ei:
        call()
    assert needle in str(ei.value)


def test_reference_positive_control_passes_and_mutant_fails():
    assert all(r.verdict == "pass" for r in dn.judge(reference_entry("swa_write"), "swa_write", cases=_swa()))
    mutant = next(m for m in MUTANTS if m.name == "swa_scale_rule_swapped")
    assert any(r.verdict == "fail" for r in dn.judge(mutant, "swa_write", cases=_swa()))
    # a plain callable: the reference under its declared policy passes, without it fails
    assert all(r.verdict == "pass" for r in dn.judge(_writer("scale_clamp"), "swa_write", cases=_swa(),
                                                     policies={"scale_rule": "scale_clamp"}))


def test_the_callable_gets_fresh_inputs():
    before = [c.inputs["cache"].clone() for c in _swa()]
    dn.judge(_writer("amax_clamp"), "swa_write", cases=_swa())
    assert all(torch.equal(b, c.inputs["cache"]) for b, c in zip(before, _swa()))


@pytest.mark.parametrize("fn, needle", [
    (lambda i: {"cach": i["cache"]}, "unexpected output 'cach'"),
    (lambda i: {"cache": i["cache"].float()}, "output 'cache' has dtype float32, expected uint8"),
    (lambda i: {"cache": i["cache"][:1]}, "output 'cache' has shape [1,"),
    (lambda i: i["cache"], "returned Tensor; expected a dict"),
])
def test_wrong_outputs_get_one_clear_message(fn, needle):
    r = dn.judge(fn, "swa_write", cases=_swa()[:1])[0]
    assert (r.verdict, r.rule) == ("error", "outputs") and needle in r.message, r.message
    with pytest.raises(AssertionError, match="outputs"):
        dn.assert_matches_reference(fn, "swa_write", cases=_swa()[:1])


def test_attention_may_omit_lse_but_not_out():
    case = dn.cases("decode", size="small")[:1]
    ref = reference_entry("decode")
    only_out = lambda i: {"out": ref.call(dn.Case(i.name, i.stage, dict(i), i.params))["out"]}  # noqa: E731
    assert dn.judge(only_out, "decode", cases=case)[0].verdict == "pass"
    r = dn.judge(lambda i: {"lse": torch.zeros(1)}, "decode", cases=case)[0]
    assert r.rule == "outputs" and "missing output 'out'" in r.message


def test_bytes_assertion_message_explains_the_policy():
    with pytest.raises(AssertionError) as ei:
        dn.assert_matches_reference(_writer("scale_clamp"), "swa_write", cases=_swa())
    msg = str(ei.value)
    for needle in ("1 of 2 cases", "first one in full", "slot=", "tile=", "scale_rule=scale_clamp",
                   "policies={'scale_rule': 'scale_clamp'}"):
        assert needle in msg, (needle, msg)


def test_numeric_assertion_message_has_ulps_and_headroom():
    mutant = next(m for m in MUTANTS if m.name == "sink_scaled")
    with pytest.raises(AssertionError) as ei:
        dn.assert_matches_reference(mutant, "decode", cases=dn.cases("decode", size="small"))
    msg = str(ei.value)
    for needle in ("out: FAIL", "ulps", "headroom", "tolerance: atol", "tier A"):
        assert needle in msg, (needle, msg)


def test_all_skipped_is_an_assertion_error():
    ref = reference_entry("swa_write")

    class Gone:
        name, stage, policies, tolerance_scope, family = "gone", "swa_write", {}, "gone", "reference"
        call = staticmethod(ref.call)

        @staticmethod
        def probe():
            return "needs an sm90 GPU"

    with pytest.raises(AssertionError, match="nothing was judged.*needs an sm90 GPU"):
        dn.assert_matches_reference(Gone(), "swa_write", cases=_swa())


@pytest.mark.slow  # scheduled first under xdist (root conftest): 9-11 s on a loaded GPU host
def test_explain_finds_a_non_default_policy_and_reports_none_for_a_broken_kernel():
    ex = dn.explain(_writer("scale_clamp"), "swa_write", cases=_swa())
    assert ex.matched and ex.declare == {"scale_rule": "scale_clamp"}, str(ex)
    assert "matches: " in str(ex) and "scale_rule=scale_clamp" in str(ex)
    broken = next(m for m in MUTANTS if m.name == "planar_as_interleaved")
    ex = dn.explain(broken, "swa_write", cases=_swa()[:1])
    assert not ex.matched and ex.closest and "matches: none; closest:" in str(ex), str(ex)


def test_strategies_are_public():
    pytest.importorskip("hypothesis")
    from dsv4_numerics.strategies import cache as strategies
    from dsv4_numerics.strategies import index as strategies_index

    assert callable(strategies.bf16_rows) and callable(strategies_index.batches)


def test_explain_of_a_kernel_that_never_runs_says_so():
    def broken(inputs):
        raise RuntimeError("kernel launch failed")

    ex = dn.explain(broken, "swa_write", cases=dn.cases("swa_write", size="small"))
    assert not ex.matches and "nothing was judged: every case errored" in str(ex)
    assert "kernel launch failed" in str(ex)
