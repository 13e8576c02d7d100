"""The fast judging oracle (``reference.attention.fast``): within its returned bound of the ordered
oracle on every default and held-out case and under hypothesis (extreme magnitudes, +-inf sinks,
lonely rows, NaN-poisoned unused rows, NaN/Inf in valid rows), and the matrix gives the same
verdict under both oracle modes (reference entries, mutants, kernel-recorded fixture replays)."""

from __future__ import annotations

import functools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4_numerics.oracles import matrix
from dsv4_numerics.oracles import stages as stg
from dsv4_numerics.reference.attention.ordered import Segment, sparse_attention
from dsv4_numerics.reference.attention.fast import (BOUND_OUTPUTS, FAST_BUDGET_BYTES, fast_sparse_attention,
                                                    peak_bytes_estimate_fast)
from dsv4_numerics.reference.attention.fast_bound import bf16_abs_factor, exact_bits, norm_factor
from dsv4_numerics.reference.attention.fast_rows import row_stats, vmax_finite
from dsv4_numerics.runner.case_files import case_names, load_cases, stage_cases_file
from dsv4_numerics.reference.cases import default_cases
from dsv4_numerics.reference.cases.attention import decode_case, prefill_case
from dsv4_numerics.reference.errors import InputError
from dsv4_numerics.reference.policies import IndexRule, NanPolicy

from ..mutants import MUTANTS, reference_entry


def segments_on(segs, dev):
    """``segs`` with rows, indices and lengths moved to ``dev``."""
    return [Segment(s.rows.to(dev), s.idx.to(dev), None if s.length is None else s.length.to(dev), s.rule)
            for s in segs]


def assert_matches_ordered(f, o):
    """The fast result ``f`` (any device) against the ordered result ``o`` (CPU): |fast - ordered|
    <= bound elementwise at finite positions; identical non-finite values; identical n_valid.
    Returns {output: max observed difference}."""
    assert torch.equal(o.n_valid, f.n_valid.cpu())
    seen = {}
    for name in BOUND_OUTPUTS:
        a, b, bound = getattr(f, name).cpu(), getattr(o, name), f.bound[name].cpu()
        assert a.shape == b.shape == bound.shape, name
        fin = torch.isfinite(b)
        assert torch.equal(fin, torch.isfinite(a)), f"{name}: non-finite positions differ"
        nf = ~fin
        assert torch.equal(torch.isnan(a[nf]), torch.isnan(b[nf])), f"{name}: NaN positions differ"
        inf = nf & ~torch.isnan(b)
        assert torch.equal(a[inf], b[inf]), f"{name}: infinities differ"
        assert bool((bound >= 0).all()) and bool(torch.isfinite(bound).all()), name
        d = (a - b).abs()[fin]
        over = d > bound[fin]
        assert not bool(over.any()), f"{name}: |fast - ordered| {float(d[over].max()):.3g} exceeds the bound"
        seen[name] = float(d.max()) if d.numel() else 0.0
    return seen


def assert_within_bound(q, segs, scale, sink=None, nan_policy=NanPolicy.PROPAGATE, chunk_tokens=None, d_v=None):
    """``assert_matches_ordered`` of the fast and the ordered oracle on these inputs. Returns (fast
    result, {output: max observed difference})."""
    o = sparse_attention(q, segs, scale, sink, nan_policy=nan_policy, d_v=d_v)
    f = fast_sparse_attention(q, segs, scale, sink, nan_policy=nan_policy, chunk_tokens=chunk_tokens, d_v=d_v)
    return f, assert_matches_ordered(f, o)


_SEGS: dict = {}


def case_segments(case, stage):
    key = (stage, case.name, id(case))
    if key not in _SEGS:
        pol = stg.get(stage).policies({})
        _SEGS[key] = stg.decode_segments(case, pol) if stage == "decode" else stg.prefill_segments(case, pol)
    return _SEGS[key]


HELD_OUT = [
    ("decode", lambda: decode_case("ho-h128-c4a-top512", "c4a", 128, [2100, 777], topk=512, seed=101)),
    ("decode", lambda: decode_case("ho-h64-c128a", "c128a", 64, [1500, 3], comp_bs=2, seed=102,
                                   invalid_tokens=(1,))),
    ("decode", lambda: decode_case("ho-h64-swa-bs256", "swa", 64, [256, 40, 600], swa_bs=256, seed=103)),
    ("prefill", lambda: prefill_case("ho-h64-c4a", "c4a", 64, [500, 64], [3, 2], topk=256, seed=104,
                                     stale_past_len=True)),
]


# how many default decode and prefill cases there are, read from the names beside the shared case
# files (case_files: built once per machine) rather than built again at every worker's collection
# (0.5 s of a 2.7 s collection here)
N_DEFAULT = sum(len(case_names(s, "default")) for s in ("decode", "prefill"))


@functools.lru_cache(maxsize=None)
def all_cases():
    """The default decode and prefill cases, loaded from the shared case files (``default_cases``
    saved: building them again took ~1 s in each worker that ran one of these tests), then the
    held-out ones."""
    out = [(s, c) for s in ("decode", "prefill") for c in load_cases(stage_cases_file(s, "default"))]
    assert len(out) == N_DEFAULT, "the case files and their names disagree"
    return tuple(out + [(s, mk()) for s, mk in HELD_OUT])


