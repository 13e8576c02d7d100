"""The fast oracle's Triton passes (``reference.attention.fast_passes``): each kernel against the
PyTorch pass it replaces on adversarial values (zeros, signed zeros, subnormals, NaN, Inf, values
near the format's limits), and the fast oracle with them within its bound of the ordered oracle
under the ordered oracle's conventions (lonely rows, sinks, non-finite rows, chunking, float64 and
mixed tables, ``pv_abs``). On a CUDA device the compiled kernels run; on the CPU Triton's
interpreter (``TRITON_INTERPRET=1``, set by ``test_attention_fused`` before the kernels are first
imported). Every test that runs the kernels skips where Triton is not installed."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings

from dsv4_numerics.reference.attention import fast_passes, fast_rows
from dsv4_numerics.reference.attention.fast import fast_sparse_attention
from dsv4_numerics.reference.attention.fast_bound import norm_factor
from dsv4_numerics.reference.attention.ordered import Segment, sparse_attention
from dsv4_numerics.reference.errors import InputError
from dsv4_numerics.reference.policies import NanPolicy

from .test_attention_fast import assert_matches_ordered, problems
from .test_attention_fused import (DEV, HAS_TRITON, SINKS, decode_like, float64_problem, needs_triton, on, poisoned,
                                   segs_on)


def passes_vs_ordered(q, segs, scale, sink=None, nan_policy=NanPolicy.PROPAGATE, chunk_tokens=None, d_v=None,
                      want_abs=False):
    """The fast oracle with the Triton passes (on ``DEV``) against the ordered oracle (CPU)."""
    o = sparse_attention(q, segs, scale, sink, nan_policy=nan_policy, d_v=d_v)
    f = fast_sparse_attention(q.to(DEV), segs_on(segs), scale, on(sink), nan_policy=nan_policy,
                              chunk_tokens=chunk_tokens, d_v=d_v, want_abs=want_abs, passes=True, fused=False,
                              graph=False)
    return f, o, assert_matches_ordered(f, o)


def adversarial_bf16(rows=40, dims=96, seed=0):
    """bfloat16 rows over the whole exponent range with zeros, -0, subnormals, NaN, +-Inf and
    values whose float32 squares overflow or underflow."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, dims, generator=g) * torch.logspace(-45, 37, dims)).to(torch.bfloat16)
    x[0] = 0.0
    x[1] = -0.0
    x[2, :5] = math.nan
    x[3, 3] = math.inf
    x[4, 7] = -math.inf
    x[5] = torch.tensor(1e-39).to(torch.bfloat16)  # subnormal
    x[6, 0] = 3e38  # square overflows float32
    x[7] = torch.tensor(2.0**-130).to(torch.bfloat16)  # squares underflow float32
    x[8, 60] = math.nan  # NaN beyond d_v: the norm sees it, max |v| does not
    return x


@needs_triton
@pytest.mark.parametrize("d_v", [96, 64, 1])
def test_row_stats_kernel_is_the_pytorch_pass(d_v):
    x = adversarial_bf16().to(DEV)
    a, b = fast_rows.row_stats(x, d_v), fast_passes.row_stats(x, d_v)
    fin = torch.isfinite(a[0])
    assert torch.equal(fin, torch.isfinite(b[0]))  # the same rows go to the ordered path
    assert torch.equal(torch.isnan(a[0]), torch.isnan(b[0]))
    # the norm: both upper bounds within norm_factor; the two evaluations agree to float32 roundings
    exact = x.double().pow(2).sum(1).sqrt()
    assert bool((exact[fin] <= norm_factor(x.shape[1]) * b[0][fin].double()).all())
    assert bool(((a[0][fin] - b[0][fin]).abs() <= 2.0**-20 * a[0][fin]).all())
    # log2 n - lsb within the exactness test's margin (the same value up to roundings)
    assert bool(((a[1][fin] - b[1][fin]).abs() <= 2.0**-12).all())
    assert torch.equal(a[2].isnan(), b[2].isnan())  # max |v|: exact, NaN where a value is
    assert torch.equal(a[2].nan_to_num(), b[2].nan_to_num())


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("want_abs", [False, True])
def test_gather_kernel_is_the_exact_conversion(dtype, want_abs):
    t = adversarial_bf16(50, 80, seed=3).to(dtype).to(DEV)
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, t.shape[0], (3 * 11,), generator=g).to(DEV)
    got, ga = fast_passes.gather(t, idx, 3, 48, want_abs)
    want = t.index_select(0, idx).double().view(3, 11, 80)
    assert got.shape == want.shape and got.dtype == torch.float64
    same = ~want.isnan()
    assert torch.equal(got[same].view(torch.int64), want[same].view(torch.int64))  # bits, signed zeros included
    assert torch.equal(got.isnan(), want.isnan())
    if want_abs:
        a = t.index_select(0, idx)[:, :48].abs().view(3, 11, 48)
        assert ga.dtype == dtype and torch.equal(ga.nan_to_num(), a.nan_to_num())
    else:
        assert ga is None


