"""The Triton kernels of ``fast_fused`` (imported only by ``fast_fused.kernels()``, never at the
fast oracle's import: this module imports Triton). What they compute, and the bound for their
order: ``fast_fused``'s docstring."""
from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

__all__ = ["logits_kernel", "pv_kernel", "finish_kernel", "nanmax", "nanmax_all", "bf16_bits", "bf16_bits_to_f32",
           "row_tests", "slot_stats_init", "slot_stats_add", "slot_stats_done"]


@triton.jit
def bf16_bits(x):
    """The 16 bits of bfloat16 ``x`` as int32 (``0 .. 0xFFFF``)."""
    return x.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF


@triton.jit
def bf16_bits_to_f32(b):
    """The float32 value of bfloat16 bits ``b`` (int32, low 16 bits): the bits shifted into a float32
    (exact for every value, subnormals included; Triton's CPU interpreter converts bfloat16
    subnormals wrongly, the compiled conversion does not)."""
    return (b << 16).to(tl.float32, bitcast=True)


@triton.jit
def nanmax(a, b):
    """Elementwise max that propagates NaN, as ``torch.amax`` does (``tl.maximum`` may drop it): a
    NaN statistic must reach ``fast._row_tests``, which then sends the token's rows to the ordered path."""
    return tl.where((a != a) | (b != b), float("nan"), tl.maximum(a, b))


@triton.jit
def nanmax_all(a):
    """``max`` over a 1-D block, NaN if any element is NaN."""
    nan = tl.sum((a != a).to(tl.int32), axis=0) > 0
    return tl.where(nan, float("nan"), tl.max(a, axis=0))


@triton.jit
def slot_stats_init(ST, BK: tl.constexpr):
    """The running maxima of a token's slots' three statistics (``fast_rows.row_stats``: norm,
    ``log2 n - lsb``, ``max |x_j|``) over blocks of ``BK`` slots, each ``-inf``, in the dtype of
    the statistics ``ST``."""
    e = tl.full([BK], float("-inf"), ST.dtype.element_ty)
    return e, e, e


@triton.jit
def slot_stats_add(sn, sb, sv, ST, R, g, km):
    """``slot_stats_init``'s maxima with a block of slots added: the statistics ``ST`` ``[3, R]`` at
    rows ``g`` (``km``: the block's mask), NaN-propagating (``nanmax``)."""
    sn = nanmax(sn, tl.load(ST + g, mask=km, other=float("-inf")))
    sb = nanmax(sb, tl.load(ST + R + g, mask=km, other=float("-inf")))
    sv = nanmax(sv, tl.load(ST + 2 * R + g, mask=km, other=float("-inf")))
    return sn, sb, sv


@triton.jit
def slot_stats_done(sn, sb, sv, KS, t, T, first):
    """The token's maxima ``(nk, bk)`` of the slots' norm and ``log2 n - lsb`` (the inputs of
    ``row_tests``); where ``first`` (the token's first block of heads) all three also stored at
    ``KS[i, t]``, ``KS`` ``[3, T]``."""
    nk = nanmax_all(sn)
    bk = nanmax_all(sb)
    if first:
        tl.store(KS + t, nk)
        tl.store(KS + T + t, bk)
        tl.store(KS + 2 * T + t, nanmax_all(sv))
    return nk, bk


@triton.jit
def row_tests(stats, R, qrow, hm, nk, bk, LIM, X, BOTH, o, TH, HV, COUNT: tl.constexpr):
    """``fast._row_tests`` for a block of heads, in the statistics' dtype, stored at ``o``: exact =
    alpha + beta < exact_bits, fast = n_q max n_k < (exact ? le : la) (False where NaN), x = exact ?
    0 : n_q max n_k. ``stats`` ``[3, R]``, ``qrow`` the heads' q rows of the table (``hm`` their
    mask), ``nk`` / ``bk`` the token's maxima of the slots' norm and ``log2 n - lsb``, ``LIM`` ``(la,
    le, 0, exact_bits)``, ``BOTH`` ``[2, TH]`` (exact, fast). ``COUNT``: also add the block's counts
    of exact and of fast rows to the int64 ``HV[0]`` and ``HV[1]`` (integer atomics: the totals do
    not depend on the order)."""
    nq = tl.load(stats + qrow, mask=hm, other=0.0)
    aq = tl.load(stats + R + qrow, mask=hm, other=0.0)
    nqb = nq * nk
    exact = (aq + bk) < tl.load(LIM + 3)
    fast = nqb < tl.where(exact, tl.load(LIM + 1), tl.load(LIM))
    tl.store(X + o, tl.where(exact, 0.0, nqb).to(X.dtype.element_ty), mask=hm)
    tl.store(BOTH + o, exact.to(tl.uint8), mask=hm)
    tl.store(BOTH + TH + o, fast.to(tl.uint8), mask=hm)
    if COUNT:
        tl.atomic_add(HV, tl.sum((exact & hm).to(tl.int64), axis=0))
        tl.atomic_add(HV + 1, tl.sum((fast & hm).to(tl.int64), axis=0))


