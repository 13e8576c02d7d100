"""Dense paged MLA oracles (reference/attention/mla_dense.py): hand-worked cases (causality, d_qk != d_v,
scales, NaN isolation, lonely queries) and a cross-check against a naive per-token softmax."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dsv4_numerics.reference.errors import InputError
from dsv4_numerics.reference.attention.mla_dense import (
    dense_kv_rows,
    dense_mha_prefill,
    dense_mla_decode,
    dense_token_indices,
    ragged_causal_indices,
)

NAN = float("nan")


def test_token_indices_known_answer():
    # bs 4, request pages [3, 1]: positions 0..3 -> slots 12..15, positions 4..7 -> 4..7.
    # L = 6, s = 2 (causal): token 0 sees p <= 6 - 2 + 0 = 4 -> slots 12,13,14,15,4;
    # token 1 sees p <= 5 -> ... ,5. W = max L = 6.
    idx, ln = dense_token_indices(torch.tensor([[3, 1]]), torch.tensor([6]), 2, 4)
    assert idx.dtype == torch.int32 and ln.dtype == torch.int32
    assert idx.tolist() == [[12, 13, 14, 15, 4, -1], [12, 13, 14, 15, 4, 5]]
    assert ln.tolist() == [5, 6]
    idx, ln = dense_token_indices(torch.tensor([[3, 1]]), torch.tensor([6]), 2, 4, causal=False)
    assert ln.tolist() == [6, 6]
    # L = 1, s = 3: token 0 hi = -2, token 1 hi = -1 (both lonely), token 2 sees position 0
    idx, ln = dense_token_indices(torch.tensor([[2]]), torch.tensor([1]), 3, 4)
    assert ln.tolist() == [0, 0, 1] and idx.tolist() == [[-1], [-1], [8]]


def _hand_cache():
    """bs 2, one request L = 3 in pages [1, 0]; D = 3, d_v = 2.

    p0 = [1, 0, 0] (page 1 row 0), p1 = [0, 1, ln 3] (page 1 row 1), p2 = [5, 5, 100]
    (page 0 row 0), page 0 row 1 is past seq_len: NaN."""
    kv = torch.zeros(2, 2, 3, dtype=torch.float64)
    kv[1, 0] = torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64)
    kv[1, 1] = torch.tensor([0.0, 1.0, math.log(3.0)], dtype=torch.float64)
    kv[0, 0] = torch.tensor([5.0, 5.0, 100.0], dtype=torch.float64)
    kv[0, 1] = NAN
    return kv, torch.tensor([[1, 0]]), torch.tensor([3])


def test_decode_hand_case_causal_and_dqk_ne_dv():
    kv, bt, sl = _hand_cache()
    # token 0: q = [0, 0, 1], sees p0, p1 only (p <= 3 - 2 + 0 = 1): logits 0, ln 3 ->
    #   softmax [1/4, 3/4] -> V = first 2 dims -> 1/4 [1, 0] + 3/4 [0, 1] = [0.25, 0.75];
    #   lse = ln(1 + 3) = ln 4. The future p2 (logit 100) must not contribute.
    # token 1: q = 0 -> uniform over p0, p1, p2 -> ([1,0] + [0,1] + [5,5]) / 3 = [2, 2]; lse = ln 3.
    q = torch.tensor([[[[0.0, 0.0, 1.0]], [[0.0, 0.0, 0.0]]]], dtype=torch.float64)  # [1, 2, 1, 3]
    r = dense_mla_decode(q, kv, bt, sl, 2, 1.0, d_v=2)
    assert r.out.shape == (1, 2, 1, 2)
    assert torch.allclose(r.out[0, 0, 0], torch.tensor([0.25, 0.75], dtype=torch.float64), rtol=0, atol=1e-15)
    assert torch.allclose(r.out[0, 1, 0], torch.tensor([2.0, 2.0], dtype=torch.float64), rtol=0, atol=1e-14)
    assert abs(r.lse[0, 0, 0].item() - math.log(4.0)) < 1e-15
    assert abs(r.lse[0, 1, 0].item() - math.log(3.0)) < 1e-15
    assert r.max_logit[0, 0, 0].item() == pytest.approx(math.log(3.0), abs=1e-15)
    assert r.n_valid.tolist() == [[2, 3]]
    # bmm2_scale multiplies the output only; bmm1_scale multiplies the logits: with bmm1 = 2 token 0
    # has logits 0, 2 ln 3 -> weights [1/10, 9/10]
    r2 = dense_mla_decode(q, kv, bt, sl, 2, 2.0, d_v=2, bmm2_scale=3.0)
    assert torch.allclose(r2.out[0, 0, 0], torch.tensor([0.3, 2.7], dtype=torch.float64), rtol=0, atol=1e-14)
    assert abs(r2.lse[0, 0, 0].item() - math.log(10.0)) < 1e-14


def test_decode_non_causal_sees_the_future():
    kv, bt, sl = _hand_cache()
    q = torch.tensor([[[[0.0, 0.0, 1.0]]]], dtype=torch.float64)  # s = 1
    # s = 1: the causal bound L - 1 + 0 = 2 is the whole cache anyway; logit of p2 = 100 dominates:
    # out ~ [5, 5] (weights 1 / (1 + 3 e^-100 + e^-100) on p2)
    r = dense_mla_decode(q, kv, bt, sl, 2, 1.0, d_v=2)
    assert torch.allclose(r.out[0, 0, 0], torch.tensor([5.0, 5.0], dtype=torch.float64), rtol=1e-15, atol=0)
    q2 = torch.tensor([[[[0.0, 0.0, 1.0]], [[0.0, 0.0, 1.0]]]], dtype=torch.float64)
    rc = dense_mla_decode(q2, kv, bt, sl, 2, 1.0, d_v=2, causal=True)
    rn = dense_mla_decode(q2, kv, bt, sl, 2, 1.0, d_v=2, causal=False)
    assert rc.out[0, 0, 0, 0].item() == pytest.approx(0.25, abs=1e-15)
    assert rn.out[0, 0, 0, 0].item() == pytest.approx(5.0, abs=1e-12)


def test_decode_lonely_query_is_exact_zero():
    kv, bt, _ = _hand_cache()
    q = torch.ones(1, 2, 1, 3, dtype=torch.float64)
    # L = 1, s = 2: token 0 has hi = 1 - 2 + 0 = -1 -> lonely: out exactly 0, lse -inf
    r = dense_mla_decode(q, kv, bt, torch.tensor([1]), 2, 1.0, d_v=2)
    assert r.out[0, 0].eq(0).all() and r.lse[0, 0, 0].item() == -math.inf
    assert r.n_valid.tolist() == [[0, 1]]
    # token 1 sees p0 only -> out = p0[:2] = [1, 0]
    assert r.out[0, 1, 0].tolist() == [1.0, 0.0]


def test_decode_fp8_cache_values_taken_exactly():
    # an FP8 cache is decoded exactly: code 0x38 = 1.0 (E=7, m=0), 0x40 = 2.0 (E=8),
    # 0xC0 = -2.0, 0x30 = 0.5 (E=6)
    kv = torch.tensor([[[0x38, 0x40], [0xC0, 0x30]]], dtype=torch.uint8).view(torch.float8_e4m3fn)
    q = torch.tensor([[[[1.0, 0.0]]]], dtype=torch.float64)
    r = dense_mla_decode(q, kv, torch.tensor([[0]]), torch.tensor([2]), 2, 1.0, d_v=1)
    # logits q.k: row0 = 1.0, row1 = -2.0 -> w0 = e / (e + e^-2); V = first dim: 1.0 and -2.0
    w0 = math.exp(1) / (math.exp(1) + math.exp(-2))
    assert r.out[0, 0, 0, 0].item() == pytest.approx(w0 * 1.0 + (1 - w0) * -2.0, abs=1e-15)


def _naive_decode(q, rows, bt, sl, bs, scale, d_v, bmm2):
    b, s, h, d = q.shape
    out = torch.zeros(b, s, h, d_v, dtype=torch.float64)
    lse = torch.full((b, s, h), -math.inf, dtype=torch.float64)
    for bi in range(b):
        L = int(sl[bi])
        for i in range(s):
            hi = L - s + i
            if hi < 0:
                continue
            p = torch.arange(hi + 1)
            slots = bt[bi][p // bs].long() * bs + p % bs
            k = rows[slots]
            logits = scale * (q[bi, i] @ k.T)  # [h, n]
            out[bi, i] = bmm2 * (torch.softmax(logits, -1) @ k[:, :d_v])
            lse[bi, i] = torch.logsumexp(logits, -1)
    return out, lse


@given(seed=st.integers(0, 2**31 - 1), b=st.integers(1, 3), s=st.integers(1, 4), h=st.integers(1, 4),
       bs=st.sampled_from([1, 2, 4]), d_v=st.integers(1, 6))
def test_decode_matches_naive_softmax(seed, b, s, h, bs, d_v):
    g = torch.Generator().manual_seed(seed)
    d = 6
    lens = torch.randint(0, 10, (b,), generator=g)
    m = max(1, int(((lens + bs - 1) // bs).max()))
    nb = b * m + 1
    bt = torch.randperm(nb, generator=g)[: b * m].view(b, m)
    kv = torch.randn(nb, bs, d, generator=g, dtype=torch.float64)
    q = torch.randn(b, s, h, d, generator=g, dtype=torch.float64)
    r = dense_mla_decode(q, kv, bt, lens, bs, 0.7, d_v=d_v, bmm2_scale=1.5)
    out, lse = _naive_decode(q, kv.reshape(-1, d), bt, lens, bs, 0.7, d_v, 1.5)
    assert torch.allclose(r.out, out, rtol=1e-12, atol=1e-14)
    assert torch.equal(torch.isinf(r.lse), torch.isinf(lse))
    fin = torch.isfinite(lse)
    assert torch.allclose(r.lse[fin], lse[fin], rtol=1e-13, atol=1e-14)


def test_nan_past_seq_len_never_leaks():
    kv, bt, sl = _hand_cache()
    assert torch.isnan(kv[0, 1]).all()  # the unreferenced row is poisoned
    q = torch.randn(1, 2, 3, 3, dtype=torch.float64)
    r = dense_mla_decode(q, kv, bt, sl, 2, 0.5, d_v=2)
    assert torch.isfinite(r.out).all() and torch.isfinite(r.lse).all()


def test_decode_input_errors():
    kv, bt, sl = _hand_cache()
    q = torch.zeros(1, 1, 1, 3, dtype=torch.float64)
    with pytest.raises(InputError, match="dense_token_indices: argument 'block_table' must have >= ceil"):
        dense_mla_decode(q, kv, bt[:, :1], sl, 2, 1.0, d_v=2)
    with pytest.raises(InputError, match="argument 'seq_lens' must be >= 0"):
        dense_mla_decode(q, kv, bt, torch.tensor([-1]), 2, 1.0, d_v=2)
    with pytest.raises(InputError, match="entries used by request 0 must lie in"):
        dense_mla_decode(q, kv, torch.tensor([[1, 5]]), sl, 2, 1.0, d_v=2)
    with pytest.raises(InputError, match="dense_mla_decode: argument 'kv_cache' must have rows as wide"):
        dense_mla_decode(torch.zeros(1, 1, 1, 4, dtype=torch.float64), kv, bt, sl, 2, 1.0, d_v=2)
    with pytest.raises(InputError, match="argument 'd_v' must be <= the row width"):
        dense_mla_decode(q, kv, bt, sl, 2, 1.0, d_v=4)
    with pytest.raises(InputError, match="argument 'bmm1_scale' must be finite"):
        dense_mla_decode(q, kv, bt, sl, 2, math.inf, d_v=2)
    with pytest.raises(InputError, match="dense_kv_rows: argument 'kv_cache' must have shape"):
        dense_kv_rows(torch.zeros(2, 3, 3), 2)


# --------------------------------------------------------------------------- prefill


def test_ragged_causal_indices_known_answer():
    # two requests of 2 and 3 tokens (q == kv): request 1 owns key rows 2..4.
    cu = torch.tensor([0, 2, 5])
    idx, ln = ragged_causal_indices(cu, cu)
    assert ln.tolist() == [1, 2, 1, 2, 3]
    assert idx.tolist() == [[0, -1, -1], [0, 1, -1], [2, -1, -1], [2, 3, -1], [2, 3, 4]]
    # bottom-right alignment when q is shorter than kv: 1 query over 3 keys sees all 3
    idx, ln = ragged_causal_indices(torch.tensor([0, 1]), torch.tensor([0, 3]))
    assert ln.tolist() == [3] and idx.tolist() == [[0, 1, 2]]


def test_prefill_hand_case_and_gqa():
    # one request of 2 tokens, H = 2 query heads sharing one KV head (H_k = 1), d_qk 2, d_v 1.
    # k0 = [0, 0], k1 = [ln 2, 0]; v0 = 10, v1 = 40.
    # token 0 sees only key 0 -> out 10 for both heads.
    # token 1, head 0: q = [1, 0] -> logits 0, ln 2 -> weights 1/3, 2/3 -> 10/3 + 80/3 = 30;
    # token 1, head 1: q = [0, 0] -> uniform -> 25.
    q = torch.tensor([[[1.0, 0.0], [0.0, 0.0]], [[1.0, 0.0], [0.0, 0.0]]], dtype=torch.float64)
    k = torch.tensor([[[0.0, 0.0]], [[math.log(2.0), 0.0]]], dtype=torch.float64)
    v = torch.tensor([[[10.0]], [[40.0]]], dtype=torch.float64)
    cu = torch.tensor([0, 2])
    r = dense_mha_prefill(q, k, v, cu, cu, 1.0)
    assert r.out.shape == (2, 2, 1)
    assert r.out[0].flatten().tolist() == [10.0, 10.0]
    assert r.out[1, 0, 0].item() == pytest.approx(30.0, abs=1e-13)
    assert r.out[1, 1, 0].item() == pytest.approx(25.0, abs=1e-13)
    assert r.lse[1, 0].item() == pytest.approx(math.log(3.0), abs=1e-15)


@given(seed=st.integers(0, 2**31 - 1), lens=st.lists(st.integers(1, 6), min_size=1, max_size=3),
       hk=st.sampled_from([1, 2]), group=st.sampled_from([1, 2]))
def test_prefill_matches_naive_causal_mha(seed, lens, hk, group):
    g = torch.Generator().manual_seed(seed)
    h, dqk, dv = hk * group, 5, 3
    t = sum(lens)
    q = torch.randn(t, h, dqk, generator=g, dtype=torch.float64)
    k = torch.randn(t, hk, dqk, generator=g, dtype=torch.float64)
    v = torch.randn(t, hk, dv, generator=g, dtype=torch.float64)
    cu = torch.tensor([0] + torch.cumsum(torch.tensor(lens), 0).tolist())
    r = dense_mha_prefill(q, k, v, cu, cu, 0.6)
    for ri in range(len(lens)):
        a, e = int(cu[ri]), int(cu[ri + 1])
        for i in range(e - a):
            for hh in range(h):
                kk, vv = k[a:a + i + 1, hh // group], v[a:a + i + 1, hh // group]
                w = torch.softmax(0.6 * (kk @ q[a + i, hh]), 0)
                assert torch.allclose(r.out[a + i, hh], w @ vv, rtol=1e-12, atol=1e-14)


def test_prefill_input_errors():
    q = torch.zeros(2, 2, 4, dtype=torch.float64)
    k = torch.zeros(2, 1, 4, dtype=torch.float64)
    v = torch.zeros(2, 1, 3, dtype=torch.float64)
    cu = torch.tensor([0, 2])
    with pytest.raises(InputError, match="dense_mha_prefill: argument 'k' must have q's head dim"):
        dense_mha_prefill(q, k[..., :3], v, cu, cu, 1.0)
    v2 = v.clone()
    v2[0, 0, 0] = math.inf
    with pytest.raises(InputError, match="argument 'v' must be finite"):
        dense_mha_prefill(q, k, v2, cu, cu, 1.0)
    with pytest.raises(InputError, match="ragged_causal_indices: argument 'cu_seqlens_q' must start at 0"):
        dense_mha_prefill(q, k, v, torch.tensor([1, 2]), cu, 1.0)