@needs_triton
@pytest.mark.parametrize("K", [1, 7, 300])
def test_softmax_kernel_against_the_pytorch_passes(K):
    g = torch.Generator().manual_seed(K)
    c, H = 3, 5
    s = torch.randn(c, H, K, generator=g, dtype=torch.float64) * 30
    s[0, 0, 0] = -0.0  # a -0 logit turns +0 (the max of a row of zeros is +0)
    s[1, 1] = 0.0
    s[1, 1, -1] = -0.0
    valid = torch.rand(c, K, generator=g) > 0.3
    valid[2] = False  # a lonely token
    valid[1, :] = True
    scale = 0.0883883476483184
    fconst = torch.tensor([scale, 1.0], dtype=torch.float64)
    ref = torch.where(valid.unsqueeze(1), torch.zeros(()), torch.full((), -math.inf, dtype=torch.float64)) + scale * s
    m_ref = ref.amax(dim=2, keepdim=True)
    p_ref = (ref - torch.where(m_ref == -math.inf, torch.zeros(()), m_ref)).exp()
    p, m, L, pb, _ = fast_passes.softmax(s.clone().to(DEV), valid.to(DEV), fconst.to(DEV), True)
    assert torch.equal(m.cpu(), m_ref) and not bool(torch.signbit(m.cpu()[1, 1]))  # the max is exact, +0
    assert torch.equal(m.cpu()[2], torch.full((H, 1), -math.inf, dtype=torch.float64))
    assert bool(((p.cpu() - p_ref).abs() <= 2.0**-48 * p_ref).all())  # exp within eps_e
    assert torch.equal(p.cpu()[2], torch.zeros(H, K, dtype=torch.float64))  # lonely: p = 0, L = 0
    L_ref = p_ref.sum(dim=2, keepdim=True)
    assert bool(((L.cpu() - L_ref).abs() <= (K + 2) * 2.0**-48 * L_ref).all())
    assert torch.equal(pb.cpu(), p.cpu().to(torch.bfloat16))


def layout_problem(case: str, seed: int):
    """Segments whose indices cover every class the layout tells apart: valid, -1, -2 and below,
    at and past ``N_s``, past the segment's length, with lengths of 0, ``K_s`` and in between (some
    tokens' lengths out of ``[0, K_s]``: the flags must report them), an empty segment
    (``N_s = 0``), a segment without lengths, int32 and int64 indices, mixed rules."""
    from dsv4_numerics.reference.policies import IndexRule

    g = torch.Generator().manual_seed(seed)
    T, D = 6, 8
    specs = {"one": [(9, 5, True, "m1")], "one-nolen": [(9, 5, False, "any")],
             "two": [(9, 5, True, "m1"), (4, 7, True, "m1")], "mixed": [(9, 5, True, "m1"), (4, 7, False, "any")],
             "empty": [(0, 3, True, "m1"), (6, 4, True, "any")], "three": [(5, 2, False, "any"), (0, 4, True, "any"),
                                                                          (7, 9, True, "m1")]}[case]
    segs = []
    for i, (N, K, has_len, rule) in enumerate(specs):
        idx = torch.randint(-3, N + 3, (T, K), generator=g)
        idx = idx.to(torch.int32) if i % 2 == 0 else idx
        length = torch.randint(-1, K + 2, (T,), generator=g, dtype=torch.int32) if has_len else None
        rows = torch.randn(N, D, generator=g).to(torch.bfloat16)
        r = IndexRule.MINUS1_ONLY if rule == "m1" else IndexRule.ANY_OUT_OF_RANGE_INVALID
        segs.append(Segment(rows, idx, length, r))
    return segs, T


