"""Tolerance records: scoping, most-specific-first lookup, rejection of unscoped loosening."""

from __future__ import annotations

import json

import pytest

from dsv4_numerics.oracles import tolerances as tl
from dsv4_numerics.reference.errors import InputError

DER = {"derived": "hand-made test record"}


def _default(tier="A", output="out", **kw):
    d = {"kind": "default", "tier": tier, "scope": {"output": output}, "atol": 1e-4,
         "rtol_ulps": 2.0, "rtol_format": "bf16", "cos_tol": 1e-6, **DER}
    d.update(kw)
    return d


def _records():
    return [
        _default(),
        _default(output="lse", atol=1e-6, rtol_ulps=100.0, rtol_format="fp32"),
        _default(tier="B", atol=2e-2, rtol_ulps=4.0, cos_tol=5e-4),
        {"kind": "assign", "tier": "B", "scope": {"kernel": "flashinfer.sm120*"}},
        # tighter than the default with a wildcard kernel: allowed (it never loosens)
        {"kind": "override", "tier": "A", "scope": {"output": "out", "arch": "sm90"}, "atol": 5e-5,
         "rtol_ulps": 2.0, "cos_tol": 1e-6, **DER},
        # scoped loosening with a reason: allowed
        {"kind": "override", "tier": "A", "scope": {"kernel": "rocm.decode", "output": "out"},
         "atol": 2e-4, "rtol_ulps": 2.0, "cos_tol": 1e-6, "reason": "split-K reduce order", **DER},
        {"kind": "override", "tier": "A",
         "scope": {"kernel": "rocm.decode", "output": "out", "config": {"h_q": [64, 128]}},
         "atol": 3e-4, "rtol_ulps": 2.0, "cos_tol": 1e-6, "reason": "wide heads", **DER},
    ]


def test_rtol_in_format_units():
    t = tl.Tolerances.from_dicts(_records())
    # bf16 has 7 fraction bits: rtol = 2.0 * 2^-7 = 1/64; fp32: 100 * 2^-23
    assert t.lookup("flashmla.decode", "out").rtol == 2.0 / 128
    assert t.lookup("flashmla.decode", "lse").rtol == 100.0 * 2.0**-23


def test_lookup_most_specific_first():
    t = tl.Tolerances.from_dicts(_records())
    assert t.lookup("flashmla.decode", "out").kind == "default"          # nothing scoped matches
    assert t.lookup("flashmla.decode", "out", arch="sm90").atol == 5e-5  # arch override (score 4)
    assert t.lookup("rocm.decode", "out").atol == 2e-4                   # kernel override
    # kernel + config (score 5) beats kernel alone (score 4)
    assert t.lookup("rocm.decode", "out", params={"h_q": 128}).atol == 3e-4
    assert t.lookup("rocm.decode", "out", params={"h_q": 16}).atol == 2e-4
    assert t.lookup("rocm.decode", "out", params={}).atol == 2e-4  # a missing param never matches


def test_tier_assignment():
    t = tl.Tolerances.from_dicts(_records())
    assert t.tier_of("flashinfer.sm120_decode") == "B"
    assert t.tier_of("flashmla.decode") == "A"  # unassigned -> strictest numeric tier
    assert t.lookup("flashinfer.sm120_decode", "out").atol == 2e-2
    with pytest.raises(InputError, match="no tier B default"):
        t.lookup("flashinfer.sm120_decode", "lse")


def test_unscoped_loosening_is_rejected_at_load():
    recs = _records() + [{"kind": "override", "tier": "A", "scope": {"output": "out", "dtype": "bf16"},
                          "atol": 1e-3, "rtol_ulps": 2.0, "cos_tol": 1e-6, "reason": "x", **DER}]
    with pytest.raises(InputError, match="unscoped loosening"):
        tl.Tolerances.from_dicts(recs)


def test_scoped_loosening_needs_a_reason():
    recs = _records() + [{"kind": "override", "tier": "A", "scope": {"kernel": "k", "output": "out"},
                          "atol": 1e-3, "rtol_ulps": 2.0, "cos_tol": 1e-6, **DER}]
    with pytest.raises(InputError, match="without a 'reason'"):
        tl.Tolerances.from_dicts(recs)