@pytest.mark.parametrize("i", range(N_DEFAULT + len(HELD_OUT)))
def test_default_and_held_out_cases_within_bound(i):
    stage, case = all_cases()[i]
    inp = case.inputs
    segs = case_segments(case, stage)
    f, seen = assert_within_bound(inp["q"], segs, inp["scale"], inp.get("sink"))
    # the bound is far below every tolerance it is used against (bf16 ~4e-3 relative, LSE ~1e-5)
    vmax = max(float(s.rows[:, :512].double().nan_to_num(0, 0, 0).abs().max()) for s in segs)
    assert float(f.bound["out"].max()) <= 1e-9 * vmax
    assert float(f.bound["lse"].max()) <= 1e-9
    assert float(f.bound["lse_with_sink"].max()) <= 1e-9
    # the structure of the inputs makes almost every logit provably exact
    assert f.exact_logits >= 0.95, f.exact_logits


def test_exact_logits_give_identical_max_logits_bits():
    case = default_cases("decode")[0]
    inp = case.inputs
    segs = case_segments(case, "decode")
    f = fast_sparse_attention(inp["q"], segs, inp["scale"], inp.get("sink"))
    o = sparse_attention(inp["q"], segs, inp["scale"], inp.get("sink"))
    exact_rows = f.bound["max_logits"] == 0
    assert bool(exact_rows.any())
    assert torch.equal(f.max_logits[exact_rows], o.max_logits[exact_rows])


def test_unstructured_float64_rows_use_the_gamma_bound():
    g = torch.Generator().manual_seed(7)
    q = torch.randn(2, 3, 64, generator=g, dtype=torch.float64)
    rows = torch.randn(40, 64, generator=g, dtype=torch.float64) * 3
    idx = torch.randint(0, 40, (2, 25), generator=g)
    f, _ = assert_within_bound(q, [Segment(rows, idx)], 0.125, torch.tensor([0.5, -math.inf, math.inf]))
    assert f.exact_logits < 0.5  # 53-bit values: the exactness test must refuse them
    assert float(f.bound["max_logits"].max()) > 0
    assert float(f.bound["max_logits"].max()) < 1e-12


def test_chunking_and_validation():
    case = default_cases("prefill")[0]
    inp = case.inputs
    segs = case_segments(case, "prefill")
    a = fast_sparse_attention(inp["q"], segs, inp["scale"], inp.get("sink"), chunk_tokens=1)
    b = fast_sparse_attention(inp["q"], segs, inp["scale"], inp.get("sink"))
    for name in BOUND_OUTPUTS:  # a token's result does not depend on its chunk (same GEMM shapes per token)
        assert torch.allclose(getattr(a, name), getattr(b, name), rtol=0, atol=0, equal_nan=True) or \
            bool(((getattr(a, name) - getattr(b, name)).abs().nan_to_num(0) <= 2 * b.bound[name]).all())
    with pytest.raises(InputError, match="scale"):
        fast_sparse_attention(inp["q"], segs, -1.0)
    with pytest.raises(InputError, match="nan_policy"):
        fast_sparse_attention(inp["q"], segs, 0.1, nan_policy="ignore")
    # production decode (H=128, K=1152): ~9.95 MiB per token, 154-token chunks in the 1.5 GiB budget
    # (batch 128 in one chunk): gathered rows bf16 + float64 (5.6 MiB), two [H, K] and two [H, D + d_v]
    # float64 allowances (4.25 MiB), per-slot/per-row scalars
    per = peak_bytes_estimate_fast(1, 128, 1152)
    assert per == 1152 * 512 * 10 + 2 * 128 * 1152 * 8 + 2 * 128 * 1024 * 8 + 64 * 1152 + 64 * 128
    assert 154 * per <= FAST_BUDGET_BYTES < 155 * per
    assert FAST_BUDGET_BYTES == 3 * 2**29