@needs_triton
@pytest.mark.parametrize("problem", ["decode", "one-segment", "nan_row", "inf_q", "huge", "scrub", "strided",
                                     "decode-chunked", "scrub-chunked"])
@pytest.mark.parametrize("want_abs", [False, True])
def test_gathering_from_the_segments_is_the_table_path(problem, want_abs, monkeypatch):
    """bfloat16 rows of one or two segments are gathered from the segments themselves with each
    row's statistics (``fast_passes.gather_stats``: no table, no separate statistics pass; q's rows
    and the first chunk's slots in the layout's launch, the other chunks' by their own); the
    table path (``fast.direct_rows`` refused) gives the same bits: outputs, bounds, the proven-exact
    fraction and ``pv_abs`` -- the same float64 rows, the same statistics, the same GEMMs."""
    from dsv4_numerics.reference.attention import fast

    chunk = 2 if problem.endswith("-chunked") else None  # chunks after the first gather by themselves
    problem = problem.removesuffix("-chunked")
    nan_policy = NanPolicy.SCRUB if problem == "scrub" else NanPolicy.PROPAGATE
    if problem in ("decode", "one-segment", "strided"):
        q, segs = decode_like(seed=3)
        if problem == "one-segment":
            segs = segs[:1]
        if problem == "strided":  # rows with a row stride wider than D
            wide = torch.zeros(segs[0].rows.shape[0], 80, dtype=torch.bfloat16)
            wide[:, :64] = segs[0].rows
            segs = [Segment(wide[:, :64], segs[0].idx, segs[0].length, segs[0].rule), segs[1]]
    else:
        q, segs = poisoned("nan_row" if problem == "scrub" else problem)
    assert fast.direct_rows(segs, q)
    args = (q.to(DEV), segs_on(segs), 0.125, on(torch.tensor([0.5, -1.0, 2.0, 0.0, 1.5])))
    kw = dict(nan_policy=nan_policy, want_abs=want_abs, passes=True, fused=False, graph=False, chunk_tokens=chunk)
    direct = fast_sparse_attention(*args, **kw)
    monkeypatch.setattr(fast, "direct_rows", lambda segments, q: False)
    table = fast_sparse_attention(*args, **kw)
    for name in ("out", "lse", "lse_with_sink", "max_logits", "n_valid", "pv_abs"):
        a, b = getattr(direct, name), getattr(table, name)
        assert (a is None) == (b is None) and (a is None or torch.equal(a.cpu().view(-1).view(torch.uint8),
                                                                      b.cpu().view(-1).view(torch.uint8))), name
    for name in direct.bound:
        assert torch.equal(direct.bound[name].cpu(), table.bound[name].cpu()), name
    assert direct.exact_logits == table.exact_logits
    o = sparse_attention(q, segs, 0.125, torch.tensor([0.5, -1.0, 2.0, 0.0, 1.5]), nan_policy=nan_policy)
    assert_matches_ordered(direct, o)


