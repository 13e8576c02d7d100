"""The Triton kernels of ``fast_passes`` (imported only by ``fast_passes.kernels()``, never at the
fast oracle's import: this module imports Triton). What they compute and why the fast oracle's bound
holds for them: ``fast_passes``' docstring.

Arguments that change with every call's shape -- row counts, the table row of the chunk's first q
row, the chunk's token count -- are not specialised (``do_not_specialize``): Triton otherwise
compiles a variant of a kernel for each divisibility class of each such integer, and a fuzz at
production shapes, whose every example has new counts, recompiled the softmax kernel three times
in 30 examples (1.1 s, a third of the run). The head count, slot count and row width stay
specialised: they set the rows' alignment, hence vectorised loads."""
from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

from . import fast_rows
from .fast_fused_kernels import (bf16_bits, bf16_bits_to_f32, row_tests, slot_stats_add, slot_stats_done,
                                 slot_stats_init)

__all__ = ["row_stats_bf16_kernel", "gather_kernel", "gather_stats_kernel", "softmax_kernel", "layout_kernel",
           "layout_gather_kernel"]

NO_LSB_BF16 = tl.constexpr(fast_rows.NO_LSB_BF16)  # the lsb exponent of a zero value ("none")


@triton.jit
def _f32_to_bf16_rne(x):
    """bfloat16 of finite, non-NaN float32 ``x``, rounded to nearest even from the bits (what the
    compiled conversion does; Triton's CPU interpreter truncates)."""
    b = x.to(tl.int32, bitcast=True)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _bf16_stats_init(BR: tl.constexpr):
    """Empty accumulators of ``_bf16_stats_add`` for ``BR`` rows."""
    return (tl.zeros([BR], dtype=tl.float64), tl.full([BR], -NO_LSB_BF16, dtype=tl.int32),
            tl.zeros([BR], dtype=tl.float32), tl.zeros([BR], dtype=tl.int32))