@pytest.mark.parametrize("d_v", [64, 96])
def test_row_stats_bf16_and_float64_paths(d_v):
    """``row_stats`` (``[3, N]``) of a bfloat16 table (float32 norm, lsb from a bits lookup) and of its float64
    copy (float64 norm, lsb from the float64 bits): identical lsb exponents and ``max |v|`` over
    the first ``d_v`` dims (on finite rows; ``vmax_finite`` skips NaN/Inf); norms that, times
    ``norm_factor(D)``, are upper bounds of the exact norm (checked in rational arithmetic) and
    close to it. Values span subnormals (whose float32 squares underflow: the floor), zeros,
    +-inf, NaN and +-max (whose float32 squares overflow: ``n = inf``, the caller goes ordered)."""
    from fractions import Fraction

    g = torch.Generator().manual_seed(11)
    D = 96
    c = norm_factor(D)
    floor = 2.0 ** (math.ceil(math.log2(math.sqrt(D))) - 75)
    bits = torch.randint(-2**15, 2**15, (300, D), generator=g, dtype=torch.int32).to(torch.int16)
    x = bits.view(torch.bfloat16).clone()
    x[:40] = (torch.randn(40, D, generator=g) * 2.0**-130).to(torch.bfloat16)  # bf16 subnormals
    x[40:60] = 0.0
    x[60, 3], x[61, 5], x[62, 7] = math.inf, -math.inf, math.nan
    x[63:80] = torch.randn(17, D, generator=g).to(torch.bfloat16)  # ordinary magnitudes
    x[80] = torch.finfo(torch.bfloat16).max
    x[81:90] = (torch.randn(9, D, generator=g) * 2.0**-70).to(torch.bfloat16)  # squares below 2**-126
    s16, s64 = row_stats(x, d_v).T, row_stats(x.double(), d_v).T  # [N, 3] views of [3, N]
    assert s16.dtype == torch.float32 and s64.dtype == torch.float64
    n16, n64 = s16[:, 0].double(), s64[:, 0]
    x64 = x.double()
    finite = torch.isfinite(x64).all(dim=1)
    assert torch.equal(torch.isfinite(n64), finite)  # NaN/Inf rows: the caller goes ordered
    small = x64.abs().nan_to_num(nan=0.0).amax(dim=1) < 2.0**64
    assert torch.equal(torch.isfinite(n16), finite & small)  # float32 squares overflow above 2**64
    assert not bool(torch.isfinite(n16[80])) and bool(torch.isfinite(n64[80]))
    for r in finite.nonzero().flatten().tolist():
        exact = sum(Fraction(v) ** 2 for v in x64[r].tolist())  # the exact squared norm
        for n, fin in ((float(n16[r]), bool(small[r])), (float(n64[r]), True)):
            if not fin:
                continue
            assert (Fraction(n) * Fraction(c)) ** 2 >= exact, r  # the stated upper bound
            assert n <= math.sqrt(float(exact)) * (1 + 2.0**-12) + 2 * floor, r  # and close to the norm
    assert bool((n16[40:60] == floor).all())  # zero rows: the float32 underflow floor
    assert bool((n64[40:60] > 0).all())  # a float64 table: its underflow floor
    nz = torch.isfinite(n16) & torch.isfinite(n64) & (x64 != 0).any(dim=1)
    lsb16 = (torch.log2(n16.float()).double() - s16[:, 1].double())[nz]  # column 1 is log2(n) - lsb
    lsb64 = (torch.log2(n64) - s64[:, 1])[nz]
    assert torch.equal(lsb16.round(), lsb64.round()) and bool(((lsb16 - lsb16.round()).abs() < 2.0**-12).all())
    assert torch.equal(s16[:, 2].double()[finite], s64[:, 2][finite])
    assert torch.equal(s16[:, 2].double()[finite], x64[finite, :d_v].abs().amax(dim=1))
    assert not bool(torch.isfinite(s16[60:63, 2]).any())  # NaN/Inf in the first d_v dims: vmax is not finite
    assert torch.equal(vmax_finite(x, d_v).double(), x64[:, :d_v].nan_to_num(nan=0.0, posinf=0.0, neginf=0.0).abs().amax(dim=1))
    assert bool((s16[40:60, 1] < -2**13).all()) and bool((s64[40:60, 1] < -2**19).all())  # zero rows: no lsb


def test_exactness_threshold_and_norm_factor():
    """``exact_bits``: 53 less twice the norms' upper-bound factor (in bits) less the evaluation
    margin; ``norm_factor`` covers the float64 path's ``1 + 2**-30`` and grows with D."""
    for D in (1, 64, 512, 576, 2**20):
        c = norm_factor(D)
        assert c >= 1 + 2.0**-30
        assert exact_bits(D) == 53.0 - 2.0 * math.log2(c) - 2.0**-10
    assert norm_factor(512) < norm_factor(576) < 1 + 2.0**-15


# ----------------------------------------------------------------------------- hypothesis