@needs_triton
@pytest.mark.parametrize("case", ["one", "one-nolen", "two", "mixed", "empty", "three"])
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("sink_dtype", [None, torch.float32, torch.bfloat16])
def test_layout_kernel_is_the_pytorch_layout_and_flags(case, seed, sink_dtype):
    """``fast.layout_by_kernel`` (one Triton kernel) against ``fast.slot_layout`` and ``fast.layout_flags``:
    the same validity, table rows and counts, and the same host-vector flags (lengths' minima and
    maxima per segment, the -1-only range offsets' extremes where the rule applies), which sink values are NaN."""
    from dsv4_numerics.reference.attention import fast

    segs, T = layout_problem(case, seed)
    segs = segs_on(segs)
    rules = [sg.rule for sg in segs]
    sink = None if sink_dtype is None else torch.tensor([0.5, -math.inf, math.nan, -0.0]).to(sink_dtype).to(DEV)
    v_ref, g_ref, n_ref, pending, _ = fast.slot_layout(segs, rules, T, DEV)
    flags = [f.cpu() for f in fast.layout_flags(pending)]
    v8, gidx, nv, hv, _, at, _ = fast.layout_by_kernel(segs, rules, T, DEV, sink, 2)
    assert torch.equal(v8.view(torch.bool).cpu(), v_ref.cpu())
    assert torch.equal(gidx.cpu(), g_ref.cpu())
    assert torch.equal(nv.cpu(), n_ref.cpu())
    host = hv.cpu().tolist()
    S = len(segs)
    assert host[:S] == flags[0].tolist() and host[S:2 * S] == flags[1].tolist()
    if len(flags) > 2:  # -1-only offsets: the PyTorch pass sets the other columns to 0, as the kernel's neutral values
        assert at == 2 * S + 2 and host[2 * S:2 * S + 2] == [int(flags[2]), int(flags[3])]
    else:
        assert at == 2 * S
    assert host[at:at + 4] == [0, 0, 0, 0]  # the counts, added by the softmax kernel
    if sink is None:
        assert len(host) == at + 4
    else:
        assert host[at + 4:] == [0, 0, 1, 0]  # per sink value: NaN or not


@needs_triton
@pytest.mark.parametrize("case", ["empty", "three"])
@pytest.mark.parametrize("passes", [False, True])
def test_an_empty_segment_has_no_valid_slot(case, passes):
    """A segment of no rows (``N_s = 0``): no index is valid, -1 is the empty sentinel under both
    rules (the fast oracle once took -1 for a valid slot there, reading another segment's row), and
    under ``MINUS1_ONLY`` an index of -2 or >= 0 is an error, as in the ordered oracle."""
    from dsv4_numerics.reference.policies import IndexRule

    segs, T = layout_problem(case, 0)
    fixed = []
    for sg in segs:
        idx = sg.idx.clamp(-1, max(sg.rows.shape[0] - 1, -1))  # valid or -1: no input error
        fixed.append(Segment(sg.rows, idx, None if sg.length is None else sg.length.clamp(0, idx.shape[1]), sg.rule))
    g = torch.Generator().manual_seed(5)
    q = torch.randn(T, 3, 8, generator=g).to(torch.bfloat16)
    o = sparse_attention(q, fixed, 0.3)
    f = fast_sparse_attention(q.to(DEV), segs_on(fixed), 0.3, passes=passes, fused=False, graph=False)
    assert torch.equal(f.n_valid.cpu(), o.n_valid)
    assert_matches_ordered(f, o)
    m1 = [Segment(torch.zeros(0, 8, dtype=torch.bfloat16), torch.full((T, 2), v), None, IndexRule.MINUS1_ONLY)
          for v in (-2, 0)]
    for bad in m1:
        with pytest.raises(InputError):
            sparse_attention(q, [bad], 0.3)
        with pytest.raises(InputError):
            fast_sparse_attention(q.to(DEV), segs_on([bad]), 0.3, passes=passes, fused=False, graph=False)


