"""The matrix runner and the stage judges on small entry-like objects (no kernels needed)."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch

from dsv4_numerics.oracles import matrix
from dsv4_numerics.oracles import stages as st
from dsv4_numerics.oracles.tolerances import Tolerances
from dsv4_numerics.reference.caches import model1 as cache_model1
from dsv4_numerics.reference.cases import default_cases
from dsv4_numerics.reference.errors import UnsupportedCase


@functools.lru_cache(maxsize=None)
def _case(stage, i=0):
    return default_cases(stage)[i]


def _entry(stage, call, policies=None, probe=lambda: None, **kw):
    return SimpleNamespace(name=f"test.{stage}", stage=stage, family="test", policies=policies or {},
                           tolerance_scope=kw.pop("scope", f"test.{stage}"), probe=probe, call=call, **kw)


def _swa_call(rule):
    def call(case):
        i = case.inputs
        return {"cache": cache_model1.insert(i["cache"], i["k"], i["slot_mapping"], i["block_size"], rule)}
    return call


TINY = ("swa_write", 1)  # bs64-s37440-tiny-ties: tiles with amax <= 0.0273 (Q_A != Q_S)


def test_declared_policy_decides_the_expected_bytes():
    case = _case(*TINY)
    ok = matrix.run_entry(_entry("swa_write", _swa_call("scale_clamp"), {"scale_rule": "scale_clamp"}), cases=[case])
    assert ok[0].verdict == "pass" and ok[0].rule == "bit_exact"
    bad = matrix.run_entry(_entry("swa_write", _swa_call("scale_clamp")), cases=[case])  # default: amax_clamp
    assert bad[0].verdict == "fail" and bad[0].headroom == 0.0
    assert "bytes match scale_rule=scale_clamp; reference used scale_rule=amax_clamp" in bad[0].message
    assert bad[0].details["differing_records"] > 0


def test_probe_reason_skips_every_case():
    rs = matrix.run_entry(_entry("topk_global", lambda c: {}, probe=lambda: "needs sm90 (found cpu)"))
    assert rs and all(r.verdict == "skip" and r.message == "needs sm90 (found cpu)" for r in rs)


def test_unsupported_case_is_a_skip_and_a_crash_is_an_error():
    case = _case("topk_global")

    def unsupported(c):
        raise UnsupportedCase("h_q=3 is outside the kernel contract")

    def boom(c):
        raise RuntimeError("CUDA error: an illegal memory access")

    r = matrix.run_entry(_entry("topk_global", unsupported), cases=[case])[0]
    assert (r.verdict, r.rule, r.message) == ("skip", "unsupported", "h_q=3 is outside the kernel contract")
    r = matrix.run_entry(_entry("topk_global", boom), cases=[case])[0]
    assert r.verdict == "error" and r.message == "call raised RuntimeError: CUDA error: an illegal memory access"
    r = matrix.run_entry(_entry("topk_global", lambda c: [1, 2]), cases=[case])[0]
    assert r.verdict == "error" and "not a dict" in r.message
    r = matrix.run_entry(_entry("topk_global", lambda c: {}, supports=lambda c: "not this builder"), cases=[case])[0]
    assert (r.verdict, r.message) == ("skip", "not this builder")


def test_missing_output_and_unknown_stage():
    case = _case("topk_global")
    r = matrix.run_entry(_entry("topk_global", lambda c: {"topk_lens": torch.zeros(4)}), cases=[case])[0]
    assert r.verdict == "fail" and r.rule == "missing_output"
    r = matrix.run_entry(_entry("no_such_stage", lambda c: {}), cases=[case])
    assert r[0].verdict == "error" and r[0].rule == "no_stage_spec"


def test_index_judge_is_exact_and_locates_the_entry():
    from dsv4_numerics.reference.cases.index import run_index_case

    case = _case("topk_global")

    def off_by_one(c):
        out = run_index_case(c)
        g = out["global_topk_indices"].clone()
        g[1, 0] += 1
        return {**out, "global_topk_indices": g}

    r = matrix.run_entry(_entry("topk_global", lambda c: run_index_case(c)), cases=[case])[0]
    assert r.verdict == "pass" and r.rule == "exact"
    r = matrix.run_entry(_entry("topk_global", off_by_one), cases=[case])[0]
    assert r.verdict == "fail" and r.rule == "global_topk_indices:exact"
    assert "token=1 column=0" in r.message


def test_scoped_override_changes_only_its_kernel():
    # a judge on hand-made attention outputs: ref all ones except one element; got has a 1e-3 error
    case = SimpleNamespace(params={}, inputs={})
    e = {"out": torch.ones(2, 4, 8, dtype=torch.float64), "_vrms": torch.tensor(1.0)}
    g = {"out": e["out"].clone()}
    g["out"][1, 2, 3] += 1e-2  # abs 1e-2 > both atols
    base = [{"kind": "default", "tier": "A", "scope": {"output": "out"}, "atol": 1e-3, "rtol_ulps": 0.5,
             "cos_tol": 1e-5, "derived": "test"}]
    loose = base + [{"kind": "override", "tier": "A", "scope": {"kernel": "k.loose", "output": "out"},
                     "atol": 2e-3, "atol_unit": "abs", "rtol_ulps": 2.0, "cos_tol": 1e-5, "derived": "test",
                     "reason": "test override"}]
    tol = Tolerances.from_dicts(loose)
    strict = st.judge_attention(case, e, g, st.JudgeScope("k.strict", tolerances=tol), ("out",))
    scoped = st.judge_attention(case, e, g, st.JudgeScope("k.loose", tolerances=tol), ("out",))
    # |err| = 1e-2 at a reference of 1: rel 1e-2/(1+1e-6) = 0.0099999; strict rtol 0.5/128 = 0.0039 -> fail;
    # scoped rtol 2/128 = 0.0156 -> pass with element headroom 0.015625/0.0099999 = 1.5625
    assert not strict.passed and strict.rule == "out:elementwise_abs_or_rel"
    assert scoped.passed and abs(scoped.headroom - 1.5625) < 1e-4


def test_exact_zero_rows_are_judged_exactly():
    case = SimpleNamespace(params={}, inputs={})
    e = {"out": torch.ones(2, 3, 8, dtype=torch.float64), "_vrms": torch.tensor(1.0)}
    e["out"][0, 1] = 0.0
    zero = torch.zeros(2, 3, dtype=torch.bool)
    zero[0, 1] = True
    e["_zero"] = zero
    g = {"out": e["out"].clone()}
    g["out"][0, 1, 0] = 1e-30  # well inside any tolerance, but the row must be exactly 0
    tol = Tolerances.from_dicts([{"kind": "default", "tier": "A", "scope": {"output": "out"}, "atol": 1e-3,
                                  "rtol_ulps": 2, "cos_tol": 1e-5, "derived": "test"}])
    v = st.judge_attention(case, e, g, st.JudgeScope("k", tolerances=tol), ("out",))
    assert not v.passed and v.rule == "out:exact_zero"
    g["out"][0, 1, 0] = 0.0
    assert st.judge_attention(case, e, g, st.JudgeScope("k", tolerances=tol), ("out",)).passed


def test_every_stage_with_cases_has_a_spec():
    from dsv4_numerics.reference.cases import stages_with_cases

    missing = [s for s in stages_with_cases() if s not in st.STAGES]
    assert not missing, f"stages with default cases but no StageSpec: {missing}"