@triton.jit
def _bf16_stats_add(ss, neg, vmax, nans, x, msk, dd, DV):
    """One block of bfloat16 rows ``x`` ``[BR, BD]`` (``msk``: the elements that exist, ``dd``: their
    dims) added to ``fast_rows.row_stats``' accumulators per row -- the squares' float64 sum, the
    largest -lsb, ``max |x_j|`` over ``j < DV``, the count of NaN among those: ``(x as float32, ss,
    neg, vmax, nans)``. The squares are exact in float64 (16 significant bits); the lsb comes from
    the 16 bits exactly."""
    bits = bf16_bits(x)
    xf = bf16_bits_to_f32(bits)
    x64 = xf.to(tl.float64)
    ss += tl.sum(x64 * x64, axis=1)
    b = bits & 0x7FFF
    ef = b >> 7
    sig = tl.where(ef > 0, (b & 0x7F) | 0x80, b)
    low = sig & (-sig)  # the least significant set bit, a power of two <= 2**7 (0 for a zero)
    e = ((low.to(tl.float32).to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127  # log2(low), exact
    nl = tl.where(sig == 0, -NO_LSB_BF16, 134 - e - tl.maximum(ef, 1))  # -lsb
    neg = tl.maximum(neg, tl.max(tl.where(msk, nl, -NO_LSB_BF16), axis=1))
    a = tl.abs(xf)
    vm = msk & (dd < DV)[None, :]
    nans += tl.sum((vm & (a != a)).to(tl.int32), axis=1)
    vmax = tl.maximum(vmax, tl.max(tl.where(vm, a, 0.0), axis=1))
    return xf, ss, neg, vmax, nans


@triton.jit
def _bf16_stats_store(ST, R, r, rm, ss, neg, vmax, nans, floor, INTERP: tl.constexpr):
    """``fast_rows.row_stats``' three values of rows ``r`` (``rm``: those that exist) into ``ST``
    ``[3, R]`` float32 from ``_bf16_stats_add``'s accumulators: the float64 sum rounded once to
    float32, ``sqrt_rn`` and ``+ floor`` (one rounding each); ``log2 n + (-lsb)`` evaluated in
    float64 (libdevice's ``log2``), rounded once; ``max |x_j|`` (NaN if one of those is NaN)."""
    n = tl.sqrt_rn(ss.to(tl.float32)) + floor
    if INTERP:
        lg = tl.log2(n.to(tl.float64))
    else:
        lg = libdevice.log2(n.to(tl.float64))
    beta = (lg + neg.to(tl.float64)).to(tl.float32)
    vmax = tl.where(nans > 0, float("nan"), vmax)
    tl.store(ST + r, n, mask=rm)
    tl.store(ST + R + r, beta, mask=rm)
    tl.store(ST + 2 * R + r, vmax, mask=rm)


@triton.jit(do_not_specialize=["N"])
def row_stats_bf16_kernel(X, ST, N, D, DV, floor, INTERP: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr):
    """``fast_rows.row_stats`` of ``BR`` rows of a bfloat16 table ``X`` ``[N, D]`` into ``ST`` ``[3,
    N]`` float32 (``_bf16_stats_add``, ``_bf16_stats_store``; NaN for ``max |x_j|`` if any of those is
    NaN, as ``torch.linalg.vector_norm`` gives)."""
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    rm = r < N
    ss, neg, vmax, nans = _bf16_stats_init(BR)
    for d0 in range(0, D, BD):
        dd = d0 + tl.arange(0, BD)
        msk = rm[:, None] & (dd < D)[None, :]
        x = tl.load(X + r[:, None].to(tl.int64) * D + dd[None, :], mask=msk, other=0.0)
        _, ss, neg, vmax, nans = _bf16_stats_add(ss, neg, vmax, nans, x, msk, dd, DV)
    _bf16_stats_store(ST, N, r, rm, ss, neg, vmax, nans, floor, INTERP)


@triton.jit
def _gather_stats_rows(A, s0, N0, B, s1, N1, r, i, im, G, GA, ST, S, D, DV, floor, TWO: tl.constexpr,
                       SCRUB: tl.constexpr, WANT_ABS: tl.constexpr, INTERP: tl.constexpr, BR: tl.constexpr,
                       BD: tl.constexpr):
    """``gather_stats_kernel``'s work for the ``BR`` slots ``i`` (``im``: those that exist) whose
    table rows are ``r`` (int64): each row read from ``A`` / ``B`` (the zero row, or any other ``r``,
    reads zeros), written to ``G[i]`` as float64, with ``WANT_ABS`` ``|row[:DV]|`` to ``GA[i]``, and
    its statistics to ``ST[:, i]``."""
    in_a = im & (r >= 0) & (r < N0)
    if TWO:
        in_b = im & (r >= N0) & (r < N0 + N1)
    dst = i.to(tl.int64)
    ss, neg, vmax, nans = _bf16_stats_init(BR)
    for d0 in range(0, D, BD):
        dd = d0 + tl.arange(0, BD)
        dm = (dd < D)[None, :]
        msk = im[:, None] & dm
        x = tl.load(A + r[:, None] * s0 + dd[None, :], mask=in_a[:, None] & dm, other=0.0)
        if TWO:
            x = tl.where(in_b[:, None], tl.load(B + (r - N0)[:, None] * s1 + dd[None, :], mask=in_b[:, None] & dm,
                                                other=0.0), x)
        if SCRUB:  # NaN from the bits (a bfloat16 comparison is not one under the CPU interpreter)
            x = tl.where((bf16_bits(x) & 0x7FFF) > 0x7F80, tl.zeros_like(x), x)
        xf, ss, neg, vmax, nans = _bf16_stats_add(ss, neg, vmax, nans, x, msk, dd, DV)
        tl.store(G + dst[:, None] * D + dd[None, :], xf.to(tl.float64), mask=msk)
        if WANT_ABS:
            xa = (bf16_bits(x) & 0x7FFF).to(tl.int16).to(tl.bfloat16, bitcast=True)
            tl.store(GA + dst[:, None] * DV + dd[None, :], xa, mask=msk & (dd < DV)[None, :])
    _bf16_stats_store(ST, S, i, im, ss, neg, vmax, nans, floor, INTERP)


@triton.jit(do_not_specialize=["S", "N0", "N1", "s0", "s1", "zrow"])
def gather_stats_kernel(A, s0, N0, B, s1, N1, IDX, G, GA, ST, S, D, DV, zrow, floor, IDENT: tl.constexpr,
                        TWO: tl.constexpr, SCRUB: tl.constexpr, WANT_ABS: tl.constexpr, INTERP: tl.constexpr,
                        BR: tl.constexpr, BD: tl.constexpr):
    """``gather_kernel`` and ``row_stats_bf16_kernel`` in one pass, from the segments' own bfloat16
    rows instead of a table: slot ``i`` reads the table row ``r = IDX[i]`` (``IDENT``: ``r = i``) of
    the table the segments would form -- ``A`` ``[N0, D]`` (row stride ``s0``), then with ``TWO``
    ``B`` ``[N1, D]`` (row stride ``s1``), then the zero row ``zrow`` (any other ``r`` reads zeros
    too) -- and writes ``G[i]`` as float64 (exact), with ``WANT_ABS`` ``GA[i] = |row[:DV]|`` in
    bfloat16, and the row's statistics ``ST[:, i]`` (``[3, S]`` float32, ``fast_rows.row_stats``).
    ``SCRUB``: NaN read from ``A`` / ``B`` is read as 0 (``NanPolicy.SCRUB``; the table path scrubs its
    segment rows the same way)."""
    i = tl.program_id(0) * BR + tl.arange(0, BR)
    im = i < S
    if IDENT:
        r = i.to(tl.int64)
    else:
        r = tl.load(IDX + i, mask=im, other=0).to(tl.int64)
    _gather_stats_rows(A, s0, N0, B, s1, N1, r, i, im, G, GA, ST, S, D, DV, floor, TWO, SCRUB, WANT_ABS, INTERP, BR,
                       BD)


@triton.jit(do_not_specialize=["S"])
def gather_kernel(TAB, IDX, G, GA, S, D, DV, IS_BF16: tl.constexpr, WANT_ABS: tl.constexpr, BR: tl.constexpr,
                  BD: tl.constexpr):
    """``G[i] = float64(TAB[IDX[i]])`` for ``BR`` slots (exact), and with ``WANT_ABS`` ``GA[i] =
    |TAB[IDX[i], :DV]|`` in the table's dtype (``IS_BF16``: converted and made positive from the
    bits)."""
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    rm = r < S
    src = tl.load(IDX + r, mask=rm, other=0).to(tl.int64)
    dst = r.to(tl.int64)
    for d0 in range(0, D, BD):
        dd = d0 + tl.arange(0, BD)
        msk = rm[:, None] & (dd < D)[None, :]
        x = tl.load(TAB + src[:, None] * D + dd[None, :], mask=msk, other=0.0)
        if IS_BF16:
            bits = bf16_bits(x)
            x64 = bf16_bits_to_f32(bits).to(tl.float64)
            xa = (bits & 0x7FFF).to(tl.int16).to(tl.bfloat16, bitcast=True)
        else:
            x64 = x.to(tl.float64)
            xa = tl.abs(x)
        tl.store(G + dst[:, None] * D + dd[None, :], x64, mask=msk)
        if WANT_ABS:
            tl.store(GA + dst[:, None] * DV + dd[None, :], xa, mask=msk & (dd < DV)[None, :])


@triton.jit(do_not_specialize=["R", "q0", "c", "hvo", "RQ"])
def softmax_kernel(S, VALID, M, L, PB, SC, H, K, GIDX, ST, R, LIM, X, KS, BOTH, q0, c, HV, hvo, QST, RQ,
                   WANT_PB: tl.constexpr, TESTS: tl.constexpr, COUNT: tl.constexpr, SLOT_STATS: tl.constexpr,
                   INTERP: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr):
    """Steps 1-3's elementwise part for ``BH`` heads of one token: ``s = fl(scale s) + 0`` on valid
    slots (a ``-0`` turns ``+0``), ``-inf`` on invalid ones; ``m = max s``; ``p = exp(s - m)`` (``m``
    replaced by 0 on a lonely row, whose logits are all ``-inf``: ``p = 0``) written over ``S``;
    ``L = sum p``; with ``WANT_PB`` ``bf16(p)`` (through float32, RNE twice) into ``PB``. Two passes
    over the row (the max is final before any ``exp``), compiled without FMA contraction.

    ``TESTS``: also ``fast._row_tests`` for these heads from the table's statistics ``ST`` ``[3, R]``
    gathered at the slots' table rows ``GIDX`` ``[c, K]`` (their NaN-propagating max per token) and
    q's rows ``q0 + t H + h``: ``X`` ``[c, H]`` (``exact ? 0 : n_q max n_k``, the statistics' dtype),
    ``BOTH`` ``[2, c, H]`` (exact, fast) and, from the first block of heads, ``KS`` ``[3, c]`` (the
    maxima; ``KS[2]`` is the token's ``max |v|``). ``LIM``: ``(la, le, 0, exact_bits)``. ``SLOT_STATS``:
    the statistics are per slot instead, ``ST`` ``[3, R]`` holding the chunk's ``c K`` slots' (slot
    ``t K + k``; ``gather_stats_kernel``), and q's rows' are ``QST`` ``[3, RQ]`` (else ``QST`` is
    ``ST``). ``COUNT`` (with ``TESTS``): the chunk's counts of exact and of fast rows added to the int64 ``HV[hvo]`` and
    ``HV[hvo + 1]``."""
    t = tl.program_id(0).to(tl.int64)
    scale = tl.load(SC)  # float64 (a Python float would arrive as float32)
    hh = tl.program_id(1) * BH + tl.arange(0, BH)
    hm = hh < H
    row = (t * H + hh) * K
    mx = tl.full([BH], float("-inf"), dtype=tl.float64)
    if TESTS:
        sn, sb, sv = slot_stats_init(ST, BK)
    for k0 in range(0, K, BK):
        kk = k0 + tl.arange(0, BK)
        km = kk < K
        ok = tl.load(VALID + t * K + kk, mask=km, other=0) != 0
        s = tl.load(S + row[:, None] + kk[None, :], mask=hm[:, None] & km[None, :], other=0.0)
        s = tl.where(ok[None, :], s * scale + 0.0, float("-inf"))
        mx = tl.maximum(mx, tl.max(s, axis=1))
        if TESTS:
            if SLOT_STATS:
                g = t * K + kk
            else:
                g = tl.load(GIDX + t * K + kk, mask=km, other=0)
            sn, sb, sv = slot_stats_add(sn, sb, sv, ST, R, g, km)
    if TESTS:  # fast._row_tests, in the statistics' dtype
        nk, bk = slot_stats_done(sn, sb, sv, KS, t, c, tl.program_id(1) == 0)
        row_tests(QST, RQ, q0 + t * H + hh, hm, nk, bk, LIM, X, BOTH, t * H + hh, c * H, HV + hvo, COUNT)
    shift = tl.where(mx == float("-inf"), 0.0, mx)
    acc = tl.zeros([BH], dtype=tl.float64)
    for k0 in range(0, K, BK):
        kk = k0 + tl.arange(0, BK)
        km = kk < K
        msk = hm[:, None] & km[None, :]
        ok = tl.load(VALID + t * K + kk, mask=km, other=0) != 0
        s = tl.load(S + row[:, None] + kk[None, :], mask=msk, other=0.0)
        s = tl.where(ok[None, :], s * scale + 0.0, float("-inf"))
        if INTERP:  # Triton's CPU interpreter: NumPy's float64 exp
            p = tl.exp(s - shift[:, None])
        else:  # libdevice's float64 exp (__nv_exp), the function torch's CUDA exp calls
            p = libdevice.exp(s - shift[:, None])
        p = tl.where(km[None, :], p, 0.0)
        acc += tl.sum(p, axis=1)
        tl.store(S + row[:, None] + kk[None, :], p, mask=msk)
        if WANT_PB:
            tl.store(PB + row[:, None] + kk[None, :], _f32_to_bf16_rne(p.to(tl.float32)), mask=msk)
    tl.store(M + t * H + hh, mx, mask=hm)
    tl.store(L + t * H + hh, acc, mask=hm)


@triton.jit
def _slot(IDX, sit, LENS, slt, l0, CC, scc, t, kk, km, zrow):
    """The layout of slots ``kk`` of tokens ``t`` (``km``: those that exist; ``t`` a scalar or one per
    slot): ``(gidx, w, ok)`` -- the table row (``zrow`` for an invalid slot), the range offset and
    validity (``layout_kernel``'s docstring: the arguments and the rule)."""
    idx = tl.load(IDX + t * sit + kk, mask=km, other=0).to(tl.int64)
    pos = tl.load(CC + kk, mask=km, other=0)
    nmax = tl.load(CC + scc + kk, mask=km, other=0)
    off = tl.load(CC + 2 * scc + kk, mask=km, other=0)
    seg = tl.load(CC + 4 * scc + kk, mask=km, other=0)
    lcol = tl.load(LENS + t * slt + l0 + seg, mask=km, other=0).to(tl.int64)
    inp = pos < lcol
    lo = tl.where(idx < 0, idx, 0)
    hi = tl.where(idx > nmax, idx - nmax, 0)
    w = tl.where(inp, lo + hi, -1)
    ok = km & (w == 0)
    return tl.where(ok, idx + off, zrow), w, ok


@triton.jit
def _layout_token(t, IDX, sit, LENS, slt, l0, CC, scc, VALID, GIDX, NV, HV, SINK, K, S, zrow, hv_w, hv_sink, NS,
                  nan_mag, nan_exp, HAS_M1: tl.constexpr, HAS_SINK: tl.constexpr, BK: tl.constexpr, BS: tl.constexpr):
    """``layout_kernel``'s work for token ``t`` (int64)."""
    ss = tl.arange(0, BS)
    sm = ss < S
    lens = tl.load(LENS + t * slt + l0 + ss, mask=sm, other=0).to(tl.int64)
    tl.atomic_min(HV + ss, lens, mask=sm)
    tl.atomic_max(HV + S + ss, lens, mask=sm)
    cnt = tl.zeros([BK], dtype=tl.int32)
    wlo = tl.zeros([BK], dtype=tl.int64)
    whi = tl.zeros([BK], dtype=tl.int64)
    for k0 in range(0, K, BK):
        kk = k0 + tl.arange(0, BK)
        km = kk < K
        gi, w, ok = _slot(IDX, sit, LENS, slt, l0, CC, scc, t, kk, km, zrow)
        tl.store(VALID + t * K + kk, ok.to(tl.uint8), mask=km)
        tl.store(GIDX + t * K + kk, gi, mask=km)
        cnt += ok.to(tl.int32)
        if HAS_M1:
            m1 = km & (tl.load(CC + 3 * scc + kk, mask=km, other=0) != 0)
            wlo = tl.minimum(wlo, tl.where(m1, w, 0))
            whi = tl.maximum(whi, tl.where(m1, w, 0))
    tl.store(NV + t, tl.sum(cnt, axis=0))
    if HAS_M1:
        tl.atomic_min(HV + hv_w, tl.min(wlo, axis=0))
        tl.atomic_max(HV + hv_w + 1, tl.max(whi, axis=0))
    if HAS_SINK:
        if t == 0:
            for h0 in range(0, NS, BK):
                hh = h0 + tl.arange(0, BK)
                b = tl.load(SINK + hh, mask=hh < NS, other=0).to(tl.int64)
                tl.store(HV + hv_sink + hh, ((b & nan_mag) > nan_exp).to(tl.int64), mask=hh < NS)


@triton.jit(do_not_specialize=["sit", "slt", "l0", "scc", "K", "S", "zrow", "hv_w", "hv_sink", "NS", "nan_mag",
                               "nan_exp"])
def layout_kernel(IDX, sit, LENS, slt, l0, CC, scc, VALID, GIDX, NV, HV, SINK, K, S, zrow, hv_w, hv_sink, NS, nan_mag,
                  nan_exp, HAS_M1: tl.constexpr, HAS_SINK: tl.constexpr, BK: tl.constexpr, BS: tl.constexpr):
    """``fast.slot_layout`` and ``fast.layout_flags`` for one token ``t`` (program 0 of axis 0), in one pass
    over its ``K`` slot indices: ``IDX`` ``[T, K]`` (row stride ``sit``), the lengths ``[T, S]`` at
    ``LENS + l0`` (row stride ``slt``, 0 for one length shared by every token; a segment without
    lengths holds its ``K_s``), ``CC`` ``[5, K]`` int64 column constants (row stride ``scc``: the
    position in the segment, the segment's ``N_s - 1``, its first table row, whether it is -1-only,
    its segment number). Writes ``VALID`` ``[T, K]`` (uint8), ``GIDX`` ``[T, K]`` (int64:
    the table row, ``zrow`` for an invalid slot), ``NV`` ``[T]`` (int32 count of valid slots) and,
    by integer atomics (order-free), into the int64 host vector ``HV``: the lengths' minima
    ``HV[0:S]`` and maxima ``HV[S:2S]``, and with ``HAS_M1`` the minimum and maximum of the
    -1-only columns' range offsets at ``HV[hv_w]``, ``HV[hv_w + 1]`` (``HV`` holds the neutral
    values before the launch). A slot is valid iff it lies in its segment's prefix and ``0 <= idx
    <= N_s - 1``; its range offset is ``idx`` below the range, ``idx - (N_s - 1)`` above it, 0 in it
    and -1 outside the prefix (``fast.slot_layout``). ``HAS_SINK``: program 0 also writes, per sink value,
    whether it is NaN (1) or not (0) to ``HV[hv_sink:]``, from its bits (``SINK``: the sink viewed as the
    integer dtype of its width): NaN iff ``bits & nan_mag > nan_exp`` (its magnitude above the
    exponent mask)."""
    _layout_token(tl.program_id(0).to(tl.int64), IDX, sit, LENS, slt, l0, CC, scc, VALID, GIDX, NV, HV, SINK, K, S,
                  zrow, hv_w, hv_sink, NS, nan_mag, nan_exp, HAS_M1, HAS_SINK, BK, BS)


@triton.jit(do_not_specialize=["sit", "slt", "l0", "scc", "K", "S", "zrow", "hv_w", "hv_sink", "NS", "nan_mag",
                               "nan_exp", "T", "nq", "QR", "sq", "N0", "N1", "s0", "s1", "CS"])
def layout_gather_kernel(IDX, sit, LENS, slt, l0, CC, scc, VALID, GIDX, NV, HV, SINK, K, S, zrow, hv_w, hv_sink, NS,
                         nan_mag, nan_exp, T, nq, Q, sq, QR, Q64, QST, A, s0, N0, B, s1, N1, G, GA, GST, CS, D, DV,
                         floor,
                         HAS_M1: tl.constexpr, HAS_SINK: tl.constexpr, TWO: tl.constexpr, SCRUB: tl.constexpr,
                         WANT_ABS: tl.constexpr, INTERP: tl.constexpr, BK: tl.constexpr, BS: tl.constexpr,
                         BR: tl.constexpr, BD: tl.constexpr):
    """``layout_kernel``, q's ``gather_stats_kernel`` and the first chunk's slots' one in one launch:
    programs ``0 .. T - 1`` lay out token ``t`` (``layout_kernel``), the next ``nq`` convert ``BR`` of
    q's ``QR`` rows each (``Q`` ``[QR, D]``, row stride ``sq``, into ``Q64`` and their statistics
    into ``QST``), the rest gather ``BR`` of the ``CS`` slots ``i = t K + k`` each (tokens ``t <
    CS / K``; ``gather_stats_kernel`` from ``A`` and, with ``TWO``, ``B`` into ``G``, ``GA``, ``GST``).
    A gathering program computes its slots' table rows from the indices itself (``_slot``, the
    layout's own rule): no program reads what another writes."""
    pid = tl.program_id(0)
    if pid < T:
        _layout_token(pid.to(tl.int64), IDX, sit, LENS, slt, l0, CC, scc, VALID, GIDX, NV, HV, SINK, K, S, zrow,
                      hv_w, hv_sink, NS, nan_mag, nan_exp, HAS_M1, HAS_SINK, BK, BS)
    elif pid < T + nq:  # (each branch's names are its own: Triton merges a name both branches assign)
        qi = (pid - T).to(tl.int64) * BR + tl.arange(0, BR)
        qm = qi < QR
        _gather_stats_rows(Q, sq, QR, Q, sq, 0, qi, qi, qm, Q64, Q64, QST, QR, D, DV, floor, False, False, False,
                           INTERP, BR, BD)
    else:
        si = (pid - T - nq).to(tl.int64) * BR + tl.arange(0, BR)
        sm = si < CS
        sr, sw, sok = _slot(IDX, sit, LENS, slt, l0, CC, scc, si // K, si % K, sm, zrow)
        _gather_stats_rows(A, s0, N0, B, s1, N1, sr, si, sm, G, GA, GST, CS, D, DV, floor, TWO, SCRUB, WANT_ABS,
                           INTERP, BR, BD)
