"""derive.py: its precision models agree with the oracle, and its records validate."""

from __future__ import annotations

import math

import pytest
import torch

from dsv4_numerics.oracles import derive
from dsv4_numerics.oracles.tolerances import Tolerances
from dsv4_numerics.reference.attention.ordered import sparse_attention

SMALL = derive.Config("tiny", T=2, H=4, K_main=64, K_extra=32, scale=512**-0.55, domain="decode", sink=True)


def test_unrounded_model_is_the_oracle():
    # with no rounding points the derivation's dense model must equal the fp64 oracle (up to
    # float64 summation order), so the measured errors are the rounding model's alone
    inp = derive.make_inputs(SMALL, 3)
    ex = sparse_attention(inp["q"], inp["segments"], inp["scale"], inp["sink"])
    m = derive.softmax_model(inp["q"], inp["segments"], inp["scale"], inp["sink"], "none", "none")
    fin = torch.isfinite(ex.lse)
    assert torch.allclose(m["out"], ex.out, rtol=1e-12, atol=1e-15)
    assert torch.allclose(m["lse"][fin], ex.lse[fin], rtol=1e-12, atol=1e-12)
    assert torch.equal(torch.isinf(m["lse"]), torch.isinf(ex.lse))


def test_records_validate_and_cover_the_model_with_margin():
    meas = derive.sweep(seeds=1, configs=(SMALL,))
    recs = derive.records(meas, seeds=1)
    tol = Tolerances.from_dicts(recs + derive.ASSIGNMENTS)
    a = tol.defaults[("A", "out")]
    assert a.atol_unit == "vrms" and a.three_output_k == derive.MARGIN
    # rtol = M * measured relative error (bf16 ulps), rounded up: never below the measurement
    assert a.rtol_ulps >= derive.MARGIN * meas[("A", "out")]["rel_ulps"]
    assert tol.defaults[("C", "deq")].block_mult == 16.0
    assert meas[("C", "deq")]["max_err_over_scale"] <= 16.0


def test_round_up_never_rounds_down():
    for v in (1.234e-5, 9.999e-3, 0.1, 3.0):
        r = derive.round_up_3(v)
        assert r >= v and r <= v * 1.01 + 1e-300
    assert derive.round_up_3(0.0) == 0.0 and math.isinf(derive.round_up_3(math.inf))


def test_arch_records_are_scoped_overrides(tmp_path):
    meas = derive.sweep(seeds=1, configs=(SMALL,))
    base = derive.records(meas, seeds=1)
    arch = derive.records(meas, arch="sm100", seeds=1)
    assert all(r["kind"] == "override" and r["scope"]["arch"] == "sm100" for r in arch)
    t = Tolerances.from_dicts(base + arch)
    assert t.lookup("any.kernel", "out", arch="sm100").kind == "override"
    assert t.lookup("any.kernel", "out", arch="sm90").kind == "default"


@pytest.mark.slow  # scheduled first under xdist (root conftest): 9-11 s on a loaded GPU host
def test_shipped_records_are_what_derive_gives():
    # tolerances.jsonl must be the output of `derive --seeds 3` (header says so): no hand edits
    import json

    from dsv4_numerics.oracles.tolerances import DEFAULT_PATH

    shipped = [json.loads(s) for s in DEFAULT_PATH.read_text().splitlines() if s.strip() and not s.startswith("#")]
    again = json.loads(json.dumps(derive.records(derive.sweep(seeds=3), seeds=3) + derive.ASSIGNMENTS))

    # derive's reductions have a fixed order: the records are the same bits on every host,
    # so the shipped file must be reproduced EXACTLY (a hand edit or a host dependence fails)
    assert len(shipped) == len(again)
    for i, (a, b) in enumerate(zip(shipped, again)):
        assert a == b, f"line {i}: shipped {a!r}\n != derived {b!r}"


