"""Known-answer tests of the kernelkit comparator, ulp arithmetic and the three-output rule.

Every expected number is worked out by hand in the comment next to it.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dsv4_numerics.oracles import numeric as nm
from dsv4_numerics.reference.errors import InputError

T = lambda *v: torch.tensor(v, dtype=torch.float64)  # noqa: E731
NAN, INF = float("nan"), float("inf")


def test_nan_position_mismatch_fails():
    r = nm.compare(T(1.0, NAN), T(1.0, 2.0), atol=1.0, rtol=1.0, cos_tol=1.0)
    assert not r.passed and r.rule == nm.RULE_ANOMALY
    assert r.anomaly_mismatch == {"nan": 1}


def test_matching_anomalies_pass_and_are_zeroed():
    # NaN/+inf/-inf at the same places; the rest equal -> after zeroing a == r, cos_diff 0.
    x = T(1.0, NAN, INF, -INF, 2.0)
    r = nm.compare(x.clone(), x.clone(), atol=0.0, rtol=0.0, cos_tol=0.0)
    assert r.passed and r.cos_diff == 0.0 and r.mismatch_count == 0


def test_plus_inf_vs_minus_inf_fails():
    r = nm.compare(T(1.0, INF), T(1.0, -INF), atol=1.0, rtol=1.0, cos_tol=1.0)
    assert not r.passed and r.rule == nm.RULE_ANOMALY
    assert r.anomaly_mismatch == {"+inf": 1, "-inf": 1}


def test_abs_or_rel_logic():
    ref = T(1000.0, 1e-4, 1.0)
    got = T(1000.5, 2e-4, 1.0)
    # elem 0: abs 0.5 > 1e-3 but rel 0.5/1000.000001 = 5.0e-4 <= 1e-3 -> passes on rel
    # elem 1: abs 1e-4 <= 1e-3 -> passes on abs (its rel 0.99 is far too big)
    # cos_diff = 1 - 2*sum(a r)/sum(a^2+r^2)
    #   sum(a r)     = 1000500 + 2e-8 + 1            = 1000501.00000002
    #   sum(a^2+r^2) = 1001000.25 + 1e6 + 5e-8 + 2   = 2001002.25000005
    #   cos_diff     = 0.25000001 / 2001002.25000005 ~= 1.24937e-7
    r = nm.compare(got, ref, atol=1e-3, rtol=1e-3, cos_tol=1e-6)
    assert r.passed, r.summary()
    assert r.cos_diff == pytest.approx(0.25000001 / 2001002.25000005, rel=1e-6)
    # with atol 1e-5, elem 1 fails both: abs 1e-4 > 1e-5, rel 1e-4/(1e-4 + 1e-6) = 0.990 > 1e-3
    r = nm.compare(got, ref, atol=1e-5, rtol=1e-3, cos_tol=1e-6)
    assert not r.passed and r.rule == nm.RULE_ELEMENT
    assert r.mismatch_count == 1 and r.mismatch_ratio == pytest.approx(1 / 3)
    # worst abs error is elem 0 (0.5), worst rel is elem 1 (0.990...)
    assert r.max_abs_index == (0,) and r.max_abs == pytest.approx(0.5)
    assert r.max_rel_index == (1,) and r.max_rel == pytest.approx(1e-4 / (1e-4 + 1e-6))


def test_all_zero_output_fails_even_with_huge_tolerances():
    r = nm.compare(T(0.0, 0.0), T(1.0, 2.0), atol=10.0, rtol=10.0, cos_tol=2.0)
    assert not r.passed and r.rule == nm.RULE_ZERO_OUTPUT


def test_zero_reference_is_degenerate_unless_exact_zero_expected():
    r = nm.compare(T(0.0, 0.0), T(0.0, 0.0), atol=1.0, rtol=1.0, cos_tol=1.0)
    assert not r.passed and r.rule == nm.RULE_DEGENERATE
    r = nm.compare(T(0.0, 0.0), T(0.0, 0.0), atol=1.0, rtol=1.0, cos_tol=1.0, zero_ref="exact")
    assert r.passed and r.rule == nm.RULE_EXACT_ZERO
    # 1e-30 is within every tolerance, but an exact-zero expectation admits nothing else
    r = nm.compare(T(0.0, 1e-30), T(0.0, 0.0), atol=1.0, rtol=1.0, cos_tol=1.0, zero_ref="exact")
    assert not r.passed and r.rule == nm.RULE_EXACT_ZERO
    # trivially small but nonzero: sum r^2 = 1e-14 < 1e-12 -> degenerate even under "exact"
    r = nm.compare(T(1e-7, 0.0), T(1e-7, 0.0), atol=1.0, rtol=1.0, cos_tol=1.0, zero_ref="exact")
    assert not r.passed and r.rule == nm.RULE_DEGENERATE


def test_an_all_non_finite_reference_is_matched_exactly_not_degenerate():
    inf, nan = float("inf"), float("nan")
    ref = T(-inf, -inf, inf, nan)
    r = nm.compare(ref.clone(), ref, atol=0.0, rtol=0.0, cos_tol=0.0)
    assert r.passed and r.rule == nm.RULE_ALL_NON_FINITE and r.headroom == float("inf")
    # any other value at any position fails: a finite one, or the other infinity
    for i, v in ((0, 0.0), (1, inf), (2, -inf), (3, 1.0)):
        got = ref.clone()
        got[i] = v
        bad = nm.compare(got, ref, atol=1e9, rtol=1e9, cos_tol=2.0)
        assert not bad.passed and bad.rule == nm.RULE_ANOMALY, (i, v)
    # one finite element left: the ordinary rules again (an all-zero finite part stays degenerate)
    r = nm.compare(T(-inf, 0.0), T(-inf, 0.0), atol=1.0, rtol=1.0, cos_tol=1.0)
    assert not r.passed and r.rule == nm.RULE_DEGENERATE


def test_cosine_rule_decides():
    # every element within atol (9e-4 <= 1e-3), but cos_diff = (1-x)^2/(1+x^2) with x = 1.0009
    # = 8.1e-7 / 2.00180081 = 4.0463e-7 > 1e-7
    ref = torch.ones(4, dtype=torch.float64)
    got = torch.full((4,), 1.0009, dtype=torch.float64)
    r = nm.compare(got, ref, atol=1e-3, rtol=0.0, cos_tol=1e-7)
    assert not r.passed and r.rule == nm.RULE_COSINE
    assert r.cos_diff == pytest.approx(8.1e-7 / 2.00180081, rel=1e-6)
    assert r.headroom == pytest.approx(1e-7 / (8.1e-7 / 2.00180081), rel=1e-6)


def test_headroom_and_binding_rule():
    # abs err 5e-4 against atol 1e-3 -> element headroom 2; cos_diff = (5e-4)^2/(1 + 1.0005^2)
    # = 2.5e-7 / 2.00100025 = 1.2494e-7 -> cosine headroom 1e-5 / 1.2494e-7 = 80.04
    r = nm.compare(T(1.0005), T(1.0), atol=1e-3, rtol=0.0, cos_tol=1e-5)
    assert r.passed and r.rule == nm.RULE_ELEMENT
    assert r.headroom == pytest.approx(2.0)
    assert r.headroom_by_rule[nm.RULE_COSINE] == pytest.approx(1e-5 / (2.5e-7 / 2.00100025), rel=1e-6)


def test_multi_index_and_ulps():
    ref = torch.zeros(2, 3, dtype=torch.float64)
    ref[:] = 1.0
    got = ref.clone()
    got[1, 2] = 1.0 + 2.0**-6  # bf16 ulp at 1.0 is 2^-7 -> 2 ulps
    r = nm.compare(got, ref, atol=1.0, rtol=1.0, cos_tol=1.0, fmt="bf16")
    assert r.max_abs_index == (1, 2) and r.max_ulps_index == (1, 2)
    assert r.max_ulps == 2.0
    assert r.max_abs_values == (1.0 + 2.0**-6, 1.0)


def test_shape_mismatch_is_a_failure_not_an_exception():
    r = nm.compare(torch.zeros(2), torch.ones(3), atol=1.0, rtol=1.0, cos_tol=1.0)
    assert not r.passed and r.rule == nm.RULE_SHAPE


def test_bad_arguments_raise_input_error():
    with pytest.raises(InputError, match="compare: argument 'atol'"):
        nm.compare(T(1.0), T(1.0), atol=-1.0, rtol=0.0, cos_tol=0.0)
    with pytest.raises(InputError, match="argument 'got'"):
        nm.compare([1.0], T(1.0), atol=0.0, rtol=0.0, cos_tol=0.0)
    with pytest.raises(InputError, match="argument 'fmt'"):
        nm.ulp(T(1.0), "fp7")
    ref = torch.arange(1.0, 13.0).view(4, 3)
    with pytest.raises(InputError, match="argument 'allow'.*must broadcast to the reference's shape"):
        nm.compare(ref, ref, atol=0.0, rtol=0.0, cos_tol=0.0, allow=torch.zeros(2, 3))
    for shape in ((3,), (4, 1), (1, 1), (2, 4, 3)):  # broadcasting's rule, as torch.broadcast_shapes has it
        assert nm.compare(ref, ref, atol=0.0, rtol=0.0, cos_tol=0.0, allow=torch.zeros(shape)).passed


def test_ulp_known_values():
    x = T(1.0, 1.5, 0.75, 0.0, 3.0, -3.0)
    # bf16 (7 fraction bits): 1 and 1.5 in [1,2) -> 2^-7; 0.75 in [0.5,1) -> 2^-8; 0 -> 2^(-126-7);
    # 3 in [2,4) -> 2^-6, sign ignored
    assert nm.ulp(x, "bf16").tolist() == [2.0**-7, 2.0**-7, 2.0**-8, 2.0**-133, 2.0**-6, 2.0**-6]
    assert nm.ulp(T(1.0), "fp32").item() == 2.0**-23
    # e4m3: 448 = 1.75*2^8 -> 2^(8-3) = 32; 2^-8 is below the min normal 2^-6 -> 2^(-6-3)
    assert nm.ulp(T(448.0, 2.0**-8), "e4m3").tolist() == [32.0, 2.0**-9]
    assert math.isnan(nm.ulp(T(NAN), "bf16").item())


@given(st.integers(min_value=0x0080, max_value=0x7F7E))
def test_ulp_is_the_gap_to_the_next_bf16(bits):
    # positive normal bf16 patterns: next value = bits + 1; the gap must be ulp(x)
    b = torch.tensor([bits, bits + 1], dtype=torch.int16).view(torch.bfloat16).to(torch.float64)
    assert nm.ulp(b[:1], "bf16").item() == b[1].item() - b[0].item()


@given(st.lists(st.floats(min_value=-1e3, max_value=1e3, allow_nan=False), min_size=1, max_size=32))
def test_identical_tensors_pass_with_zero_tolerance(vals):
    x = torch.tensor(vals, dtype=torch.float64)
    r = nm.compare(x, x.clone(), atol=0.0, rtol=0.0, cos_tol=0.0)
    if float((x * x).sum()) < nm.TRIVIAL_SUMSQ:
        assert not r.passed and r.rule == nm.RULE_DEGENERATE
    else:
        assert r.passed and r.cos_diff == 0.0 and r.max_abs == 0.0


def test_three_output_rule():
    golden = T(1.0, 2.0)
    same = T(1.0 + 2.0**-8, 2.0)
    got = T(1.0 + 2.0**-7, 2.0)
    # e_s = 2^-8, e_k = 2^-7; floor = max half bf16 ulp over golden = ulp(2)/2 = 2^-7
    # bound = 2*2^-8 + 2^-7 = 2^-6 -> pass with headroom 2
    r = nm.three_output(got, golden, same, k=2.0)
    assert r.passed and r.floor == 2.0**-7 and r.bound == 2.0**-6 and r.headroom == 2.0
    # k = 1, no floor: bound 2^-8 < 2^-7 -> fail
    r = nm.three_output(got, golden, same, k=1.0, floor=0.0)
    assert not r.passed and r.rule == nm.RULE_THREE_OUTPUT
    # NaN where the golden has none -> anomaly
    r = nm.three_output(T(NAN, 2.0), golden, same, k=2.0)
    assert not r.passed and r.rule == nm.RULE_ANOMALY


def test_exact_equal_compares_bits():
    a = torch.tensor([1.0, -0.0], dtype=torch.bfloat16)
    b = torch.tensor([1.0, 0.0], dtype=torch.bfloat16)  # -0.0 vs +0.0: equal values, different bits
    r = nm.exact_equal(a, b)
    assert not r.passed and r.mismatch_count == 1
    assert nm.exact_equal(a, a.clone()).passed


def test_ulps_in_the_relative_regime_ignore_near_zero_references():
    # ref [1.0, 1e-6], got [1 + 2^-7, 2e-6]: element 1 is 1e-6 off at a ref of 1e-6 (bf16 ulp
    # there is 2^-27 ~ 7.5e-9: ~134 ulps), element 0 is 1 ulp off. With atol 1e-3, rtol 1e-2 the
    # relative regime is |r| >= 0.1: only element 0 -> 1 ulp.
    r = nm.compare(T(1.0 + 2.0**-7, 2e-6), T(1.0, 1e-6), atol=1e-3, rtol=1e-2, cos_tol=1.0, fmt="bf16")
    assert r.max_ulps_rel_regime == 1.0
    assert r.max_ulps == pytest.approx(1e-6 / 2.0**-27)
