"""The float64 sparse-attention oracle: hand-computed cases, conventions, metamorphic properties."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dsv4_numerics.reference.attention.ordered import (
    Segment,
    auto_chunk_tokens,
    bf16_p_error_bound,
    logaddexp,
    lse_to_flashmla,
    lse_to_sm120,
    peak_bytes_estimate,
    segment_validity,
    sparse_attention,
)
from dsv4_numerics.reference.detmath import det_exp, det_log
from dsv4_numerics.reference.errors import InputError
from dsv4_numerics.reference.policies import IndexRule, NanPolicy

INF = math.inf
D = 8  # the oracle is generic in D; small D keeps the hand cases readable


def rows_of(*vals, d=D):
    """rows[i] = vals[i] padded with zeros to width d (float64)."""
    r = torch.zeros(len(vals), d, dtype=torch.float64)
    for i, v in enumerate(vals):
        r[i, : len(v)] = torch.tensor(v, dtype=torch.float64)
    return r


def q_of(*heads, d=D):
    """q [1, H, d]: one token, head h = heads[h] padded."""
    q = torch.zeros(1, len(heads), d, dtype=torch.float64)
    for h, v in enumerate(heads):
        q[0, h, : len(v)] = torch.tensor(v, dtype=torch.float64)
    return q


def seg(rows, *idx_rows, length=None, rule=IndexRule.ANY_OUT_OF_RANGE_INVALID):
    idx = torch.tensor(idx_rows, dtype=torch.int32)
    ln = None if length is None else torch.tensor(length, dtype=torch.int32)
    return Segment(rows, idx, ln, rule)


# --------------------------------------------------------------------------- hand-computed cases
def test_one_key():
    # q = e0, K = (2, 3, 0...), scale 0.5: s = 0.5 * 2 = 1. One key: weight 1 -> O = K,
    # lse = max = s = 1. Sink 1.0: f = 1/(1 + exp(1 - 1)) = 1/2 -> out = (1, 1.5, 0...).
    rows = rows_of([2.0, 3.0])
    r = sparse_attention(q_of([1.0]), [seg(rows, [0])], 0.5)
    assert r.out[0, 0, :2].tolist() == [2.0, 3.0] and r.lse.item() == 1.0 and r.max_logits.item() == 1.0
    assert r.n_valid.tolist() == [1] and r.lse_with_sink.item() == 1.0
    r = sparse_attention(q_of([1.0]), [seg(rows, [0])], 0.5, torch.tensor([1.0]))
    assert r.out[0, 0, :3].tolist() == [1.0, 1.5, 0.0]
    assert r.lse.item() == 1.0  # sink-free
    assert abs(r.lse_with_sink.item() - (1.0 + math.log(2.0))) <= 1e-15  # log(e + e) = 1 + ln 2


def test_two_keys_known_logits():
    # q = e0 (scale 1); K1 = (0, 4), K2 = (1, 8): s1 = 0, s2 = 1.
    # weights 1/(1+e), e/(1+e); O = (e/(1+e), (4 + 8e)/(1+e)); lse = ln(1 + e); max = 1.
    rows = rows_of([0.0, 4.0], [1.0, 8.0])
    r = sparse_attention(q_of([1.0]), [seg(rows, [0, 1])], 1.0)
    e = math.e
    assert abs(r.out[0, 0, 0].item() - e / (1 + e)) <= 1e-15
    assert abs(r.out[0, 0, 1].item() - (4 + 8 * e) / (1 + e)) <= 4e-15
    assert abs(r.lse.item() - math.log(1 + e)) <= 1e-15 and r.max_logits.item() == 1.0
    # equal logits: q = e2 (orthogonal to both): s = 0, 0 -> mean of rows, lse = ln 2
    r = sparse_attention(q_of([0.0, 0.0, 1.0]), [seg(rows, [0, 1])], 1.0)
    assert r.out[0, 0, :2].tolist() == [0.5, 6.0] and abs(r.lse.item() - math.log(2)) <= 1e-16


def test_lonely_query_is_exact_zero_for_any_sink():
    rows = rows_of([1.0, 2.0], [3.0, 4.0])
    sink = torch.tensor([-INF, 0.0, 2.5, INF])
    q = q_of([1.0], [2.0], [3.0], [4.0])
    for s in (seg(rows, [-1, -1]), seg(rows, [0, 1], length=[0]), seg(rows, [5, -7])):
        r = sparse_attention(q, [s], 0.3, sink)
        assert torch.equal(r.out, torch.zeros(1, 4, D, dtype=torch.float64))
        assert r.lse.tolist() == [[-INF] * 4] and r.max_logits.tolist() == [[-INF] * 4]
        assert r.lse_with_sink.tolist() == [[-INF, 0.0, 2.5, INF]] and r.n_valid.tolist() == [0]
        assert math.copysign(1.0, r.out[0, 0, 0].item()) == 1.0  # +0, not -0


def test_sinks_minus_inf_zero_plus_inf():
    # one key with s = 0 (q orthogonal): lse = 0. sink -inf: f = 1; sink 0: f = 1/(1+e^0) = 1/2;
    # sink +inf: f = 0. V = (2, -6).
    rows = rows_of([0.0, 0.0, 2.0, -6.0])
    q = q_of([1.0], [1.0], [1.0])
    r = sparse_attention(q, [seg(rows, [0])], 1.0, torch.tensor([-INF, 0.0, INF]))
    assert r.out[0, :, 2:4].tolist() == [[2.0, -6.0], [1.0, -3.0], [0.0, 0.0]]
    assert r.lse.tolist() == [[0.0, 0.0, 0.0]]
    assert r.lse_with_sink[0, 0].item() == 0.0 and r.lse_with_sink[0, 2].item() == INF
    assert abs(r.lse_with_sink[0, 1].item() - math.log(2)) <= 1e-16
    nosink = sparse_attention(q, [seg(rows, [0])], 1.0)
    assert torch.equal(nosink.out[0, 0], r.out[0, 0])


def test_nan_in_unreferenced_rows_never_leaks():
    clean = rows_of([1.0, 2.0], [0.5, -1.0], [3.0, 0.25])
    poisoned = clean.clone()
    extra = torch.full((3, D), math.nan, dtype=torch.float64)
    poisoned = torch.cat([poisoned, extra])  # rows 3..5 are NaN
    q = q_of([0.5, 1.0], [-1.0, 0.25])
    a = sparse_attention(q, [seg(clean, [0, 2, -1, -1])], 0.7)
    # NaN rows referenced only by masked columns (after the length) -> bit-identical
    b = sparse_attention(q, [seg(poisoned, [0, 2, 3, 4], length=[2])], 0.7)
    assert torch.equal(a.out, b.out) and torch.equal(a.lse, b.lse)
    # out-of-range values are invalid under ANY_OUT_OF_RANGE_INVALID, wherever they sit
    c = sparse_attention(q, [seg(poisoned[:3], [0, 7, 2, -5])], 0.7)
    assert torch.equal(a.out, c.out)


def test_nan_in_valid_row_propagate_and_scrub():
    rows = rows_of([1.0, 2.0], [math.nan, 1.0])
    q = q_of([1.0, 0.0], [0.0, 1.0])
    r = sparse_attention(q, [seg(rows, [0, 1])], 1.0)
    assert bool(torch.isnan(r.out).all()) and bool(torch.isnan(r.lse).all())
    # SCRUB: row 1 becomes (0, 1): head 0: s = (1, 0), head 1: s = (2, 1)
    s = sparse_attention(q, [seg(rows, [0, 1])], 1.0, nan_policy=NanPolicy.SCRUB)
    ref = sparse_attention(q, [seg(rows_of([1.0, 2.0], [0.0, 1.0]), [0, 1])], 1.0)
    assert torch.equal(s.out, ref.out) and torch.equal(s.lse, ref.lse)


def test_duplicate_indices_count_twice():
    # K1 = (0, 3), K2 = (0, 6), q = e0 -> s = 0 for both. idx [0, 0, 1]: weights 2/3, 1/3:
    # O = (0, (2*3 + 6)/3) = (0, 4); lse = ln 3.
    rows = rows_of([0.0, 3.0], [0.0, 6.0])
    r = sparse_attention(q_of([1.0]), [seg(rows, [0, 0, 1])], 1.0)
    assert r.out[0, 0, 1].item() == 4.0 and r.n_valid.tolist() == [3]
    assert abs(r.lse.item() - math.log(3)) <= 1e-15


def test_two_segments_one_softmax():
    # SWA row (0, 2) and compressed row (0, 8), both s = 0 -> one softmax over both: O = (0, 5).
    swa, comp = rows_of([0.0, 2.0]), rows_of([0.0, 8.0])
    r = sparse_attention(q_of([1.0]), [seg(swa, [0]), seg(comp, [0, -1], length=[2])], 1.0)
    assert r.out[0, 0, 1].item() == 5.0 and r.n_valid.tolist() == [2]


def test_d_v_slices_value_rows():
    rows = rows_of([0.0, 2.0, 7.0])
    r = sparse_attention(q_of([1.0]), [seg(rows, [0])], 1.0, d_v=2)
    assert r.out.shape == (1, 1, 2) and r.out[0, 0].tolist() == [0.0, 2.0]


def test_minus1_only_rule():
    rows = rows_of([1.0], [2.0])
    q = q_of([1.0])
    ok = sparse_attention(q, [seg(rows, [0, -1, -9], length=[2], rule=IndexRule.MINUS1_ONLY)], 1.0)
    assert ok.n_valid.tolist() == [1]  # -9 sits after the length: never read
    with pytest.raises(InputError, match=r"sparse_attention: argument 'segments\[0\].idx'.*MINUS1_ONLY.*token 0, column 1: -2"):
        sparse_attention(q, [seg(rows, [0, -2], rule=IndexRule.MINUS1_ONLY)], 1.0)
    with pytest.raises(InputError, match="column 0: 2"):
        sparse_attention(q, [seg(rows, [2, 0], rule=IndexRule.MINUS1_ONLY)], 1.0)


def test_validation_errors():
    rows = rows_of([1.0])
    q = q_of([1.0])
    s = seg(rows, [0])
    cases = [
        (lambda: sparse_attention(q[0], [s], 1.0), "'q'.*shape \\[T, H, D\\]"),
        (lambda: sparse_attention(q, [], 1.0), "'segments'.*non-empty"),
        (lambda: sparse_attention(q, [s], 0.0), "'scale'.*> 0"),
        (lambda: sparse_attention(q, [s], math.nan), "'scale'"),
        (lambda: sparse_attention(q, [s], 1.0, torch.tensor([math.nan])), "'sink'.*NaN"),
        (lambda: sparse_attention(q, [s], 1.0, torch.tensor([0.0, 1.0])), "'sink'.*shape"),
        (lambda: sparse_attention(q, [s], 1.0, d_v=D + 1), "'d_v'"),
        (lambda: sparse_attention(q, [seg(rows_of([1.0], d=4), [0])], 1.0), "'segments\\[0\\].rows'.*shape \\[N, 8\\]"),
        (lambda: sparse_attention(q, [seg(rows, [0], length=[2])], 1.0), "'segments\\[0\\].length'.*\\[0, K=1\\]"),
        (lambda: sparse_attention(q, [Segment(rows, torch.tensor([[0.0]]))], 1.0), "'segments\\[0\\].idx'.*dtype"),
        (lambda: sparse_attention(q, [s], 1.0, mode="fast"), "'mode'"),
        (lambda: sparse_attention(q, [s], 1.0, chunk_tokens=0), "'chunk_tokens'"),
    ]
    for call, pat in cases:
        with pytest.raises(InputError, match="sparse_attention: argument " + pat):
            call()


# --------------------------------------------------------------------------- independent cross-check
def _naive(q, rows_list, idx_list, len_list, scale, sink):
    """Per-token float64 torch softmax over an explicit Python list of valid keys."""
    T, H, Dq = q.shape
    out = torch.zeros(T, H, Dq, dtype=torch.float64)
    lse = torch.full((T, H), -INF, dtype=torch.float64)
    for t in range(T):
        keys = []
        for rows, idx, ln in zip(rows_list, idx_list, len_list):
            for c in range(idx.shape[1]):
                i = int(idx[t, c])
                if (ln is None or c < int(ln[t])) and 0 <= i < rows.shape[0]:
                    keys.append(rows[i].double())
        if not keys:
            continue
        Kt = torch.stack(keys)
        s = scale * (q[t].double() @ Kt.T)
        lse[t] = torch.logsumexp(s, dim=-1)
        o = torch.softmax(s, dim=-1) @ Kt
        if sink is not None:
            o = o * torch.sigmoid(lse[t] - sink.double())[:, None]
        out[t] = o
    return out, lse


def _random_problem(seed, T=5, H=3, Dq=512, N1=50, K1=24, N2=20, K2=16):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, Dq, generator=g).clamp(-1, 1).to(torch.bfloat16)
    r1 = (torch.randn(N1, Dq, generator=g) * 0.1).to(torch.bfloat16)
    r2 = (torch.randn(N2, Dq, generator=g) * 0.1).to(torch.bfloat16)
    i1 = torch.randint(-3, N1 + 3, (T, K1), generator=g, dtype=torch.int32)
    i2 = torch.randint(-3, N2 + 3, (T, K2), generator=g, dtype=torch.int32)
    l1 = torch.randint(0, K1 + 1, (T,), generator=g, dtype=torch.int32)
    l2 = torch.randint(0, K2 + 1, (T,), generator=g, dtype=torch.int32)
    sink = torch.randn(H, generator=g)
    return q, (r1, i1, l1), (r2, i2, l2), sink


def test_matches_naive_float64_softmax():
    q, (r1, i1, l1), (r2, i2, l2), sink = _random_problem(0)
    r = sparse_attention(q, [Segment(r1, i1, l1), Segment(r2, i2, l2)], 512**-0.55, sink)
    out, lse = _naive(q, [r1, r2], [i1, i2], [l1, l2], 512**-0.55, sink)
    assert torch.allclose(r.out, out, rtol=1e-13, atol=1e-15)
    assert torch.allclose(r.lse, lse, rtol=1e-14, atol=0) or torch.equal(r.lse.isinf(), lse.isinf())
    finite = torch.isfinite(lse)
    assert torch.allclose(r.lse[finite], lse[finite], rtol=1e-14)


# --------------------------------------------------------------------------- properties
seeds = st.integers(0, 2**31 - 1)


def _small(seed, T=4, H=2, Dq=16, N=12, K=10):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, Dq, generator=g, dtype=torch.float64)
    rows = torch.randn(N, Dq, generator=g, dtype=torch.float64)
    idx = torch.randint(-2, N + 2, (T, K), generator=g)
    ln = torch.randint(0, K + 1, (T,), generator=g)
    sink = torch.randn(H, generator=g, dtype=torch.float64)
    return g, q, rows, idx, ln, sink


@given(seeds)
def test_permuting_slots_changes_only_rounding(seed):
    g, q, rows, idx, ln, sink = _small(seed)
    a = sparse_attention(q, [Segment(rows, idx, ln)], 0.4, sink)
    # permute the columns inside each row's prefix (and the tail separately)
    idx2 = idx.clone()
    for t in range(idx.shape[0]):
        n = int(ln[t])
        idx2[t, :n] = idx[t, :n][torch.randperm(n, generator=g)]
    b = sparse_attention(q, [Segment(rows, idx2, ln)], 0.4, sink)
    assert torch.allclose(a.out, b.out, rtol=1e-12, atol=1e-14)
    assert torch.allclose(a.lse, b.lse, rtol=1e-13, atol=1e-14) and torch.equal(a.n_valid, b.n_valid)
    assert torch.equal(a.max_logits, b.max_logits)


@given(seeds, st.integers(1, 5))
def test_padding_with_minus1_or_garbage_is_bit_identical(seed, pad):
    g, q, rows, idx, ln, sink = _small(seed)
    a = sparse_attention(q, [Segment(rows, idx, ln)], 0.4, sink)
    minus1 = torch.cat([idx, torch.full((idx.shape[0], pad), -1)], dim=1)
    b = sparse_attention(q, [Segment(rows, minus1, ln)], 0.4, sink)
    garbage = torch.cat([idx, torch.randint(-10**6, 10**6, (idx.shape[0], pad), generator=g)], dim=1)
    c = sparse_attention(q, [Segment(rows, garbage, ln)], 0.4, sink)
    for x in (b, c):
        for f in ("out", "lse", "lse_with_sink", "max_logits", "n_valid"):
            assert torch.equal(getattr(a, f), getattr(x, f))


@given(seeds, st.integers(0, 10))
def test_splitting_a_segment_is_the_same_softmax(seed, cut):
    g, q, rows, idx, _, sink = _small(seed)
    a = sparse_attention(q, [Segment(rows, idx)], 0.4, sink)
    b = sparse_attention(q, [Segment(rows, idx[:, :cut]), Segment(rows, idx[:, cut:])], 0.4, sink)
    assert torch.equal(a.out, b.out)  # same keys in the same order -> the same fixed-order sums
    c = sparse_attention(q, [Segment(rows, idx[:, cut:]), Segment(rows, idx[:, :cut])], 0.4, sink)
    assert torch.allclose(a.out, c.out, rtol=1e-12, atol=1e-14)
    assert torch.allclose(a.lse, c.lse, rtol=1e-13, atol=1e-14)


@given(seeds)
def test_batch_permutation_permutes_exactly(seed):
    g, q, rows, idx, ln, sink = _small(seed, T=6)
    perm = torch.randperm(6, generator=g)
    a = sparse_attention(q, [Segment(rows, idx, ln)], 0.4, sink)
    b = sparse_attention(q[perm], [Segment(rows, idx[perm], ln[perm])], 0.4, sink)
    for f in ("out", "lse", "lse_with_sink", "max_logits", "n_valid"):
        assert torch.equal(getattr(a, f)[perm], getattr(b, f))


@given(seeds, st.integers(1, 7), st.sampled_from(["exact", "bf16_p"]))
def test_chunked_equals_unchunked(seed, chunk, mode):
    g, q, rows, idx, ln, sink = _small(seed, T=7)
    a = sparse_attention(q, [Segment(rows, idx, ln)], 0.4, sink, mode=mode)
    b = sparse_attention(q, [Segment(rows, idx, ln)], 0.4, sink, mode=mode, chunk_tokens=chunk)
    for f in ("out", "lse", "lse_with_sink", "max_logits", "n_valid"):
        assert torch.equal(getattr(a, f), getattr(b, f))


@given(seeds, st.floats(0.01, 0.3), st.booleans())
def test_bf16_p_within_derived_bound(seed, scale, with_sink):
    q, (r1, i1, l1), (r2, i2, l2), sink = _random_problem(seed, T=3, H=2, Dq=64)
    sink = sink.clone()
    sink[0] = INF if seed % 3 == 0 else sink[0]
    sink = sink if with_sink else None
    segs = [Segment(r1, i1, l1), Segment(r2, i2, l2)]
    ex = sparse_attention(q, segs, scale, sink)
    bp = sparse_attention(q, segs, scale, sink, mode="bf16_p")
    bound = bf16_p_error_bound(q, segs, scale, sink)
    assert bool(((bp.out - ex.out).abs() <= bound).all())
    # BF16_P output is bf16-representable
    assert torch.equal(bp.out, bp.out.to(torch.bfloat16).to(torch.float64))


def test_bf16_p_bound_is_not_vacuous():
    # With large logit spread the bf16 rounding of P is the dominant error; the bound must be
    # within a small factor of the realised error (so it can flag a kernel that is 2x worse).
    q, (r1, i1, l1), (r2, i2, l2), sink = _random_problem(5, T=8, H=4, Dq=128, K1=64, K2=64)
    segs = [Segment(r1, i1, l1), Segment(r2, i2, l2)]
    ex = sparse_attention(q, segs, 2.0, sink)
    bp = sparse_attention(q, segs, 2.0, sink, mode="bf16_p")
    bound = bf16_p_error_bound(q, segs, 2.0, sink)
    ratio = ((bp.out - ex.out).abs() / bound.clamp_min(1e-300)).amax().item()
    assert 0.2 < ratio <= 1.0


def test_bf16_p_known_answer_single_key():
    # one key: p = 1 exactly, L~ = 1; sink 0 with s = 0 -> den = 1 + exp(0) = 2;
    # out = bf16(V / 2). V = 1/3 (float64) -> bf16(1/6) = 0.1669921875 (0x3E2B: 1.3359375 * 2^-3).
    rows = torch.zeros(1, D, dtype=torch.float64)
    rows[0, 0] = 1.0 / 3.0
    r = sparse_attention(q_of([0.0]), [Segment(rows, torch.tensor([[0]]))], 1.0, torch.tensor([0.0]),
                         mode="bf16_p")
    assert r.out[0, 0, 0].item() == 0.1669921875


# --------------------------------------------------------------------------- helpers, adapters
def test_det_exp_log_accuracy():
    x = torch.linspace(-740, 700, 20001, dtype=torch.float64)
    ref = torch.tensor([math.exp(v) for v in x.tolist()], dtype=torch.float64)
    ok = ref > 1e-300
    assert bool((((det_exp(x) - ref).abs() / ref)[ok] <= 4 * 2.0**-52).all())
    y = torch.logspace(-300, 300, 20001, dtype=torch.float64)
    refl = torch.tensor([math.log(v) for v in y.tolist()], dtype=torch.float64)
    assert bool(((det_log(y) - refl).abs() <= 4 * 2.0**-52 * refl.abs().clamp_min(1.0)).all())
    sp = torch.tensor([0.0, -INF, INF, math.nan], dtype=torch.float64)
    assert det_exp(sp)[:3].tolist() == [1.0, 0.0, INF] and math.isnan(det_exp(sp)[3].item())
    assert det_log(torch.tensor([1.0, 0.0, INF], dtype=torch.float64)).tolist() == [0.0, -INF, INF]


def test_logaddexp_special_values():
    a = torch.tensor([-INF, -INF, INF, 0.0, 1.0], dtype=torch.float64)
    b = torch.tensor([-INF, 2.0, 3.0, 0.0, -INF], dtype=torch.float64)
    r = logaddexp(a, b)
    assert r[:3].tolist() == [-INF, 2.0, INF] and r[4].item() == 1.0
    assert abs(r[3].item() - math.log(2)) <= 1e-16


def test_lse_adapters():
    lse = torch.tensor([[-INF, 0.5]], dtype=torch.float64)
    assert lse_to_flashmla(lse).tolist() == [[INF, 0.5]]
    lws = torch.tensor([[-INF, 2.0]], dtype=torch.float64)
    # base 2: 2 * log2(e) = 2.8853900817779268; natural with lse_scale = ln 2 -> 2 (up to rounding)
    assert lse_to_sm120(lws)[0, 0].item() == -INF
    assert abs(lse_to_sm120(lws)[0, 1].item() - 2.0 / math.log(2)) <= 1e-15
    assert abs(lse_to_sm120(lws, math.log(2))[0, 1].item() - 2.0) <= 1e-15
    with pytest.raises(InputError, match="lse_to_sm120.*'lse_scale'"):
        lse_to_sm120(lws, -1.0)


def test_segment_validity_mask():
    rows = rows_of([1.0], [2.0], [3.0])
    m = segment_validity([seg(rows, [0, -1, 3, 2], length=[3]), seg(rows, [1])], 1)
    assert m.tolist() == [[True, False, False, False, True]]


def test_peak_bytes_formula_and_auto_chunk():
    # c * (K*D*(b+16) + 7*H*K*8 + H*(2D + 4 d_v)*8 + 25K + 64H) with c=1,H=128,K=1152,D=dv=512,b=2:
    # 1152*512*18 = 10616832; 7*128*1152*8 = 8257536; 128*3072*8 = 3145728; 28800; 8192
    # total 22057088 bytes = 21.04 MiB per token -> 256 MiB budget holds 12 tokens.
    assert peak_bytes_estimate(1, 128, 1152) == 10616832 + 8257536 + 3145728 + 28800 + 8192
    assert auto_chunk_tokens(128, 1152) == 12
    assert peak_bytes_estimate(256, 128, 1152) == 256 * peak_bytes_estimate(1, 128, 1152)