def test_derive_is_independent_of_thread_count():
    # the sweep must not depend on the intra-op thread count (no BLAS/threaded reductions)
    cfgs = (SMALL, derive.Config("tiny_peaked", T=2, H=4, K_main=64, K_extra=32, scale=4.0, domain="decode",
                                 sink=False, tiers=("A",)))
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = derive.records(derive.sweep(seeds=1, configs=cfgs), seeds=1)
        torch.set_num_threads(2)
        two = derive.records(derive.sweep(seeds=1, configs=cfgs), seeds=1)
    finally:
        torch.set_num_threads(old)
    assert one == two


LARGE = derive.Config("tiny_large", T=2, H=4, K_main=64, K_extra=32, scale=2**9 * 512**-0.55, domain="decode",
                      sink=True, tiers=("A",), stats_only=True)


def _one_key(qk_parts: tuple[float, float], scale: float, sink: float | None = None):
    """q, K with exactly representable products: one valid key, <q, K> = sum(qk_parts)."""
    from dsv4_numerics.reference.attention.ordered import Segment
    from dsv4_numerics.reference.constants import HEAD_DIM

    q = torch.zeros(1, 1, HEAD_DIM)
    k = torch.zeros(2, HEAD_DIM)
    q[0, 0, 0], q[0, 0, 1] = qk_parts
    k[0, 0], k[0, 1] = 1.0, 1.0
    seg = Segment(k.to(torch.bfloat16), torch.tensor([[0, -1]], dtype=torch.int32), torch.tensor([1], dtype=torch.int32))
    sk = None if sink is None else torch.tensor([sink])
    return q.to(torch.bfloat16), [seg], scale, sk


def test_base2_model_is_flashmla_arithmetic_step_by_step():
    # attention 2.1: one key, so L = exp2(0) = 1, ln L = 0 and lse = max_logits = fl32(M * fl32(ln2)),
    # M = fl32(qk * fl32(fl32(scale) * fl32(1.44269504))); computed here independently in numpy fp32
    import numpy as np

    f = np.float32
    for qk_parts, scale in (((96.0, 0.375), 512**-0.55), ((-40.0, 1.5), 2**9 * 512**-0.55), ((3.0, 0.25), 0.5)):
        q, segs, sc, _ = _one_key(qk_parts, scale)
        c = f(f(scale) * f(1.44269504))
        M = f(f(sum(qk_parts)) * c)
        want = float(f(M * f(np.log(2.0))))
        m = derive.softmax_model(q, segs, sc, None, "none", "none", torch.float32, base2=True)
        assert float(m["max_logits"][0, 0]) == want and float(m["lse"][0, 0]) == want
        nat = derive.softmax_model(q, segs, sc, None, "none", "none", torch.float32)
        assert float(nat["max_logits"][0, 0]) == float(f(f(sum(qk_parts)) * f(scale)))


def test_base2_sink_enters_in_log2_units():
    # out = V / (L + exp2(fl32(sink * log2e) - M)): with sink = the logit itself, out = V / 2 (to fp32 rounding)
    q, segs, sc, _ = _one_key((3.0, 0.25), 0.5)
    sink = 3.25 * 0.5
    m = derive.softmax_model(q, segs, sc, torch.tensor([sink]), "none", "none", torch.float32, base2=True)
    assert abs(float(m["out"][0, 0, 0]) - 0.5) < 4 * derive.FP32_EPS
    # lse and max_logits ignore the sink (FlashMLA, attention 2.2)
    assert float(m["lse"][0, 0]) == float(derive.softmax_model(q, segs, sc, None, "none", "none", torch.float32,
                                                                  base2=True)["lse"][0, 0])


def test_base2_needs_fp32():
    import pytest

    from dsv4_numerics.reference.errors import InputError

    q, segs, sc, _ = _one_key((3.0, 0.25), 0.5)
    with pytest.raises(InputError, match="base2"):
        derive.softmax_model(q, segs, sc, None, "none", "none", torch.float64, base2=True)


