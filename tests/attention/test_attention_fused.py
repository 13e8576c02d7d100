"""The fast oracle's fused Triton kernels (``reference.attention.fast_fused``): within the returned
bound of the ordered oracle (the bound derived for their summation order), proven-exact logits bit
for bit, the ordered oracle's non-finite conventions (lonely rows, +-inf sinks, NaN/Inf in valid
rows, NaN-poisoned unused rows), sinks on and off, chunking, ``pv_abs``. On a CUDA device the
compiled kernels run; on the CPU Triton's interpreter (``TRITON_INTERPRET=1``, set here before the
kernels are first imported). Every test that runs the kernels skips where Triton is not installed
(CI's CPU runner); the fast oracle itself never imports Triton at import time."""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings

from dsv4_numerics.reference.attention.fast import fast_sparse_attention
from dsv4_numerics.reference.attention.ordered import Segment, sparse_attention
from dsv4_numerics.reference.errors import InputError
from dsv4_numerics.reference.policies import IndexRule, NanPolicy

from .test_attention_fast import assert_matches_ordered, assert_pv_abs_matches_ordered, problems

HAS_TRITON = importlib.util.find_spec("triton") is not None
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if DEV.type == "cpu" and HAS_TRITON:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before fast_fused first imports its kernels

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed (the fused kernels' backend)")


def on(t):
    return None if t is None else t.to(DEV)


def segs_on(segs):
    return [Segment(s.rows.to(DEV), s.idx.to(DEV), on(s.length), s.rule) for s in segs]


def fused_vs_ordered(q, segs, scale, sink=None, nan_policy=NanPolicy.PROPAGATE, chunk_tokens=None, d_v=None,
                     want_abs=False):
    """The fused fast oracle (on ``DEV``) against the ordered oracle (CPU): ``(fused result,
    ordered result, {output: max observed difference})``."""
    o = sparse_attention(q, segs, scale, sink, nan_policy=nan_policy, d_v=d_v)
    f = fast_sparse_attention(q.to(DEV), segs_on(segs), scale, on(sink), nan_policy=nan_policy,
                              chunk_tokens=chunk_tokens, d_v=d_v, want_abs=want_abs, fused=True, graph=False)
    return f, o, assert_matches_ordered(f, o)


def decode_like(T=4, H=5, D=64, n1=40, n2=30, k1=16, k2=24, seed=0, dtype=torch.bfloat16):
    """Two -1-only segments with lengths (a lonely token, -1 holes, duplicates), bf16 q and rows
    whose products are exact (the logits are provably exact)."""
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(T, H, D, generator=g)).to(dtype)
    r1 = (torch.randn(n1, D, generator=g) * 0.1).to(dtype)
    r2 = (torch.randn(n2, D, generator=g) * 0.1).to(dtype)
    i1 = torch.randint(-1, n1, (T, k1), generator=g, dtype=torch.int32)
    i2 = torch.randint(-1, n2, (T, k2), generator=g, dtype=torch.int32)
    i2[0, 1] = i2[0, 0] = 3  # a duplicate
    l1 = torch.randint(0, k1 + 1, (T,), generator=g, dtype=torch.int32)
    l2 = torch.randint(0, k2 + 1, (T,), generator=g, dtype=torch.int32)
    l1[-1] = l2[-1] = 0  # the last token is lonely
    return q, [Segment(r1, i1, l1, IndexRule.MINUS1_ONLY), Segment(r2, i2, l2, IndexRule.MINUS1_ONLY)]


def poisoned(poison: str):
    """``decode_like(seed=1)`` with its unused rows NaN-poisoned (they never reach a result) and one
    ``poison``: a NaN or -Inf in a used row, an Inf in q, or a used row scaled by ``2**100`` (logits
    far beyond the exactness test: the ordered logits)."""
    q, segs = decode_like(seed=1)
    r1 = segs[0].rows.clone()
    used = segs[0].idx[0, : int(segs[0].length[0])]
    used = used[used >= 0]
    unused = torch.ones(r1.shape[0], dtype=torch.bool)
    unused[segs[0].idx[segs[0].idx >= 0].long()] = False
    r1[unused] = math.nan
    if poison == "nan_row" and used.numel():
        r1[int(used[0]), 3] = math.nan
    elif poison == "inf_row" and used.numel():
        r1[int(used[0]), 5] = -math.inf
    elif poison == "inf_q":
        q = q.clone()
        q[1, 2, 7] = math.inf
    elif poison == "huge" and used.numel():
        r1[int(used[0])] = r1[int(used[0])] * 2.0**100
    return q, [Segment(r1, segs[0].idx, segs[0].length, segs[0].rule), segs[1]]


def float64_problem():
    """``(q, rows, idx)``: float64 q and rows of 53-bit values (approximate logits), one segment."""
    g = torch.Generator().manual_seed(7)
    q = torch.randn(3, 3, 48, generator=g, dtype=torch.float64)
    rows = torch.randn(40, 48, generator=g, dtype=torch.float64) * 3
    return q, rows, torch.randint(0, 40, (3, 37), generator=g)


