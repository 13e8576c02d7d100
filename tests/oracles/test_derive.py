"""derive.py: its precision models agree with the oracle, and its records validate."""

from __future__ import annotations

import math

import torch

from dsv4_numerics.oracles import derive
from dsv4_numerics.oracles.tolerances import Tolerances
from dsv4_numerics.reference.attention import sparse_attention

SMALL = derive.Config("tiny", T=2, H=4, K_main=64, K_extra=32, scale=512**-0.55, domain="decode", sink=True)


def test_unrounded_model_is_the_oracle():
    # with no rounding points the derivation's dense model must equal the fp64 oracle (up to
    # float64 summation order), so the measured errors are the rounding model's alone
    inp = derive.make_inputs(SMALL, 3)
    ex = sparse_attention(inp["q"], inp["segments"], inp["scale"], inp["sink"])
    m = derive._softmax_model(inp["q"], inp["segments"], inp["scale"], inp["sink"], "none", "none")
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
        r = derive._r(v)
        assert r >= v and r <= v * 1.01 + 1e-300
    assert derive._r(0.0) == 0.0 and math.isinf(derive._r(math.inf))


def test_arch_records_are_scoped_overrides(tmp_path):
    meas = derive.sweep(seeds=1, configs=(SMALL,))
    base = derive.records(meas, seeds=1)
    arch = derive.records(meas, arch="sm100", seeds=1)
    assert all(r["kind"] == "override" and r["scope"]["arch"] == "sm100" for r in arch)
    t = Tolerances.from_dicts(base + arch)
    assert t.lookup("any.kernel", "out", arch="sm100").kind == "override"
    assert t.lookup("any.kernel", "out", arch="sm90").kind == "default"


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