def test_lse_records_cover_both_arithmetics_at_large_logits():
    # the tier-A lse / max_logits figures are the worse of the natural and base-2 fp32 models,
    # measured on large logits too (|lse| ~ 100: the GPU fuzz's q x 2**6 range)
    from dsv4_numerics.reference.attention.ordered import sparse_attention as sa
    from dsv4_numerics.reference.policies import AttentionMode

    names = {c.name for c in derive.CONFIGS if c.stats_only}
    assert names == {"large_logits_decode", "large_logits_prefill", "large_logits_decode_h128",
                     "large_logits_prefill_h128"}
    assert {c.H for c in derive.CONFIGS if c.stats_only} == {16, 128}  # production head counts too
    meas = derive.sweep(seeds=1, configs=(LARGE,))
    assert ("A", "out") not in meas  # stats_only: the large-logit configs judge the statistics only
    inp = derive.make_inputs(LARGE, 1000 * 0 + len(LARGE.name))
    ex = sa(inp["q"], inp["segments"], inp["scale"], inp["sink"], mode=AttentionMode.EXACT)
    assert float(ex.lse[torch.isfinite(ex.lse)].abs().max()) > 50.0
    differ = False
    for base2 in (False, True):
        m = derive.softmax_model(inp["q"], inp["segments"], inp["scale"], inp["sink"], "none", "none",
                                  torch.float32, base2=base2)
        for out, ref in (("lse", ex.lse), ("max_logits", ex.max_logits)):
            e = derive.model_errors(m[out], ref, derive.FP32_EPS)
            assert meas[("A", out)]["rel_ulps"] >= e["rel_ulps"] and meas[("A", out)]["abs"] >= e["abs"]
        differ |= base2 and not torch.equal(m["lse"], derive.softmax_model(
            inp["q"], inp["segments"], inp["scale"], inp["sink"], "none", "none", torch.float32)["lse"])
    assert differ, "the base-2 model must round differently from the natural one"
    recs = {(r["tier"], r["scope"]["output"]): r for r in derive.records(meas, seeds=1)}
    assert "base-2" in recs[("A", "lse")]["derived"]


def test_rtol_under_a_clamped_atol_comes_from_the_elements_atol_leaves_uncovered():
    """When the ceiling clamps atol, the relative limit must cover exactly the elements with
    M*err above the ceiling: a near-zero reference (huge relative error, tiny absolute error,
    covered by atol) must not set it; without a clamp the old rule (max rel) stays."""
    eps = derive.FP32_EPS
    cap = 1e-5
    exact = torch.tensor([1e-3, 50.0, 100.0, -2.0], dtype=torch.float64)
    err = torch.tensor([1e-7, 3 * eps * 50.0, 2 * eps * 100.0, 1e-6], dtype=torch.float64)
    e = derive.model_errors(exact + err, exact, eps, atol_cap=cap)
    # element 0: rel 1e-4 (~839 ulps) but M*err = 2e-7 <= cap; elements 1, 2: M*err > cap
    assert e["rel_ulps"] > 800 and abs(e["rel_ulps_uncovered"] - 3.0) < 1e-6  # (|ref| + REL_EPS) denominators
    assert derive.model_errors(exact + err / 100, exact, eps, atol_cap=cap)["rel_ulps_uncovered"] == 0.0
    base = {"cos": 0.0, "ref_ms_min": 1.0, "samples": 1}
    clamped = {("A", "lse"): dict(base, abs=2e-5, rel_ulps=839.0, rel_ulps_uncovered=3.0)}
    rec = derive.records(clamped, seeds=1)[0]
    assert rec["atol"] == 1e-5 and rec["rtol_ulps"] == 6.0 and "does not cover" in rec["derived"]
    free = {("A", "lse"): dict(base, abs=4e-6, rel_ulps=5.0, rel_ulps_uncovered=0.0)}
    rec = derive.records(free, seeds=1)[0]
    assert rec["atol"] == 8e-6 and rec["rtol_ulps"] == 10.0 and "does not cover" not in rec["derived"]
