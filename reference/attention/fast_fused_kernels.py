"""The Triton kernels of ``fast_fused`` (imported only by ``fast_fused.kernels()``, never at the
fast oracle's import: this module imports Triton). What they compute, and the bound for their
order: ``fast_fused``'s docstring."""
from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

__all__ = ["logits_kernel", "pv_kernel"]


@triton.jit
def _nanmax(a, b):
    """Elementwise max that propagates NaN, as ``torch.amax`` does (``tl.maximum`` may drop it): a
    NaN statistic must reach ``fast._row_tests``, which then sends the token's rows to the ordered path."""
    return tl.where((a != a) | (b != b), float("nan"), tl.maximum(a, b))


@triton.jit
def _nanmax_all(a):
    """``max`` over a 1-D block, NaN if any element is NaN."""
    nan = tl.sum((a != a).to(tl.int32), axis=0) > 0
    return tl.where(nan, float("nan"), tl.max(a, axis=0))


@triton.jit
def logits_kernel(tab, gidx, stats, S, M, KS, q0, zrow, scale, T, H, K, D, R,
                  HAS_STATS: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr):
    t = tl.program_id(0)
    hb = tl.program_id(1)
    hh = hb * BH + tl.arange(0, BH)
    hm = hh < H
    dd = tl.arange(0, BD)
    qrow = (q0 + t * H + hh).to(tl.int64)
    m = tl.full([BH], float("-inf"), tl.float64)
    if HAS_STATS:
        sn = tl.full([BK], float("-inf"), stats.dtype.element_ty)
        sb = tl.full([BK], float("-inf"), stats.dtype.element_ty)
        sv = tl.full([BK], float("-inf"), stats.dtype.element_ty)
    for k0 in range(0, K, BK):
        kk = k0 + tl.arange(0, BK)
        km = kk < K
        g = tl.load(gidx + t.to(tl.int64) * K + kk, mask=km, other=zrow)
        acc = tl.zeros([BH, BK], dtype=tl.float64)
        for d0 in range(0, D, BD):
            dm = (d0 + dd) < D
            qt = tl.load(tab + qrow[:, None] * D + (d0 + dd)[None, :], mask=hm[:, None] & dm[None, :],
                         other=0.0).to(tl.float64)
            kt = tl.load(tab + g[None, :] * D + (d0 + dd)[:, None], mask=dm[:, None] & km[None, :],
                         other=0.0).to(tl.float64)
            acc = tl.dot(qt, kt, acc, out_dtype=tl.float64)
        s = acc * scale
        s = tl.where(((g != zrow) & km)[None, :], s, float("-inf"))
        tl.store(S + (t.to(tl.int64) * H + hh)[:, None] * K + kk[None, :], s, mask=hm[:, None] & km[None, :])
        m = tl.maximum(m, tl.max(s, axis=1))
        if HAS_STATS:
            sn = _nanmax(sn, tl.load(stats + g, mask=km, other=float("-inf")))
            sb = _nanmax(sb, tl.load(stats + R + g, mask=km, other=float("-inf")))
            sv = _nanmax(sv, tl.load(stats + 2 * R + g, mask=km, other=float("-inf")))
    m = tl.where(m == 0.0, 0.0, m)  # -0 -> +0, as the ordered oracle's max
    tl.store(M + t * H + hh, m, mask=hm)
    if HAS_STATS:
        if hb == 0:
            tl.store(KS + t, _nanmax_all(sn))
            tl.store(KS + T + t, _nanmax_all(sb))
            tl.store(KS + 2 * T + t, _nanmax_all(sv))


@triton.jit
def pv_kernel(tab, gidx, S, M, N, L, NA, zrow, abs_factor, H, K, D, DV,
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
        vraw = tl.load(tab + g[:, None] * D + vv[None, :], mask=km[:, None] & vm[None, :], other=0.0)
        v = vraw.to(tl.float64)
        acc = tl.dot(p, v, acc, out_dtype=tl.float64)
        if WANT_ABS:
            if ABS_BF16:
                pb = p.to(tl.float32).to(tl.bfloat16)
                if INTERP:  # the interpreter's bfloat16 dot reads the bits as integers: the same
                    # products (exact in float32) accumulated in float32
                    acca = tl.dot(pb.to(tl.float32), tl.abs(vraw.to(tl.float32)), acca, input_precision="ieee")
                else:
                    acca = tl.dot(pb, tl.abs(vraw), acca)
            else:
                acca = tl.dot(p, tl.abs(v), acca, out_dtype=tl.float64)
    o = (t.to(tl.int64) * H + hh)[:, None] * DV + vv[None, :]
    tl.store(N + o, acc, mask=hm[:, None] & vm[None, :])
    if WANT_ABS:
        if ABS_BF16:
            tl.store(NA + o, acca.to(tl.float64) * abs_factor, mask=hm[:, None] & vm[None, :])
        else:
            tl.store(NA + o, acca, mask=hm[:, None] & vm[None, :])
    if vb == 0:
        tl.store(L + t * H + hh, lsum, mask=hm)