def test_default_may_not_exceed_the_spec_ceiling():
    # attention.md 7 tier A out: abs 1e-3 -> a default with atol 2e-3 is rejected
    with pytest.raises(InputError, match="looser than the attention.md 7 ceiling"):
        tl.Tolerances.from_dicts([_default(atol=2e-3)])
    # ... and a default must be unscoped apart from the output
    with pytest.raises(InputError, match="may name only the output"):
        tl.Tolerances.from_dicts([_default(scope={"output": "out", "arch": "sm90"})])


def test_records_must_say_how_they_were_derived():
    d = _default()
    d.pop("derived")
    with pytest.raises(InputError, match="derived"):
        tl.Tolerances.from_dicts([d])


def test_duplicate_scopes_and_unknown_keys_rejected():
    with pytest.raises(InputError, match="repeats the scope"):
        tl.Tolerances.from_dicts(_records() + [_records()[-1]])
    with pytest.raises(InputError, match="unknown keys"):
        tl.Tolerances.from_dicts([_default(atoll=1.0)])


def test_tier_c_bound_is_half_an_e4m3_step_at_the_top():
    # e4m3 top binade [256, 448]: quantum 2^(8-3) = 32, half = 16 (attention.md 7 tier C)
    assert tl.half_e4m3_step_at_top() == 16.0
    assert tl.TIER_CEILINGS[("C", "deq")]["block_mult"] == 16.0


def test_load_from_file_and_round_trip(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text("# comment\n\n" + "\n".join(json.dumps(d) for d in _records()) + "\n")
    t = tl.Tolerances.load(p)
    rec = t.lookup("rocm.decode", "out")
    assert rec.line == 8  # 2 header lines + 6th record
    again = tl.Tolerances.from_dicts([r.to_dict() for r in t.records])
    assert [r.limits() for r in again.records] == [r.limits() for r in t.records]


def test_shipped_file_loads_and_covers_the_tiers():
    t = tl.default_tolerances()
    for tier, out in [("A", "out"), ("A", "lse"), ("B", "out"), ("C", "deq")]:
        assert (tier, out) in t.defaults
        rec = t.defaults[(tier, out)]
        assert rec.derived and rec.measured, f"tier {tier} {out} default must carry its derivation"


def test_overrides_refine_only_their_own_tier():
    recs = _records() + [
        {"kind": "override", "tier": "B", "scope": {"output": "out", "arch": "sm90"}, "atol": 1e-2,
         "rtol_ulps": 4.0, "cos_tol": 5e-4, **DER},
    ]
    t = tl.Tolerances.from_dicts(recs)
    # same scope {out, sm90} exists for tier A (atol 5e-5) and tier B (atol 1e-2): each tier's
    # kernels get their own
    assert t.lookup("flashmla.decode", "out", arch="sm90").atol == 5e-5
    assert t.lookup("flashinfer.sm120_decode", "out", arch="sm90").atol == 1e-2
    bad = tl.Tolerances.from_dicts(_records() + [
        {"kind": "override", "tier": "B", "scope": {"kernel": "flashmla.decode", "output": "out"}, "atol": 1e-2,
         "rtol_ulps": 4.0, "cos_tol": 5e-4, **DER}])
    with pytest.raises(InputError, match="assigned tier A but the override"):
        bad.lookup("flashmla.decode", "out")


def test_arch_scoped_loosening_needs_a_reason_and_loses_to_a_kernel_record():
    arch_rec = {"kind": "override", "tier": "A", "scope": {"output": "out", "arch": "sm100"}, "atol": 2e-4,
                "rtol_ulps": 2.0, "cos_tol": 1e-6, **DER}
    with pytest.raises(InputError, match="without a 'reason'"):
        tl.Tolerances.from_dicts(_records() + [arch_rec])
    t = tl.Tolerances.from_dicts(_records() + [dict(arch_rec, reason="derived on sm100")])
    assert t.lookup("flashmla.decode", "out", arch="sm100").atol == 2e-4
    # the kernel's own record (kernel 2*2 + output 2 = 6) beats the arch-wide one (output 2 + arch 2 = 4)
    assert t.lookup("rocm.decode", "out", arch="sm100").scope.kernel == "rocm.decode"