def _fp8_rows(g, n, d, exp_shift):
    codes = torch.randint(0, 256, (n, d), generator=g, dtype=torch.int32)
    codes = torch.where((codes & 0x7F) == 0x7F, codes - 1, codes).to(torch.uint8)
    vals = codes.view(torch.float8_e4m3fn).to(torch.float64)
    tile = torch.randint(-6, 7, (n, -(-d // 64)), generator=g).repeat_interleave(64, dim=1)[:, :d]
    return vals * torch.pow(2.0, (tile + exp_shift).to(torch.float64))


@st.composite
def problems(draw):
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    T, H = draw(st.integers(1, 3)), draw(st.integers(1, 4))
    D = draw(st.sampled_from([16, 64, 128]))
    kind = draw(st.sampled_from(["fp8", "bf16", "f64", "mixed"]))  # mixed: bf16 q, float32 rows
    eq = draw(st.integers(-60, 60))  # extreme magnitudes of q and rows
    ek = draw(st.sampled_from([-120, -30, 0, 30, 120] + ([500] if kind == "f64" else [])))
    q = (torch.randn(T, H, D, generator=g, dtype=torch.float64) * 2.0**eq)
    q = q.to(torch.bfloat16) if kind != "f64" else q
    segs = []
    for _ in range(draw(st.integers(1, 2))):
        N, K = draw(st.integers(1, 30)), draw(st.integers(0, 24))
        if kind == "fp8":
            rows = _fp8_rows(g, N, D, ek)
        else:
            rows = torch.randn(N, D, generator=g, dtype=torch.float64) * 2.0**ek
            rows = {"bf16": rows.to(torch.bfloat16), "mixed": rows.float(), "f64": rows}[kind]
        idx = torch.randint(-1, N + 2, (T, K), generator=g)
        length = torch.randint(0, K + 1, (T,), generator=g)
        rule = draw(st.sampled_from([IndexRule.ANY_OUT_OF_RANGE_INVALID, IndexRule.MINUS1_ONLY]))
        if rule == IndexRule.MINUS1_ONLY:  # only -1 may mark an invalid slot inside the prefix
            idx[(idx >= N) & (torch.arange(K)[None, :] < length[:, None])] = -1
        if draw(st.booleans()):
            length[0] = 0  # a lonely candidate
        used = torch.zeros(N, dtype=torch.bool)
        inpre = torch.arange(K)[None, :] < length[:, None]
        ok = inpre & (idx >= 0) & (idx < N)
        used[idx[ok]] = True
        rows = rows.clone()
        rows[~used] = math.nan  # NaN-poisoned unused rows
        poison = draw(st.sampled_from(["none", "nan", "inf"]))
        if poison != "none" and bool(used.any()):
            r = int(used.nonzero()[0])
            rows[r, int(torch.randint(0, D, (1,), generator=g))] = math.nan if poison == "nan" else -math.inf
        segs.append(Segment(rows, idx, length, rule))
    sink_kind = draw(st.sampled_from(["none", "finite", "mixed_inf"]))
    sink = None
    if sink_kind != "none":
        sink = torch.randn(H, generator=g, dtype=torch.float64) * 3
        if sink_kind == "mixed_inf":
            sink[0] = math.inf
            sink[-1] = -math.inf if H > 1 else sink[-1]
    scale = draw(st.sampled_from([512**-0.5, 512**-0.55, 1.0, 3.0]))
    nan = draw(st.sampled_from([NanPolicy.PROPAGATE, NanPolicy.SCRUB]))
    d_v = draw(st.one_of(st.none(), st.integers(1, D)))
    chunk = draw(st.one_of(st.none(), st.integers(1, 3)))
    return q, segs, scale, sink, nan, d_v, chunk


@settings(max_examples=60, deadline=None)
@given(problems())
def test_fast_within_bound_under_hypothesis(prob):
    q, segs, scale, sink, nan, d_v, chunk = prob
    assert_within_bound(q, segs, scale, sink, nan, chunk_tokens=chunk, d_v=d_v)


def assert_pv_abs_matches_ordered(q, segs, scale, sink=None, nan_policy=NanPolicy.PROPAGATE, chunk_tokens=None,
                                  d_v=None, fast_kw=None, device=None):
    """``want_abs=True`` leaves every output and bound as they were, and its ``pv_abs`` is the
    ordered oracle's softmax-weighted ``|V|`` (``ordered.run_ordered(want_abs=True)``'s ``A``, times the sink
    factor; ``fast_kw``: more arguments of the fast calls, ``device``: where they run, compared on the
    CPU): from a bfloat16 table an upper bound of it within ``bf16_abs_factor(K)`` (and the
    tiny ``out`` bound), from other tables within the ``out`` bound (the bound's steps 5-6 hold for
    ``|V|`` as for ``V``: same weights, same ``max |v|``); plus 2**-50 relative for this test's own
    sink factor."""
    from dsv4_numerics.reference.attention.fast import table_dtype
    from dsv4_numerics.reference.attention.ordered import AttentionMode, run_ordered

    kw = dict(nan_policy=nan_policy, chunk_tokens=chunk_tokens, d_v=d_v, **(fast_kw or {}))
    dev = torch.device("cpu") if device is None else device
    dq, dsegs, dsink = q.to(dev), segments_on(segs, dev), None if sink is None else sink.to(dev)
    a, b = (fast_sparse_attention(dq, dsegs, scale, dsink, want_abs=w, **kw) for w in (True, False))
    if dev.type != "cpu":
        a, b = (type(r)(r.out.cpu(), r.lse.cpu(), r.lse_with_sink.cpu(), r.max_logits.cpu(), r.n_valid.cpu(),
                        {k: v.cpu() for k, v in r.bound.items()}, r.exact_logits,
                        None if r.pv_abs is None else r.pv_abs.cpu()) for r in (a, b))
    assert b.pv_abs is None and a.pv_abs.shape == a.out.shape
    for name in BOUND_OUTPUTS:
        assert torch.equal(getattr(a, name).nan_to_num(7.0), getattr(b, name).nan_to_num(7.0)), name
        assert torch.equal(a.bound[name], b.bound[name]), name
    _, lse, _, _, n, A = run_ordered("t", q, segs, scale, sink, d_v, AttentionMode.EXACT, nan_policy, None, True)
    f = torch.ones_like(lse) if sink is None else 1.0 / (1.0 + torch.exp(sink.to(torch.float64) - lse))
    want = torch.where((n == 0).view(-1, 1, 1), torch.zeros_like(A), A * f.unsqueeze(2))
    fin = torch.isfinite(want) & torch.isfinite(a.pv_abs)
    assert bool((a.pv_abs[fin] >= 0).all())
    slack = (a.bound["out"] + 2.0**-50 * want.abs())[fin]
    got, want = a.pv_abs[fin], want[fin]
    uf = 0.0  # the bfloat16 GEMM's underflow: K 2**-126 (1 + max |v|) at most
    if table_dtype(segs, q) == torch.bfloat16:  # one bfloat16 GEMM: an upper bound within its factor
        K = sum(s.idx.shape[1] for s in segs)
        vmax = max([float(s.rows.double().abs().nan_to_num(0.0, 0.0, 0.0).max()) for s in segs if s.rows.numel()] + [0.0])
        uf = K * 2.0**-126 * (1 + vmax)
        low = want - slack - uf
        assert bool((got >= low).all()), f"pv_abs {float((low - got).max()):.3g} below the exact value"
        high = (want + slack) * 1.03  # bf16_abs_factor (<= 1.012 at K <= 2**14) and two bf16 roundings
        assert bool((got <= high).all()), "pv_abs more than 3% above the exact value"
    else:
        d = (got - want).abs()
        assert bool((d <= slack).all()), f"pv_abs off by {float((d - slack).max()):.3g} beyond the out bound"
    # where out is finite, |out| <= pv_abs up to the same bound (|sum p v| <= sum p |v|)
    of = torch.isfinite(a.out) & torch.isfinite(a.pv_abs)
    assert bool((a.out.abs()[of] <= a.pv_abs[of] + 2 * a.bound["out"][of] + uf).all())
    return a


def test_pv_abs_lonely_rows_infinite_sinks_nan_rows_and_chunks():
    g = torch.Generator().manual_seed(3)
    T, H, D, N = 3, 2, 8, 5
    q = torch.randn(T, H, D, generator=g, dtype=torch.float64)
    rows = torch.randn(N, D, generator=g, dtype=torch.float64)
    idx = torch.tensor([[0, 1, 2], [3, 4, -1], [-1, -1, -1]], dtype=torch.int32)
    sink = torch.tensor([0.5, math.inf], dtype=torch.float64)
    a = assert_pv_abs_matches_ordered(q, [Segment(rows, idx)], 0.7, sink, d_v=6)
    s = a.pv_abs
    for t, keys in ((0, [0, 1, 2]), (1, [3, 4])):  # written out for head 0
        lg = 0.7 * q[t, 0] @ rows[keys].T
        m = torch.maximum(lg.max(), sink[0])
        w = torch.exp(lg - m)
        want0 = (w @ rows[keys, :6].abs()) / (w.sum() + torch.exp(sink[0] - m))
        assert torch.allclose(s[t, 0], want0, rtol=1e-12, atol=0)
        assert torch.equal(s[t, 1], torch.zeros(6, dtype=torch.float64))  # sink +inf: exact zeros
    assert torch.equal(s[2], torch.zeros(H, 6, dtype=torch.float64))  # nothing valid
    one = fast_sparse_attention(q, [Segment(rows, idx)], 0.7, sink, d_v=6, chunk_tokens=1, want_abs=True)
    assert torch.allclose(one.pv_abs, s, rtol=1e-14, atol=0)
    nan_rows = rows.clone()
    nan_rows[4, 0] = math.nan
    s2 = fast_sparse_attention(q, [Segment(nan_rows, idx)], 0.7, None, d_v=6, want_abs=True).pv_abs
    assert bool(torch.isnan(s2[1]).all()) and bool((s2[0] > 0).all())  # token 1 reads the NaN row
    scrub = fast_sparse_attention(q, [Segment(nan_rows, idx)], 0.7, None, d_v=6, want_abs=True,
                                  nan_policy=NanPolicy.SCRUB).pv_abs
    assert bool(torch.isfinite(scrub).all())
    empty = fast_sparse_attention(q[:0], [Segment(rows, idx[:0])], 0.7, None, want_abs=True)
    assert empty.pv_abs.shape == (0, H, D)
    assert 1.0 < bf16_abs_factor(2**14) < 1.012 and bf16_abs_factor(1) < bf16_abs_factor(2**14)
    with pytest.raises(InputError, match="want_abs"):
        fast_sparse_attention(q, [Segment(rows, idx)], 0.7, want_abs=1)


@settings(max_examples=30, deadline=None)
@given(problems())
def test_pv_abs_within_the_out_bound_of_the_ordered_weighted_abs_v_under_hypothesis(prob):
    q, segs, scale, sink, nan, d_v, chunk = prob
    assert_pv_abs_matches_ordered(q, segs, scale, sink, nan, chunk_tokens=chunk, d_v=d_v)


# ----------------------------------------------------------------------------- verdicts


# Each stage's cases in chunks (every ``n``-th case from the chunk's index), one test each: every
# entry (both reference entries, then the stage's mutants) runs on the chunk's cases. Chunks by
# entries instead each recomputed every case's reference outputs in their own process: the decode
# stage's four such chunks took 12-22 CPU-seconds each on a 16-worker GPU host, most of it the same
# ordered oracle four times. By cases, each case's outputs are computed once (``memo``).
_VERDICT_CHUNKS = {"decode": 5, "prefill": 3}


def _verdict_entries(stage: str, memo: dict) -> list:
    return ([reference_entry(stage, memo=memo), reference_entry(stage, bf16_p=True, memo=memo)]
            + [m for m in MUTANTS if m.stage == stage])


_VERDICT_PARAMS = [(s, i) for s, n in _VERDICT_CHUNKS.items() for i in range(n)]


@pytest.mark.slow  # scheduled first under xdist (root conftest): among the suite's longer tests
@pytest.mark.parametrize("stage,chunk", _VERDICT_PARAMS, ids=[f"{s}-{i}" for s, i in _VERDICT_PARAMS])
def test_matrix_verdicts_identical_under_both_modes(stage, chunk):
    every = default_cases(stage)
    n = _VERDICT_CHUNKS[stage]
    assert len(every) >= n
    cases = every[chunk::n]
    memo: dict = {}  # reference outputs per (case, policies, oracle mode), shared by the entries
    entries = _verdict_entries(stage, memo)
    assert len(entries) >= 3
    # the reference entries on every case; the sweep mutants on the sweep cases (magnitudes, page
    # sizes, long top-k: params["dimension"]), the other mutants on the layer simulation's (time)
    sweep = [c for c in cases if "dimension" in c.params]
    plain = [c for c in cases if "dimension" not in c.params]
    judged = 0
    for e in entries:
        cs = cases if e.family == "reference" else sweep if getattr(e, "dimension", "") else plain
        if not cs:
            continue
        ordered = matrix.run_entry(e, cases=cs, oracle_mode="ordered", expected_cache=memo)
        fast = matrix.run_entry(e, cases=cs, oracle_mode="fast", expected_cache=memo)
        assert [(r.case, r.verdict, r.rule) for r in ordered] == [(r.case, r.verdict, r.rule) for r in fast], e.name
        assert all(r.details["oracle"]["mode"] == "fast" for r in fast if r.verdict in ("pass", "fail"))
        judged += sum(r.verdict in ("pass", "fail") for r in fast)
    assert judged >= len(cases)


def test_verdict_chunks_cover_every_case_and_entry_once():
    for stage, n in _VERDICT_CHUNKS.items():
        cases = default_cases(stage)
        names = [c.name for c in cases]
        chunks = [names[i::n] for i in range(n)]
        assert sorted(sum(chunks, [])) == sorted(names) and all(chunks)
        ents = _verdict_entries(stage, {})
        assert len({e.name for e in ents}) == len(ents)
        sweep = {c.name for c in cases if "dimension" in c.params}
        # every sweep mutant and every other mutant meets at least one case of its kind somewhere
        for e in ents:
            if e.family != "reference":
                want = sweep if getattr(e, "dimension", "") else set(names) - sweep
                assert want, e.name


def test_recorded_kernel_fixtures_same_verdict_under_both_modes():
    from dsv4_numerics.fixtures import golden, store

    m = store.load_manifest(store.PACKAGE_ROOT)
    names = [n for n, e in m["fixtures"].items() if e["kind"] == "kernel" and e["stage"] in stg.FAST_ORACLE_STAGES]
    assert names
    for n in names:
        case, outputs = golden.load_fixture(store.PACKAGE_ROOT, n, m)
        rep = golden.replay_entry(m["fixtures"][n], outputs)
        a = matrix.run_entry(rep, cases=[case], arch=rep.archs[0], oracle_mode="ordered")
        b = matrix.run_entry(rep, cases=[case], arch=rep.archs[0], oracle_mode="fast")
        assert [(r.verdict, r.rule) for r in a] == [(r.verdict, r.rule) for r in b], n
        assert b[0].details["oracle"]["mode"] == "fast" and a[0].details["oracle"]["mode"] == "ordered"


def test_oracle_mode_is_validated_and_auto_is_ordered_on_cpu():
    e = reference_entry("decode")
    case = default_cases("decode")[:1]
    bad = matrix.run_entry(e, cases=case, oracle_mode="quick")
    assert bad[0].verdict == "error" and "oracle_mode" in bad[0].message
    auto = matrix.run_entry(e, cases=case)
    assert auto[0].details["oracle"]["mode"] == "ordered"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the fast oracle's home device)")
@pytest.mark.parametrize("i", range(N_DEFAULT + len(HELD_OUT)))
def test_fast_on_gpu_within_bound_of_ordered_on_cpu(i):
    stage, case = all_cases()[i]
    inp = case.inputs
    segs = case_segments(case, stage)
    o = sparse_attention(inp["q"], segs, inp["scale"], inp.get("sink"))
    dev = torch.device("cuda")
    sink = inp.get("sink")
    f = fast_sparse_attention(inp["q"].to(dev), segments_on(segs, dev), inp["scale"],
                              None if sink is None else sink.to(dev))
    assert_matches_ordered(f, o)


def test_deferred_validation_raises_the_ordered_oracles_errors():
    """The value rules the fast oracle checks on the device and reads with its one sync (lengths in
    [0, K], -1-only indices, a NaN sink, an out-of-range index under any rule never faulting a
    gather) raise exactly the ordered oracle's InputError; host-side rules too."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(3, 2, 16, generator=g).to(torch.bfloat16)
    rows = torch.randn(10, 16, generator=g).to(torch.bfloat16)
    idx = torch.randint(0, 10, (3, 4), generator=g, dtype=torch.int32)
    ln = torch.tensor([4, 2, 0], dtype=torch.int32)
    sink = torch.tensor([0.5, -1.0])
    m1 = IndexRule.MINUS1_ONLY
    bad = [
        ([Segment(rows, idx, torch.tensor([5, 1, 0], dtype=torch.int32))], sink),  # length > K
        ([Segment(rows, idx, torch.tensor([1, -1, 0], dtype=torch.int32))], sink),  # length < 0
        ([Segment(rows, idx.clone().index_fill_(1, torch.tensor([1]), 10), ln, m1)], sink),  # -1-only: 10 >= N
        ([Segment(rows, idx.clone().index_fill_(1, torch.tensor([0]), -2), ln, m1)], sink),  # -1-only: -2
        ([Segment(rows, idx, ln), Segment(rows[:3], idx, torch.tensor([4, 5, 0], dtype=torch.int32))], sink),
        ([Segment(rows, idx, ln)], torch.tensor([0.5, math.nan])),  # NaN sink
        ([Segment(rows.float()[:, :8], idx, ln)], sink),  # rows width != D (host rule)
        ([Segment(rows, idx.to(torch.float32), ln)], sink),  # index dtype (host rule)
    ]
    for segs, sk in bad:
        with pytest.raises(InputError) as ordered:
            sparse_attention(q, segs, 0.25, sk)
        with pytest.raises(InputError) as fast:
            fast_sparse_attention(q, segs, 0.25, sk)
        assert str(fast.value).replace("fast_sparse_attention", "sparse_attention") == str(ordered.value)
    # out-of-range indices are invalid slots under the default rule, never a gather fault
    wild = idx.clone()
    wild[0, 0], wild[1, 1] = 10**6, -(10**6)
    assert_within_bound(q, [Segment(rows, wild, ln)], 0.25, sink)


def test_minus1_only_rule_edges_and_mixed_rules():
    """The -1-only rule (read on the device as the in-prefix range offsets' min and max, ``layout_flags``)
    at its edges: ``N - 1`` and ``-1`` pass, ``N`` and ``-2`` in the prefix raise the ordered
    oracle's error, any value outside the prefix passes; in a call with mixed rules only the -1-only
    segment's prefix is checked (the other segment's wild indices are invalid slots), also with
    several chunks and a -1-only segment without lengths."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(4, 2, 8, generator=g).to(torch.bfloat16)
    rows = torch.randn(6, 8, generator=g).to(torch.bfloat16)
    ln = torch.tensor([3, 0, 5, 2], dtype=torch.int32)
    m1, anyr = IndexRule.MINUS1_ONLY, IndexRule.ANY_OUT_OF_RANGE_INVALID
    base = torch.randint(0, 6, (4, 5), generator=g, dtype=torch.int32)
    wild = torch.tensor([[-7, 6, 10**6, -1, 2]] * 4, dtype=torch.int64)
    for (t, c), v, ok in [((0, 2), 5, True), ((0, 2), -1, True), ((0, 2), 6, False), ((0, 2), -2, False),
                          ((2, 4), 10**9, False), ((0, 3), 6, True), ((1, 0), -5, True), ((3, 4), 7, True)]:
        idx = base.clone()
        idx[t, c] = v
        for segs in ([Segment(rows, idx, ln, m1)], [Segment(rows[:4], wild, ln, anyr), Segment(rows, idx, ln, m1)]):
            for chunk in (None, 2):
                if ok:
                    assert_within_bound(q, segs, 0.5, chunk_tokens=chunk)
                    continue
                with pytest.raises(InputError) as ordered:
                    sparse_attention(q, segs, 0.5)
                with pytest.raises(InputError) as fast:
                    fast_sparse_attention(q, segs, 0.5, chunk_tokens=chunk)
                assert str(fast.value).replace("fast_sparse_attention", "sparse_attention") == str(ordered.value)
    full = base.clone()
    full[1, 4] = -1
    assert_within_bound(q, [Segment(rows, full, None, m1), Segment(rows[:4], wild, None, anyr)], 0.5)
    full[2, 0] = 6
    with pytest.raises(InputError, match="MINUS1_ONLY"):
        fast_sparse_attention(q, [Segment(rows, full, None, m1), Segment(rows[:4], wild, None, anyr)], 0.5)


@pytest.mark.parametrize("sdt", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
def test_the_host_vector_keeps_lengths_counts_and_sink_checks_exact_under_every_sink_dtype(sdt):
    """The one host read carries integer lengths, counts and the sink's bits together: a sink of
    any float dtype must not round them (a bfloat16 sink once turned a length 513 into 512, which
    then passed the ``[0, K]`` check). A length one past ``K = 512`` raises the ordered oracle's
    error; a NaN sink of either sign raises, +-inf sinks do not; the count of rows with exact logits
    (257 in the first token, not a bfloat16 value) is the one a float64 sink gives."""
    g = torch.Generator().manual_seed(11)
    T, H, D, N, K = 3, 256, 16, 600, 512
    q = torch.randn(T, H, D, generator=g).to(torch.bfloat16)
    rows = torch.randn(N, D, generator=g).to(torch.bfloat16)
    idx = torch.randint(0, N, (T, K), generator=g)
    sink = torch.randn(H, generator=g).to(sdt)
    for bad in ([K + 1, 3, 0], [5, -1, 2]):
        segs = [Segment(rows, idx, torch.tensor(bad), IndexRule.MINUS1_ONLY)]
        with pytest.raises(InputError) as ordered:
            sparse_attention(q, segs, 0.25, sink)
        with pytest.raises(InputError) as fast:
            fast_sparse_attention(q, segs, 0.25, sink)
        assert str(fast.value).replace("fast_sparse_attention", "sparse_attention") == str(ordered.value)
    segs = [Segment(rows, idx, torch.tensor([K, 7, 0]), IndexRule.MINUS1_ONLY)]
    ibits, quiet = {torch.float64: (torch.int64, 0x7FF8 << 48), torch.float32: (torch.int32, 0x7FC00000),
                    torch.float16: (torch.int16, 0x7E00), torch.bfloat16: (torch.int16, 0x7FC0)}[sdt]
    width = torch.iinfo(ibits).bits
    signs = []
    for pattern in (quiet, quiet - (1 << (width - 1))):  # a quiet NaN, then the same with the sign bit set
        s = sink.clone()
        s.view(ibits)[H - 1] = pattern
        assert torch.isnan(s[H - 1])
        signs.append(bool(torch.signbit(s[H - 1])))
        with pytest.raises(InputError, match="sink"):
            fast_sparse_attention(q, segs, 0.25, s)
    assert signs == [False, True]
    s = sink.clone()
    s[0], s[1] = math.inf, -math.inf
    assert_within_bound(q, segs, 0.25, s)
    # float32 inputs: zero q rows have exact logits, the others (almost surely) approximate ones;
    # 257 exact rows is not a bfloat16 value (it rounds to 256)
    q32 = torch.randn(T, H, D, generator=g)
    q32[0], q32[1, 0] = 0.0, 0.0
    rows32 = torch.randn(N, D, generator=g)
    segs32 = [Segment(rows32, idx, torch.tensor([K, 7, 0]), IndexRule.MINUS1_ONLY)]
    f, _ = assert_within_bound(q32, segs32, 0.25, sink)
    ref = fast_sparse_attention(q32, segs32, 0.25, sink.to(torch.float64))
    n_exact = round(ref.exact_logits * T * H)
    assert n_exact >= 257 + H and float(torch.tensor(float(n_exact - H)).to(torch.bfloat16)) != n_exact - H
    assert f.exact_logits == ref.exact_logits


@pytest.mark.parametrize("piece", [None, 1, 2, 5])
def test_ordered_dots_are_the_fixed_order_dot_of_each_position_in_any_piece(piece):
    """``fast.ordered_dots`` (the logits of rows that must take the ordered oracle's: NaN/Inf or
    huge products) equals, bit for bit, the definition position by position -- ``acc = +0``, then
    ``acc = fl(acc + fl(q_d k_d))`` for d = 0..D-1, then ``fl(acc * scale)`` -- for positions in any
    order, any subset of tokens, NaN and +-Inf products included, whatever the token pieces."""
    from dsv4_numerics.reference.attention.fast import ordered_dots

    g = torch.Generator().manual_seed(17)
    c, H, K, D = 5, 3, 7, 16
    qc = torch.randn(c, H, D, generator=g, dtype=torch.float64) * 2.0**600
    rows = torch.randn(c, K, D, generator=g, dtype=torch.float64) * 2.0**500
    qc[0, 0, 5], rows[1, 3, 2], rows[2, 1, 0], qc[3, 2] = math.nan, math.inf, -math.inf, 0.0
    every = torch.stack(torch.meshgrid(torch.arange(c), torch.arange(H), torch.arange(K), indexing="ij"), -1)
    every = every.reshape(-1, 3)
    perm = torch.randperm(every.shape[0], generator=g)
    for where in (every, every[perm][::3], every[every[:, 0] == 2], every[:1]):
        t, h, k = where.unbind(1)
        want = torch.zeros(where.shape[0], dtype=torch.float64)
        for d in range(D):
            want = want + qc[t, h, d] * rows[t, k, d]
        want = want * 0.125
        got = ordered_dots(qc, rows, where, 0.125, piece)
        assert torch.equal(got.view(torch.int64), want.view(torch.int64))
    assert bool(torch.isnan(ordered_dots(qc, rows, every, 0.125, piece)).any())  # the cases are there