@needs_triton
@pytest.mark.parametrize("sink_dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("passes", [True, False])
def test_a_nan_sink_is_the_ordered_oracles_error(sink_dtype, passes):
    """A NaN sink value (the layout kernel's per-head NaN flags, or the PyTorch passes' ``isnan``,
    read with the call's one sync) raises the ordered oracle's error, in every float format; ``+-inf``
    sinks (allowed) do not. A strided sink (a column of a wider tensor) is read at its own elements:
    a NaN beside them raises nothing and leaves the result as the ordered oracle's, a NaN among them
    raises (the layout kernel once read it as contiguous: the NaN beside it failed the call with an
    internal error, the one inside it came back as a NaN result)."""
    q, segs = decode_like()
    H = q.shape[1]
    sink = torch.zeros(H, dtype=sink_dtype)
    sink[0], sink[1] = math.inf, -math.inf
    kw = dict(passes=passes, fused=False, graph=False)
    fast_sparse_attention(q.to(DEV), segs_on(segs), 0.125, on(sink), **kw)  # infinite sinks are accepted
    sink[H - 1] = -math.nan
    with pytest.raises(InputError) as ordered:
        sparse_attention(q, segs, 0.125, sink)
    with pytest.raises(InputError) as fast:
        fast_sparse_attention(q.to(DEV), segs_on(segs), 0.125, on(sink), **kw)
    assert str(fast.value).replace("fast_sparse_attention", "sparse_attention") == str(ordered.value)
    wide = torch.zeros(H, 3, dtype=sink_dtype)
    wide[:, 0] = torch.linspace(-2.0, 2.0, H).to(sink_dtype)
    wide[0, 1] = math.nan  # beside the sink: sink[1] is wide[1, 0]
    strided = on(wide)[:, 0]
    assert strided.stride(0) == 3
    assert_matches_ordered(fast_sparse_attention(q.to(DEV), segs_on(segs), 0.125, strided, **kw),
                           sparse_attention(q, segs, 0.125, wide[:, 0]))
    wide[H - 1, 0] = math.nan
    with pytest.raises(InputError, match="sink"):
        fast_sparse_attention(q.to(DEV), segs_on(segs), 0.125, on(wide)[:, 0], **kw)


@needs_triton
@pytest.mark.parametrize("sink", list(SINKS))
@pytest.mark.parametrize("chunk", [None, 1, 3])
def test_passes_within_bound_exact_logits_and_lonely_rows(sink, chunk):
    q, segs = decode_like()
    f, o, _ = passes_vs_ordered(q, segs, 512**-0.5, SINKS[sink], chunk_tokens=chunk, want_abs=True)
    assert f.exact_logits == 1.0
    assert torch.equal(f.max_logits.cpu(), o.max_logits)  # exact rows: the ordered bits
    lonely = o.n_valid == 0
    assert bool(lonely.any())
    assert torch.equal(f.out.cpu()[lonely], torch.zeros_like(o.out[lonely]))
    assert bool((f.lse.cpu()[lonely] == -math.inf).all())
    u = fast_sparse_attention(q.to(DEV), segs_on(segs), 512**-0.5, on(SINKS[sink]), chunk_tokens=chunk,
                              want_abs=True, fused=False, passes=False, graph=False)
    assert torch.equal(u.max_logits, f.max_logits) and u.exact_logits == f.exact_logits
    fin = torch.isfinite(u.pv_abs)
    assert torch.equal(fin, torch.isfinite(f.pv_abs))
    assert torch.allclose(u.pv_abs[fin], f.pv_abs[fin], rtol=1e-6, atol=1e-300)  # the same bf16 GEMM inputs


@needs_triton
@pytest.mark.parametrize("nan_policy", [NanPolicy.PROPAGATE, NanPolicy.SCRUB])
@pytest.mark.parametrize("poison", ["nan_row", "inf_row", "inf_q", "huge"])
@pytest.mark.parametrize("chunk", [None, 1])  # 1: the redone chunk's float64 pv_abs beside bfloat16 ones
def test_passes_non_finite_and_extreme_rows_follow_the_ordered_conventions(nan_policy, poison, chunk):
    q, segs = poisoned(poison)
    f, o, _ = passes_vs_ordered(q, segs, 64**-0.5, SINKS["infinite"], nan_policy=nan_policy, want_abs=True,
                                chunk_tokens=chunk)
    u = fast_sparse_attention(q.to(DEV), segs_on(segs), 64**-0.5, on(SINKS["infinite"]), nan_policy=nan_policy,
                              want_abs=True, chunk_tokens=chunk, fused=False, passes=False, graph=False)
    fin = torch.isfinite(u.pv_abs)
    assert torch.equal(fin, torch.isfinite(f.pv_abs))
    assert torch.allclose(u.pv_abs[fin], f.pv_abs[fin], rtol=1e-6, atol=1e-300)


@needs_triton
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_row_tests_in_the_softmax_kernel_decide_as_the_pytorch_tests(seed):
    """The softmax kernel's row tests (exact / fast, ``x``, ``max |v|``) against the PyTorch path's
    on the same inputs: the same rows proven exact, the same rows sent to the ordered logits, and
    bounds equal up to the float32 roundings of the norms (the statistics kernel's)."""
    q, segs = decode_like(seed=seed)
    if seed == 1:  # rows beyond the exactness test, a NaN row and an overflowing one: every branch
        r = segs[0].rows.clone()
        r[0] = r[0] * 2.0**60
        r[1, 2] = math.nan
        r[2, 0] = 2.0**100
        segs = [Segment(r, segs[0].idx, segs[0].length, segs[0].rule), segs[1]]
    if seed == 2:  # q rows spanning 40 binades: approximate (bounded) logits
        q = q.clone()
        q[..., 0] = q[..., 0] * 2.0**10
        q[..., 1] = q[..., 1] * 2.0**-30
    kw = dict(want_abs=True, fused=False, graph=False)
    a = fast_sparse_attention(q.to(DEV), segs_on(segs), 0.125, None, passes=True, **kw)
    b = fast_sparse_attention(q.to(DEV), segs_on(segs), 0.125, None, passes=False, **kw)
    assert a.exact_logits == b.exact_logits
    assert (a.exact_logits < 1.0) == (seed == 2)  # seed 2 reaches the approximate branch
    for name in ("out", "lse", "lse_with_sink", "max_logits"):
        x, y = a.bound[name], b.bound[name]
        assert torch.allclose(x, y, rtol=2.0**-18, atol=0), (name, (x - y).abs().max())
        fa, fb = getattr(a, name), getattr(b, name)
        assert torch.equal(torch.isnan(fa), torch.isnan(fb)), name


@needs_triton
def test_passes_float64_and_mixed_tables_and_d_v():
    q, rows, idx = float64_problem()
    f, _, _ = passes_vs_ordered(q, [Segment(rows, idx)], 0.125, torch.tensor([0.5, -math.inf, math.inf]), d_v=20,
                                want_abs=True)
    assert f.exact_logits < 0.5 and f.pv_abs.shape == (3, 3, 20)
    passes_vs_ordered(q.to(torch.bfloat16), [Segment(rows.float(), idx)], 0.125, None, want_abs=True)


@needs_triton
@settings(max_examples=25, deadline=None)
@given(problems())
def test_passes_within_bound_under_hypothesis(prob):
    q, segs, scale, sink, nan, d_v, chunk = prob
    passes_vs_ordered(q, segs, scale, sink, nan, chunk_tokens=chunk, d_v=d_v)


def test_passes_option_is_validated_and_on_by_default_on_cuda(monkeypatch):
    q, segs = decode_like()
    monkeypatch.delenv(fast_passes.ENV, raising=False)
    assert not fast_passes.default_on(torch.device("cpu"))
    assert fast_passes.default_on(torch.device("cuda")) == HAS_TRITON
    monkeypatch.setenv(fast_passes.ENV, "torch")
    assert not fast_passes.default_on(torch.device("cuda"))
    with pytest.raises(InputError, match="passes"):
        fast_sparse_attention(q, segs, 0.1, passes="yes")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(InputError, match="passes.*Triton"):
        fast_sparse_attention(q, segs, 0.1, passes=True)


def test_the_fast_oracle_does_not_import_triton_for_the_passes():
    code = ("import sys; import dsv4_numerics.reference.attention.fast_passes; "
            "import dsv4_numerics.reference.attention.fast as f, torch; "
            "q = torch.zeros(1, 1, 8, dtype=torch.bfloat16); "
            "s = f.Segment(torch.zeros(2, 8, dtype=torch.bfloat16), torch.zeros(1, 2, dtype=torch.int32)); "
            "f.fast_sparse_attention(q, [s], 0.5); "
            "assert 'triton' not in sys.modules, 'triton imported'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