SINKS = {"none": None, "finite": torch.tensor([0.5, -1.0, 2.0, 0.0, 3.0]),
         "infinite": torch.tensor([math.inf, -math.inf, 0.25, math.inf, -2.0])}


@needs_triton
@pytest.mark.parametrize("sink", list(SINKS))
@pytest.mark.parametrize("chunk", [None, 1, 3])
def test_fused_within_bound_exact_logits_and_lonely_rows(sink, chunk):
    q, segs = decode_like()
    f, o, _ = fused_vs_ordered(q, segs, 512**-0.5, SINKS[sink], chunk_tokens=chunk, want_abs=True)  # 2**-4.5: no float32 value
    assert f.exact_logits == 1.0  # bf16 products: every row's logits provably exact ...
    assert torch.equal(f.max_logits.cpu(), o.max_logits)  # ... so max_logits are the ordered bits
    lonely = (o.n_valid == 0)
    assert bool(lonely.any())
    assert torch.equal(f.out.cpu()[lonely], torch.zeros_like(o.out[lonely]))  # exactly 0
    assert bool((f.lse.cpu()[lonely] == -math.inf).all())
    # the PyTorch path gives the same bits where both are exact, and the same pv_abs within 1.2%
    u = fast_sparse_attention(q.to(DEV), segs_on(segs), 512**-0.5, on(SINKS[sink]), chunk_tokens=chunk,
                              want_abs=True, fused=False, passes=False, graph=False)
    assert torch.equal(u.max_logits, f.max_logits)
    assert u.exact_logits == f.exact_logits  # the same row tests, in the logits kernel
    for name in ("lse", "lse_with_sink", "max_logits", "out"):  # the same bounds up to their evaluation's rounding
        assert torch.allclose(u.bound[name], f.bound[name], rtol=1e-12, atol=0), name
    fin = torch.isfinite(u.pv_abs)
    assert torch.allclose(u.pv_abs[fin], f.pv_abs[fin], rtol=0.025, atol=1e-300)


@needs_triton
def test_fused_results_do_not_depend_on_the_chunking():
    q, segs = decode_like(T=5, seed=4)
    runs = [fast_sparse_attention(q.to(DEV), segs_on(segs), 0.3, None, chunk_tokens=c, fused=True, graph=False,
                                  want_abs=True) for c in (None, 1, 2)]
    for r in runs[1:]:  # each token's kernels read only that token's slots: the same bits
        for name in ("out", "lse", "lse_with_sink", "max_logits", "pv_abs"):
            assert torch.equal(getattr(r, name), getattr(runs[0], name)), name


@needs_triton
@pytest.mark.parametrize("nan_policy", [NanPolicy.PROPAGATE, NanPolicy.SCRUB])
@pytest.mark.parametrize("poison", ["nan_row", "inf_row", "inf_q", "huge"])
def test_fused_non_finite_and_extreme_rows_follow_the_ordered_conventions(nan_policy, poison):
    q, segs = poisoned(poison)
    fused_vs_ordered(q, segs, 64**-0.5, SINKS["infinite"], nan_policy=nan_policy, want_abs=True)


@needs_triton
def test_fused_float64_and_mixed_tables_and_d_v():
    q, rows, idx = float64_problem()
    f, _, _ = fused_vs_ordered(q, [Segment(rows, idx)], 0.125, torch.tensor([0.5, -math.inf, math.inf]), d_v=20,
                               want_abs=True)
    assert f.exact_logits < 0.5 and f.pv_abs.shape == (3, 3, 20)  # 53-bit values: approximate logits
    mixed = [Segment(rows.float(), idx)]  # float32 rows, bf16 q: a float64 table
    fused_vs_ordered(q.to(torch.bfloat16), mixed, 0.125, None, want_abs=True)


@needs_triton
def test_fused_pv_abs_is_the_ordered_weighted_abs_v():
    q, segs = decode_like(seed=2)
    sink = SINKS["finite"]
    kw = dict(fused=True, graph=False)
    a = assert_pv_abs_matches_ordered(q, segs, 64**-0.5, sink, fast_kw=kw, device=DEV)
    assert a.pv_abs is not None


@needs_triton
@settings(max_examples=25, deadline=None)
@given(problems())
def test_fused_within_bound_under_hypothesis(prob):
    q, segs, scale, sink, nan, d_v, chunk = prob
    fused_vs_ordered(q, segs, scale, sink, nan, chunk_tokens=chunk, d_v=d_v)