@triton.jit
def logits_kernel(tab, gidx, stats, S, M, KS, LIM, X, BOTH, q0, zrow, FC, T, H, K, D, R,
                  HAS_STATS: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr):
    t = tl.program_id(0)
    hb = tl.program_id(1)
    hh = hb * BH + tl.arange(0, BH)
    hm = hh < H
    dd = tl.arange(0, BD)
    qrow = (q0 + t * H + hh).to(tl.int64)
    m = tl.full([BH], float("-inf"), tl.float64)
    scale = tl.load(FC)  # float64 (a Python float argument would reach the kernel as float32)
    if HAS_STATS:
        sn, sb, sv = slot_stats_init(stats, BK)
    for k0 in range(0, K, BK):
        kk = k0 + tl.arange(0, BK)
        km = kk < K
        g = tl.load(gidx + t.to(tl.int64) * K + kk, mask=km, other=zrow)
        acc = tl.zeros([BH, BK], dtype=tl.float64)
        for d0 in range(0, D, BD):
            dm = (d0 + dd) < D
            qt = tl.load(tab + qrow[:, None] * D + (d0 + dd)[None, :], mask=hm[:, None] & dm[None, :],
                         other=0.0)
            kt = tl.load(tab + g[None, :] * D + (d0 + dd)[:, None], mask=dm[:, None] & km[None, :],
                         other=0.0)
            acc = tl.dot(qt, kt, acc, out_dtype=tl.float64)
        s = acc * scale
        s = tl.where(((g != zrow) & km)[None, :], s, float("-inf"))
        tl.store(S + (t.to(tl.int64) * H + hh)[:, None] * K + kk[None, :], s, mask=hm[:, None] & km[None, :])
        m = tl.maximum(m, tl.max(s, axis=1))
        if HAS_STATS:
            sn, sb, sv = slot_stats_add(sn, sb, sv, stats, R, g, km)
    m = tl.where(m == 0.0, 0.0, m)  # -0 -> +0, as the ordered oracle's max
    tl.store(M + t * H + hh, m, mask=hm)
    if HAS_STATS:
        nk, bk = slot_stats_done(sn, sb, sv, KS, t, T, hb == 0)
        row_tests(stats, R, qrow, hm, nk, bk, LIM, X, BOTH, t * H + hh, T * H, X, False)