def test_fused_option_is_validated_and_off_by_default(monkeypatch):
    from dsv4_numerics.reference.attention import fast_fused

    q, segs = decode_like()
    monkeypatch.delenv(fast_fused.ENV, raising=False)
    assert not fast_fused.default_on(torch.device("cpu"))
    assert not fast_fused.default_on(torch.device("cuda"))  # opt-in: DSV4_FUSED_JUDGE=1
    monkeypatch.setenv(fast_fused.ENV, "1")
    assert not fast_fused.default_on(torch.device("cpu"))  # CUDA only
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(InputError, match="fused"):
        fast_sparse_attention(q, segs, 0.1, fused=True)
    with pytest.raises(InputError, match="fused"):
        fast_sparse_attention(q, segs, 0.1, fused=1)
    monkeypatch.setenv(fast_fused.ENV, "0")
    assert not fast_fused.default_on(torch.device("cuda"))
    if HAS_TRITON:
        monkeypatch.setenv(fast_fused.ENV, "1")
        assert fast_fused.default_on(torch.device("cuda"))


def test_the_fast_oracle_does_not_import_triton():
    code = ("import sys; import dsv4_numerics.reference.attention.fast as f; "
            "import dsv4_numerics.reference.attention.fast_fused; "
            "assert 'triton' not in sys.modules, 'triton imported'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


def test_bench_summary_puts_the_fused_ratios_beside_the_pytorch_paths():
    from dsv4_numerics.bench.gpu import summarize

    def rec(cfg, fused=True):
        r = {"config": cfg, "batch": 128, "ratio": 900.0, "flashmla_ms": 0.1, "oracle_ms": 90.0,
             "oracle_peak_extra_bytes": 0, "fast_ms": 1.5, "fast_ratio": 15.0, "fast_graph_replayed": True,
             "fast_eager_ms": 1.8, "fast_eager_ratio": 18.0, "fast_judge_eager_ms": 2.0, "fast_judge_eager_ratio": 20.0,
             "oracle_gflops": 1.0, "oracle_stream_gbps": 1.0}
        if fused:
            r.update(fused_ratio=19.5, fused_eager_ratio=23.0, fused_judge_eager_ratio=27.8, fused_judge_ratio=24.0,
                     fused_peak_extra_bytes=2**29)
        else:
            r["fused_error"] = "Triton is not importable"
        return r

    s = summarize([rec("h64")])
    assert s["fused_ratios_at_batch_128"]["h64"] == {"eager": 23.0, "judge_eager": 27.8, "replayed": 19.5,
                                                     "judge_replayed": 24.0, "old_eager": 18.0,
                                                     "old_judge_eager": 20.0, "old_replayed": 15.0}
    assert s["worst_fused_peak_extra_gib"] == 0.5 and s["fused_error"] == []
    none = summarize([rec("h64", fused=False)])
    assert none["fused_ratios_at_batch_128"]["h64"]["eager"] is None
    assert none["fused_error"] == ["Triton is not importable"]


@needs_triton
@pytest.mark.slow  # ~35 s per stage and backend under Triton's CPU interpreter
@pytest.mark.parametrize("backend", ["fused", "passes"])
@pytest.mark.parametrize("stage", ["decode", "prefill"])
def test_matrix_verdicts_identical_under_both_modes_with_the_triton_kernels(stage, backend, monkeypatch):
    """The both-modes verdict check (``test_attention_fast``) with the fast oracle's default taking
    Triton kernels on ``DEV`` (the fast oracle judging there, as ``run_entry(device=...)`` has it):
    the fused kernels (as ``DSV4_FUSED_JUDGE=1`` asks on a GPU) or the Triton passes (the default
    on a CUDA device): the reference entry's verdicts on the smallest default cases are the ordered
    oracle's, and the kernels ran."""
    from dsv4_numerics.oracles import matrix
    from dsv4_numerics.reference.attention import fast_fused, fast_passes
    from dsv4_numerics.reference.cases import default_cases

    from ..mutants import reference_entry

    calls = []
    if backend == "fused":
        real = fast_fused.softmax_pv
        monkeypatch.setattr(fast_fused, "default_on", lambda dev: dev.type == DEV.type)
        monkeypatch.setattr(fast_fused, "softmax_pv", lambda *a, **k: calls.append(1) or real(*a, **k))
    else:
        real = fast_passes.softmax
        monkeypatch.setattr(fast_fused, "default_on", lambda dev: False)
        monkeypatch.setattr(fast_passes, "default_on", lambda dev: dev.type == DEV.type)
        monkeypatch.setattr(fast_passes, "softmax", lambda *a, **k: calls.append(1) or real(*a, **k))
    cases = sorted(default_cases(stage), key=lambda c: c.inputs["q"].numel())[:2]
    e = reference_entry(stage, memo={})
    ordered = matrix.run_entry(e, cases=cases, device=DEV, oracle_mode="ordered")
    fast = matrix.run_entry(e, cases=cases, device=DEV, oracle_mode="fast")
    assert [(r.case, r.verdict, r.rule) for r in ordered] == [(r.case, r.verdict, r.rule) for r in fast]
    assert all(r.details["oracle"]["mode"] == "fast" for r in fast if r.verdict in ("pass", "fail"))
    assert sum(r.verdict in ("pass", "fail") for r in fast) == len(cases)
    assert calls  # the Triton kernels judged