@triton.jit
def pv_kernel(tab, tab16, gidx, S, M, N, L, NA, zrow, FC, H, K, D, DV,
              WANT_ABS: tl.constexpr, ABS_BF16: tl.constexpr, INTERP: tl.constexpr,
              BH: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    t = tl.program_id(0)
    hb = tl.program_id(1)
    vb = tl.program_id(2)
    hh = hb * BH + tl.arange(0, BH)
    hm = hh < H
    vv = vb * BV + tl.arange(0, BV)
    vm = vv < DV
    m = tl.load(M + t * H + hh, mask=hm, other=0.0)
    m = tl.where(m == float("-inf"), 0.0, m)  # lonely rows: every logit -inf, p = 0
    acc = tl.zeros([BH, BV], dtype=tl.float64)
    lsum = tl.zeros([BH], dtype=tl.float64)
    if WANT_ABS:
        if ABS_BF16:
            acca = tl.zeros([BH, BV], dtype=tl.float32)
        else:
            acca = tl.zeros([BH, BV], dtype=tl.float64)
    for k0 in range(0, K, BK):
        kk = k0 + tl.arange(0, BK)
        km = kk < K
        s = tl.load(S + (t.to(tl.int64) * H + hh)[:, None] * K + kk[None, :], mask=hm[:, None] & km[None, :],
                    other=float("-inf"))
        if INTERP:  # Triton's CPU interpreter: NumPy's float64 exp
            p = tl.exp(s - m[:, None])
        else:  # libdevice's float64 exp (__nv_exp), torch's CUDA exp for float64
            p = libdevice.exp(s - m[:, None])
        lsum += tl.sum(p, axis=1)
        g = tl.load(gidx + t.to(tl.int64) * K + kk, mask=km, other=zrow)
        v = tl.load(tab + g[:, None] * D + vv[None, :], mask=km[:, None] & vm[None, :], other=0.0)
        acc = tl.dot(p, v, acc, out_dtype=tl.float64)
        if WANT_ABS:
            if ABS_BF16:
                pb = p.to(tl.float32).to(tl.bfloat16)
                if INTERP:  # the interpreter's bfloat16 dot reads the bits as integers: the same
                    # products (exact in float32) accumulated in float32
                    v16 = tl.load(tab16 + g[:, None] * D + vv[None, :], mask=km[:, None] & vm[None, :], other=0.0)
                    acca = tl.dot(pb.to(tl.float32), tl.abs(v16.to(tl.float32)), acca, input_precision="ieee")
                else:  # |v| straight from the bfloat16 table's row (exact)
                    v16 = tl.load(tab16 + g[:, None] * D + vv[None, :], mask=km[:, None] & vm[None, :], other=0.0)
                    acca = tl.dot(pb, tl.abs(v16), acca)
            else:
                acca = tl.dot(p, tl.abs(v), acca, out_dtype=tl.float64)
    o = (t.to(tl.int64) * H + hh)[:, None] * DV + vv[None, :]
    tl.store(N + o, acc, mask=hm[:, None] & vm[None, :])
    if WANT_ABS:
        if ABS_BF16:
            tl.store(NA + o, acca.to(tl.float64) * tl.load(FC + 1), mask=hm[:, None] & vm[None, :])
        else:
            tl.store(NA + o, acca, mask=hm[:, None] & vm[None, :])
    if vb == 0:
        tl.store(L + t * H + hh, lsum, mask=hm)


@triton.jit(do_not_specialize=["T"])
def finish_kernel(N, NA, PV, FC, M, L, X, VK, NV, SINK, COEF, RES, T, H, DV,
                  HAS_SINK: tl.constexpr, WANT_ABS: tl.constexpr, NA_BF16: tl.constexpr, INTERP: tl.constexpr,
                  BH: tl.constexpr, BV: tl.constexpr):
    """``fast._finish`` for one token's block of heads: steps 4-7, the bounds (``B = cb + cs |sink|
    + cl ln L + ce |lse| + cx x``, NaN and +inf set to 0, -inf to the most negative float64, as
    ``nan_to_num_`` does) and ``N`` (and ``Na``) divided in place by ``L`` or ``L + L e`` (1 on
    lonely rows). ``RES`` ``[6, T, H]``: ``lse``, ``lse_with_sink`` and the bounds of ``lse``,
    ``lse_with_sink``, ``max_logits`` and ``out / V_j`` times ``V_j``. ``NA_BF16``: ``NA`` is the
    bfloat16 ``bmm`` of ``bf16(p)`` and ``|V|``; ``PV`` gets ``float64(NA) * FC[1]``
    (``bf16_abs_factor``) divided as ``N`` (the PyTorch path's two roundings, in its order), else
    ``NA`` is float64 and divided in place."""
    t = tl.program_id(0)
    hb = tl.program_id(1)
    hh = hb * BH + tl.arange(0, BH)
    hm = hh < H
    o = t * H + hh
    m = tl.load(M + o, mask=hm, other=0.0)
    lsum = tl.load(L + o, mask=hm, other=1.0)
    x = tl.load(X + o, mask=hm, other=0.0).to(tl.float64)
    vk = tl.load(VK + t).to(tl.float64)
    lonely = tl.load(NV + t) == 0
    if INTERP:
        lnl = tl.log(lsum)
    else:
        lnl = libdevice.log(lsum)
    lse = m + lnl
    if HAS_SINK:
        sk = tl.load(SINK + hh, mask=hm, other=0.0).to(tl.float64)
        if INTERP:
            e = tl.exp(sk - lse)
        else:
            e = libdevice.exp(sk - lse)
        den = tl.where(lonely, 1.0, lsum + lsum * e)
        d = lse - sk
        both_inf = (tl.abs(lse) == float("inf")) & (lse == sk)
        mx = tl.where(lse > sk, lse, sk)
        if INTERP:
            lp = tl.log(1.0 + tl.exp(-tl.abs(d)))
        else:
            lp = libdevice.log1p(libdevice.exp(-tl.abs(d)))
        lws = tl.where(both_inf, lse, mx + lp)
        lws = tl.where((lse != lse) | (sk != sk), float("nan"), lws)
        ska = tl.where(tl.abs(sk) == float("inf"), 0.0, tl.abs(sk))
    else:
        den = tl.where(lonely, 1.0, lsum)
        lws = lse
        ska = tl.zeros([BH], dtype=tl.float64)
    alse = tl.abs(lse)
    for j in tl.static_range(4):
        b = tl.load(COEF + 16 + j) + tl.load(COEF + 12 + j) * ska
        b = b + tl.load(COEF + 4 + j) * lnl
        b = b + tl.load(COEF + 8 + j) * alse
        b = b + tl.load(COEF + j) * x
        b = tl.where((b != b) | (b == float("inf")), 0.0, b)
        b = tl.where(b == float("-inf"), -1.7976931348623157e308, b)
        if j == 3:
            b = b * vk
        tl.store(RES + (2 + j) * T * H + o, b, mask=hm)
    tl.store(RES + o, lse, mask=hm)
    tl.store(RES + T * H + o, lws, mask=hm)
    for v0 in range(0, DV, BV):
        vv = v0 + tl.arange(0, BV)
        msk = hm[:, None] & (vv < DV)[None, :]
        p = (t.to(tl.int64) * H + hh)[:, None] * DV + vv[None, :]
        tl.store(N + p, tl.load(N + p, mask=msk, other=0.0) / den[:, None], mask=msk)
        if WANT_ABS:
            if NA_BF16:
                na16 = bf16_bits(tl.load(NA + p, mask=msk, other=0.0))
                na = bf16_bits_to_f32(na16).to(tl.float64) * tl.load(FC + 1)
                tl.store(PV + p, na / den[:, None], mask=msk)
            else:
                tl.store(NA + p, tl.load(NA + p, mask=msk, other=0.0) / den[:, None], mask=msk)
