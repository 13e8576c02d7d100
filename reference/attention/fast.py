"""The fast judging oracle: the mathematics of ``attention.sparse_attention`` with unordered float64
GEMMs, and an a-priori bound on its distance from the ordered oracle, returned with the result.

``fast_sparse_attention(q, segments, scale, sink=None, d_v=None, nan_policy=..., chunk_tokens=None)
-> FastOracleOut``: the ``OracleOut`` fields (same conventions 1-5 of ``attention.py``: lonely rows
exactly 0 / ``-inf``, +-inf sinks, invalid rows zeroed before any arithmetic, NaN per
``NanPolicy``) plus ``bound``: per output (``out`` ``[T, H, d_v]``; ``lse``, ``lse_with_sink``,
``max_logits`` ``[T, H]``) an elementwise float64 ``B >= 0`` with ``|fast - ordered| <= B`` wherever
the output is finite; non-finite outputs are the same values in both modes (``B`` is finite there
and carries no meaning; 0 on lonely rows and on rows whose ``lse`` is not finite). Not
bit-identical across devices (cuBLAS/BLAS choose the reduction order); the ordered oracle stays
the fixture path. Only ``AttentionMode.EXACT`` is provided.

The bound's derivation, step by step, and its coefficients: ``fast_bound``. The row statistics its
exactness test reads (norms, least-significant-bit exponents, ``max |x|``): ``fast_rows``.

Memory: ``peak_bytes_estimate_fast`` per chunk; ``chunk_tokens=None`` fits ``FAST_BUDGET_BYTES``
(1.5 GiB) on a GPU, and on the CPU keeps one ``[chunk, H, K]`` logit tensor near 8 MiB (speed).
Results do not depend on the chunk size beyond the bound.

Speed (the host spends ~5-20 us per PyTorch operation and ~25-35 us per Triton launch on the
H100/H200 hosts, against ~1.1 ms of GPU work at production decode h64/top-512, batch 128, on this
PyTorch path; ~0.48 ms with the Triton passes of ``fast_passes``, the default on a CUDA device,
which issue about 10 kernels: the layout, its flags, q's rows and the first chunk's slot rows
gathered from the segments with their statistics in one launch, no table): on the PyTorch path ~60
kernels per call (two segments with lengths and a sink: 62 dispatched operations, 60 of them
kernels, plus 32 views), issued so that the GPU has work queued from the first launch (``_issue``:
the table and its row statistics first, the slot layout while the GPU runs them, the deferred
validation after the heavy kernels; on one H100 this took the eager call from 21.2x to 19.6x
FlashMLA at h64, side by side). The validation rules
that need device values (lengths, -1-only indices, a NaN sink) are evaluated on the device and
read with the call's one host sync (``layout_flags``; ``check_common`` then raises the precise error):
the slot layout of several segments starts from one ``cat`` (indices, each slot's length, the
lengths), the -1-only rule is one ``aminmax`` of in-prefix range offsets (``slot_layout``), and the
host vector is one ``cat`` of integers only -- flags, counts and whether each sink value is NaN -- so
it is int64 and exact (a float among them would turn every integer into that float).
Every segment's rows, a zero row and q's rows form one table (``_table``), whose row statistics
are one float32 norm and one bits lookup (``fast_rows.row_stats``, written into one ``[3, N]``
tensor) and whose slot rows are one ``index_select`` per chunk
(gathered as bfloat16, then converted); steps 4-7 and all bounds run once on ``[T, H]`` tensors
(``_finish``: the bounds are three ``addcmul`` on a base that holds the sink term); the host
values travel as that one int64 vector. No ``where`` takes a Python scalar (a cached 0-dim tensor
instead: half the host cost). The one host sync at the end also finds the rare chunks that need
ordered logits (NaN/Inf, extreme magnitudes), which are then recomputed. All kernels up to that
sync are issued by ``_issue`` without reading a device value, so on CUDA a call signature that
comes again replays them as one CUDA graph (``fast_graphs``; ``graph=`` of
``fast_sparse_attention``): the host then issues ~15 operations instead of ~90, and the call
costs about its GPU work. On CUDA a call is first padded to its shape bucket (``fast_buckets``:
invalid padding, the ordered result unchanged bit for bit, the bound that of the padded call), so
calls of nearby shapes -- matrix cases, fuzz draws -- share one graph; a replay writes the caller's
tensors straight into the graph's padded static inputs (``fast_buckets.write_padded``: one copy per
dtype, the stale padding rewritten) instead of building the padded call, reads its host vector
through pinned memory, and finishes on the host while the GPU copies the outputs out of the graph's
buffers (bench, h64 top-512 at batch 128 on 2-H200 hosts: the first call of a new shape in a warm
bucket cost 0.2-0.3 ms more than a replay of a seen shape before, 0.06-0.15 ms after).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from . import fast_buckets, fast_fused, fast_graphs, fast_passes
from .fast_bound import (BF16_ABS_MAX_K, BIG, DELTA_MAX, F_LNL, F_LSE, F_SINK, F_X, delta_coefficient,
                         x_factor, bf16_abs_factor, bf16_abs_gemm, bound_coefficients, exact_bits)
from .fast_rows import BF16_LUT, STAT_BYTES, STAT_PER_ELEM, STAT_PER_ELEM_BF16, row_stats, vmax_finite
from .ordered import Segment, check_common, check_host, scaled_logits
from ..errors import check_enum, check_int, fail
from ..policies import IndexRule, NanPolicy

__all__ = ["FastOracleOut", "fast_sparse_attention", "peak_bytes_estimate_fast", "FAST_BUDGET_BYTES",
           "BOUND_OUTPUTS", "bound_coefficients", "bf16_abs_factor"]

FAST_BUDGET_BYTES = 3 * 2**29  # 1.5 GiB of per-chunk tensors
_CPU_LOGIT_BYTES = 8 * 2**20
BOUND_OUTPUTS = ("out", "lse", "lse_with_sink", "max_logits")


@dataclass(frozen=True)
class FastOracleOut:
    """``OracleOut`` fields (float64, on the device of ``q``) plus ``bound`` (dict of float64
    tensors shaped like ``out``/``lse``/``lse_with_sink``/``max_logits``: ``|fast - ordered|``
    bound, 0 where both are exact or lonely; meaningless at non-finite outputs) and
    ``exact_logits``: the fraction of the ``T * H`` (token, head) rows whose logits are proven
    exact (equal to the ordered oracle's bits; a lonely row, which has none, counts as exact).
    ``pv_abs`` (``want_abs=True`` only, else None): ``[T, H, d_v]`` float64, the output with ``|V|``
    in place of ``V`` and the same weights, ``f * sum_k (p_k / L) |v_k|`` (``f``: the sink factor;
    0 on lonely rows and under a ``+inf`` sink; NaN/Inf where the row reads a non-finite value or
    the sum overflows): an error budget, e.g. the bf16 rounding of ``P`` moves a bf16-P kernel's
    ``out`` by at most ``2**-8 pv_abs``. From a bfloat16 table it is an upper bound of that value
    within ``bf16_abs_factor(K)`` (1.2%; one bfloat16 GEMM), from other tables within the ``out``
    bound of it (the bound's steps 5-6 hold for ``|V|`` as for ``V``: same weights, same ``max |v|``)."""

    out: torch.Tensor
    lse: torch.Tensor
    lse_with_sink: torch.Tensor
    max_logits: torch.Tensor
    n_valid: torch.Tensor
    bound: dict
    exact_logits: float
    pv_abs: torch.Tensor | None = None

    def as_dict(self) -> dict[str, torch.Tensor]:
        return {"out": self.out, "lse": self.lse, "lse_with_sink": self.lse_with_sink,
                "max_logits": self.max_logits, "n_valid": self.n_valid}


def peak_bytes_estimate_fast(chunk_tokens: int, num_heads: int, total_topk: int, head_dim: int = 512,
                             d_v: int = 512, rows_itemsize: int = 2, want_abs: bool = False) -> int:
    """Upper estimate (bytes) of the fast oracle's live tensors for one chunk of ``c`` tokens:
    ``c * (K*D*(b + 8) + 2*H*K*8 + 2*H*(D + d_v)*8 + 64*K + 64*H)``: the gathered rows in the
    table's dtype (``b`` bytes) and as float64, the ``[H, K]`` logits (exponentiated in place) and
    one spare logit-sized allowance (index/redo temporaries, masks), q in float64 and the chunk's
    ``N``, and per-slot / per-row scalars (indices, gathered statistics). Once per call come the
    table (rows of every segment, a zero row and q's ``T*H`` rows: ``(N + 1 + T*H) * D * b``), its
    statistics (``<= 24`` bytes per row; temporaries in pieces of ``<= STAT_BYTES``, 1 GiB) and the
    outputs and bounds of all ``T`` tokens (``T * (2 * H * d_v + 12 * H) * 8`` bytes), held until
    the call returns. Production decode (H=128, K=1152, D=d_v=512): 9.95 MiB per token, so the
    default 1.5 GiB budget gives 154-token chunks (batch 128: one chunk). ``want_abs``: plus the
    chunk's ``pv_abs`` numerator (bfloat16 and float64) and ``p`` in bfloat16, ``c * H * (10 d_v + 2
    K)`` (``|V|`` is taken in place of the gathered rows)."""
    for name, v in (("chunk_tokens", chunk_tokens), ("num_heads", num_heads), ("head_dim", head_dim),
                    ("d_v", d_v), ("rows_itemsize", rows_itemsize)):
        check_int("peak_bytes_estimate_fast", name, v, minimum=1)
    check_int("peak_bytes_estimate_fast", "total_topk", total_topk, minimum=0)
    c, H, K, D = chunk_tokens, num_heads, total_topk, head_dim
    return c * (K * D * (rows_itemsize + 8) + 2 * H * K * 8 + 2 * H * (D + d_v) * 8 + 64 * K + 64 * H
                + (H * (10 * d_v + 2 * K) if want_abs else 0))


# ----------------------------------------------------------------------------- layout

_COLUMNS: dict = {}
_COLUMNS_MAX = 32
_COEF: dict = {}  # ``_constants``: per (K, D, scale, sink?, statistics dtype, device)
_ZERO_ROWS: dict = {}  # one zero row per (D, dtype, device)


def _column_constants(Ks: tuple, Ns: tuple, rules: tuple, dev: torch.device) -> tuple:
    """Per column of the concatenated segments (``[K]`` int64 on ``dev``): position in its
    segment, its segment's ``N - 1``, the segment's first table row; the -1-only columns as a
    ``[K]`` bool mask where the rules are mixed (else None); 0-dim int64 ``sum N`` (the zero row's
    index), ``0`` and ``-1``; per segment a ``[1, 1]`` int64 ``K_s``, the length of a segment
    without lengths; and all of it as one int64 tensor ``[5, K + 3 + S]`` whose first ``K`` columns
    hold per column its position, ``N_s - 1``, first table row, whether it is -1-only and its
    segment number (``fast_passes.layout``'s column constants). Built on the host, copied once,
    kept for the next call with the same layout (at most ``_COLUMNS_MAX`` layouts)."""
    key = (Ks, Ns, rules, dev)
    hit = _COLUMNS.get(key)
    if hit is not None:
        return hit
    K, S, cols, off = sum(Ks), len(Ks), [], 0
    for i, (k, N, r) in enumerate(zip(Ks, Ns, rules)):
        cols.append(torch.stack([torch.arange(k), torch.full((k,), N - 1), torch.full((k,), off),
                                 torch.full((k,), int(r == IndexRule.MINUS1_ONLY)), torch.full((k,), i)]))
        off += N
    tail = torch.tensor([[sum(Ns), 0, -1, *Ks]] + [[0] * (3 + S)] * 4)  # row 0: the scalars, then the K_s
    ci = torch.cat(cols + [tail], dim=1).to(dev)
    pos, nmax, offcol, m1, _ = ci[:, :K].unbind(0)
    mixed = len(set(r == IndexRule.MINUS1_ONLY for r in rules)) > 1
    scalars = ci[0, K:].unbind(0)
    hit = (pos, nmax, offcol, m1.bool() if mixed else None, *scalars[:3],
           tuple(t.view(1, 1) for t in scalars[3:]), ci)
    if len(_COLUMNS) >= _COLUMNS_MAX:
        _COLUMNS.pop(next(iter(_COLUMNS)))
    _COLUMNS[key] = hit
    return hit


def _lengths(segments, kcol, T: int) -> list:
    """Each segment's lengths as ``[T, 1]``: its own, or (a segment without lengths) its ``K_s``
    (``kcol``: ``_column_constants``' ``[1, 1]`` tensors) broadcast over the tokens."""
    return [s.length.view(T, 1) if s.length is not None else k.expand(T, 1) for s, k in zip(segments, kcol)]


def slot_layout(segments, rules, T: int, dev: torch.device):
    """``(valid, gidx, n_valid, pending, cols)``: validity ``[T, K]`` (bool), table row of every slot
    ``[T, K]`` (int64; invalid slots -> the zero row ``Nrows``), ``n_valid`` ``[T]`` (int32), what
    ``layout_flags`` needs for the deferred validation (issued later, so the heavy kernels start sooner)
    and ``_column_constants``. No host sync: the caller reads the flags with its one sync after the
    heavy kernels and then lets ``check_common`` raise the precise error. Out-of-range slots never
    reach a gather (they point at the zero row), so a bad input cannot fault the device first.

    Several segments: one ``cat`` gives the indices ``[T, K]``, each slot's length (its segment's,
    broadcast over its columns) ``[T, K]`` and the lengths ``[T, S]`` (a segment without lengths
    reads ``K_s``; ``cat`` promotes the integer dtypes, exactly). With a -1-only segment the
    in-prefix offset from the segment's range, ``w = idx - c0`` with ``c0`` the nearest index in
    ``[0, N_s - 1]``, 0 below the range (0 in range, ``idx < 0`` below it, ``> 0`` above it; an
    empty segment has no range: ``idx`` below, ``idx + 1`` above), is set to ``-1`` outside the
    prefix: a slot is valid iff ``w == 0``, and the -1-only rule holds iff every ``w`` of a -1-only
    column lies in ``[-1, 0]`` (one ``aminmax``, ``layout_flags``)."""
    Ks = tuple(s.idx.shape[1] for s in segments)
    cols = _column_constants(Ks, tuple(s.rows.shape[0] for s in segments), tuple(rules), dev)
    pos, nmax, offcol, m1, zrow, zero, minus1, kcol = cols[:8]
    lens = _lengths(segments, kcol, T)
    if len(segments) == 1:
        idx, lcol = segments[0].idx, lens[0]  # [T, 1] broadcast over the columns
        lts = lcol
    else:
        K = sum(Ks)
        both = torch.cat([s.idx for s in segments] + [ln.expand(T, k) for ln, k in zip(lens, Ks)] + lens, dim=1)
        idx, lcol, lts = both.split_with_sizes((K, K, len(segments)), dim=1)
    in_prefix = pos < lcol
    # the nearest index in [0, N_s - 1], 0 below the range: an empty segment (N_s - 1 = -1) then
    # gives w = idx below it (-1 allowed, -2 not) and idx + 1 >= 1 above it, and no valid slot
    c0 = torch.where(idx < 0, zero, idx.clamp(zero, nmax))
    if any(r == IndexRule.MINUS1_ONLY for r in rules):
        w = torch.where(in_prefix, idx - c0, minus1)
        valid = w == 0  # in the prefix and in [0, N_s)
    else:
        w, valid = None, in_prefix & (idx == c0)
    gidx = torch.where(valid, idx + offcol, zrow)  # int64 (offcol is)
    return valid, gidx, valid.sum(dim=1, dtype=torch.int32), (lts, w, m1, zero), cols


_HV_INIT: dict = {}  # ``layout_by_kernel``: the host vector's neutral values per layout
_HV_BIG = 2**62


def layout_by_kernel(segments, rules, T: int, dev: torch.device, sink, chunks: int, rows=None):
    """``slot_layout`` and ``layout_flags`` as one Triton kernel launch (``fast_passes.layout``)
    that also starts the host vector ``_issue`` reads with its one sync: ``valid`` ``[T, K]`` uint8
    (1: valid), ``gidx``, ``n_valid`` and ``cols`` as ``slot_layout`` returns them, ``host`` the
    int64 host vector in ``_complete``'s layout -- the lengths' minima and maxima per segment, the
    -1-only range offsets' minimum and maximum (with a -1-only segment), two counts per chunk
    (zeros here: ``fast_passes.softmax`` adds them at ``host[at + 2 i]``), per sink value whether it
    is NaN -- copied from ``init``, a kept tensor of their neutral values, and written by the kernels;
    ``at``: the first chunk's counts' index. Returns ``(valid, gidx, n_valid, host, cols, at,
    init)``. ``K > 0``. ``rows``: q's rows and the first chunk's slot rows gathered in the same
    launch (``fast_passes.layout``'s ``rows``), then returned after ``init``: ``(q64, qst)`` and ``(g,
    ga, st)``."""
    Ks = tuple(s.idx.shape[1] for s in segments)
    Ns = tuple(s.rows.shape[0] for s in segments)
    cols = _column_constants(Ks, Ns, tuple(rules), dev)
    S, K = len(segments), sum(Ks)
    has_w = any(r == IndexRule.MINUS1_ONLY for r in rules)
    ns = 0 if sink is None else sink.numel()
    key = (S, has_w, chunks, ns, dev)
    init = _HV_INIT.get(key)
    if init is None:
        if len(_HV_INIT) >= _COLUMNS_MAX:
            _HV_INIT.pop(next(iter(_HV_INIT)))
        init = _HV_INIT[key] = torch.tensor([_HV_BIG] * S + [-_HV_BIG] * S + [0] * (2 * has_w + 2 * chunks + ns),
                                            dtype=torch.int64).to(dev)
    host = init.clone()
    if S == 1:
        s0 = segments[0]
        idx = s0.idx if s0.idx.stride(1) == 1 else s0.idx.contiguous()
        lens, lens_at = (s0.length, (s0.length.stride(0), 0)) if s0.length is not None else (cols[7][0], (0, 0))
    else:
        lens_l = _lengths(segments, cols[7], T)
        idx = lens = torch.cat([s.idx for s in segments] + lens_l, dim=1)  # cat promotes the integer dtypes
        lens_at = (K + S, K)
    counts = 2 * S + 2 * has_w
    sink_bits, sink_nan = None, (0, 0)
    if sink is not None:  # read as contiguous by the kernel
        idt, nan_exp, nan_mag = _FLOAT_BITS[sink.dtype]
        sink_bits, sink_nan = sink.contiguous().view(idt), (nan_mag, nan_exp)
    out = fast_passes.layout(idx, K, lens, lens_at, cols[8], S, sum(Ns), host, 2 * S if has_w else None, sink_bits,
                             counts + 2 * chunks, sink_nan, rows)
    return (*out[:3], host, cols, counts, init, *out[3:])


def layout_flags(pending) -> list:
    """The validation flags ``slot_layout`` leaves for later (``pending``: its lengths ``[T, S]``, the
    in-prefix range offsets ``w`` ``[T, K]`` (None without a -1-only segment), the -1-only column
    mask (None unless the rules are mixed) and the 0-dim ``0``): integer 1-D tensors (the host
    vector stays integer, ``_issue``), the lengths' ``[S]`` min and max per
    segment and, with a -1-only segment and ``K > 0``, the ``[1]`` min and max of ``w`` over the
    -1-only columns (``[-1, 0]`` unless a slot breaks the rule). Issued after the heavy kernels:
    the host sync reads them."""
    lts, w, m1, zero = pending
    # reductions along contiguous rows (on one H200 a dim-0 reduction of the strided [T, S] lengths
    # and a one-output reduction of the [T, K] offsets took 9 and 7-14 us; these 4 and 7)
    flags = list(torch.aminmax(lts.t().contiguous(), dim=1))
    if w is not None and w.shape[1]:
        if m1 is not None:
            w = torch.where(m1, w, zero)
        lo, hi = torch.aminmax(w, dim=1)
        flags += [lo.amin().view(1), hi.amax().view(1)]
    return flags


def table_dtype(segments, q: torch.Tensor) -> torch.dtype:
    """The table's dtype: the one dtype of q and every segment's rows, else float64 (every accepted
    dtype converts to float64 exactly)."""
    dts = {s.rows.dtype for s in segments} | {q.dtype}
    return dts.pop() if len(dts) == 1 else torch.float64


def _table(segments, q: torch.Tensor, nan_policy: NanPolicy):
    """One table ``[Nrows + 1 + T*H, D]``: every segment's rows (NaN scrubbed under ``SCRUB``),
    one zero row (what an invalid slot reads, ``attention._gather``) and q's ``T*H`` rows (never
    scrubbed; their statistics come from the same pass). One dtype: the common one, else float64
    (every accepted dtype converts to float64 exactly)."""
    T, H, D = q.shape
    dt = table_dtype(segments, q)
    Nrows = sum(s.rows.shape[0] for s in segments)
    zkey = (D, dt, q.device)
    zero = _ZERO_ROWS.get(zkey)
    if zero is None:
        zero = _ZERO_ROWS[zkey] = torch.zeros(1, D, dtype=dt, device=q.device)
    parts = [s.rows for s in segments] + [zero, q.reshape(T * H, D)]
    table = torch.cat(parts)  # promotes mixed dtypes (exactly)
    if table.dtype != dt:
        table = table.to(dt)
    if nan_policy == NanPolicy.SCRUB:
        r = table[:Nrows]
        r.masked_fill_(torch.isnan(r), 0.0)
    return table, Nrows


# ----------------------------------------------------------------------------- chunks

def ordered_dots(qc: torch.Tensor, g: torch.Tensor, where: torch.Tensor, scale: float,
                  piece: int | None = None) -> torch.Tensor:
    """The ordered oracle's logits (d = 0..D-1, multiply then add from +0) for the listed
    ``(t, h, k)`` positions ``where`` ``[n, 3]``: ``ordered.scaled_logits`` itself over the tokens that
    hold them, ``piece`` tokens at a time (default all; ``_redo_piece``), each a ``[tokens, H, K]``
    accumulator whose K rows the heads share, then picked. Gathering an ``[n, D]`` operand per
    position instead took ``H`` copies of the rows: 2 GB and 2 s for the 233,664 positions of one
    drawn sweep case on the CPU (1.2 GB per token at production decode shapes)."""
    t, h, k = where.unbind(1)
    toks, inv = torch.unique(t, return_inverse=True)
    step = toks.numel() if piece is None else max(1, piece)
    out = torch.empty(t.shape[0], dtype=torch.float64, device=qc.device)
    for i0 in range(0, toks.numel(), step):
        tp = toks[i0:i0 + step]
        every = tp.numel() == qc.shape[0]  # every token (then tp is 0..c-1): no copy
        full = scaled_logits(qc, g, scale) if every else scaled_logits(qc.index_select(0, tp), g.index_select(0, tp), scale)
        sel = ((inv >= i0) & (inv < i0 + step)).nonzero().reshape(-1)
        out[sel] = full[inv[sel] - i0, h[sel], k[sel]]
    return out


def _redo_piece(c: int, H: int, K: int, D: int, itemsize: int) -> int:
    """Tokens per piece of ``ordered_dots`` in a chunk of ``c`` tokens: a piece of ``p`` tokens
    holds ``p * (16 K D + 16 H K)`` bytes (its q and K rows copied and laid out ``[D, ...]`` by
    ``scaled_logits``, its accumulator and product), which fits the chunk's spare allowance in
    ``peak_bytes_estimate_fast`` -- one logit-sized tensor and the table-dtype rows, ``c * (8 H K +
    itemsize * K * D)`` bytes, not live while the logits are redone. At least 1."""
    return max(1, (c * (8 * H * K + itemsize * K * D)) // (16 * K * D + 16 * H * K))


def _gather(table, gflat, c, want_abs=False):
    """``(g, gb)``: the chunk's slot rows ``[c, K, D]`` as float64 (gathered in the table's dtype by
    the flat ``[c*K]`` table rows ``gflat``, then converted: exact) and, for ``pv_abs``
    (``want_abs``) from a bfloat16 table, the gathered bfloat16 rows themselves (else None)."""
    gt = table.index_select(0, gflat).view(c, -1, table.shape[1])
    keep = want_abs and bf16_abs_gemm(gt.dtype, gt.shape[1])
    return gt.to(torch.float64), (gt if keep else None)


def _softmax_pv(table, gflat, negmask, lonely, qc, scale, d_v, zero, want_abs=False):
    """Steps 1-3 and ``N = bmm(p, V)`` for one chunk of ``c`` tokens with the fast logits:
    ``gflat`` ``[c*K]`` table rows of the slots, ``negmask`` ``[c, 1, K]`` float64 ``0`` (valid) /
    ``-inf`` (invalid), ``lonely`` ``[c, 1, 1]`` (no valid slot), ``qc`` the chunk's q ``[c, H,
    D]``. Returns ``(N [c, H, d_v], m, L, Na)`` (``m``, ``L``: ``[c, H, 1]``; ``Na = bmm(p, |V|)``
    with ``want_abs``, else None; no host sync). Only the GEMMs and the softmax passes: issued before
    the exactness tests and bounds (``_row_tests``, ``_finish``) that decide whether these logits
    stand, so the GPU runs them while the host issues those."""
    g, gb = _gather(table, gflat, qc.shape[0], want_abs)
    s = torch.bmm(qc.to(torch.float64), g.transpose(1, 2))
    # scale and mask in one pass: -inf + fl(scale s) = -inf, 0 + fl(scale s) = fl(scale s) (fused or
    # not; a -0 turns +0, which neither the max nor exp sees). It needs every logit finite: true when
    # no row needs the ordered logits (q and every valid row finite, invalid slots read the zero
    # row); a chunk with such a row is discarded and run by ``_chunk_ordered``.
    # It also turns a -0 logit +0 (+0 + -0 = +0), as the ordered oracle's accumulation from +0 does,
    # so the max below needs no canonicalisation.
    torch.add(negmask, s, alpha=scale, out=s)
    return _softmax_tail(s, g, d_v, lonely, zero, canonical=True, want_abs=want_abs, gb=gb)


def _softmax_pv_passes(gather, rows_dtype, gflat, valid, q64, fconst, d_v, tests, want_abs=False, counts=None,
                       qstats=None):
    """``_softmax_pv`` and ``_row_tests`` with the memory-bound passes in Triton (``fast_passes``):
    the slot rows gathered straight to float64 (and ``|V|`` in the rows' dtype for a bfloat16
    ``pv_abs``), the cuBLAS logits, one softmax kernel (scale, mask, max, ``exp``, sum, the row
    tests; ``bf16(p)`` for ``pv_abs``), the cuBLAS ``N = bmm(p, V)``. ``gather(gflat, c, abs) -> (g,
    ga, slot_stats)``: the chunk's ``[c, K, D]`` float64 rows, ``|V|`` (``abs``) and, where the
    gather computes them (``fast_passes.gather_stats``), the slots' ``[3, c K]`` statistics (else
    None: ``tests`` carries the table's). ``valid`` ``[c, K]`` bool or uint8, ``q64`` the chunk's q
    ``[c, H, D]`` as float64, ``fconst``: ``_constants``' float64 ``(scale, bf16_abs_factor(K))``,
    ``tests``: what ``fast_passes.softmax`` takes to run the row tests (with slot statistics:
    ``qstats``, q's rows' statistics), ``counts``: where it adds their counts (or None). Returns
    ``(N, m, L, Na)`` as ``_softmax_pv`` (but ``Na`` from bfloat16 rows: the bfloat16 ``bmm``
    itself, which ``fast_fused.finish`` converts and scales by ``bf16_abs_factor(K)``) and the row
    tests."""
    c, K = valid.shape
    bf16_abs = want_abs and bf16_abs_gemm(rows_dtype, K)
    g, ga, slot_stats = gather(gflat, c, bf16_abs)
    s = torch.bmm(q64, g.transpose(1, 2))
    if slot_stats is not None:
        tests = (slot_stats, None, *tests[2:])
    p, m, L, pb, rt = fast_passes.softmax(s, valid, fconst, bf16_abs, tests, counts, qstats)
    v = g if d_v == g.shape[2] else g[:, :, :d_v]
    N = torch.bmm(p, v)
    if not want_abs:
        return (N, m, L, None), rt
    if bf16_abs:
        return (N, m, L, torch.bmm(pb, ga)), rt
    return (N, m, L, torch.bmm(p, v.abs_())), rt


def direct_rows(segments, q) -> bool:
    """Whether ``_issue`` can gather from the segments' rows themselves (``fast_passes.gather_stats``)
    instead of a table: one or two segments, bfloat16 rows with unit column stride and bfloat16 q with
    unit column stride."""
    return (len(segments) <= 2 and q.dtype == torch.bfloat16 and q.stride(2) == 1
            and all(s.rows.dtype == torch.bfloat16 and s.rows.stride(1) == 1 for s in segments))


def _softmax_tail(s, g, d_v, lonely, zero, canonical=False, want_abs=False, gb=None):
    """Steps 2-3 and ``N = bmm(p, V)`` from masked scaled logits ``s`` ``[c, H, K]`` (consumed);
    ``canonical``: no logit is -0 (else the max is made +0, as the ordered oracle's). A lonely row
    (every logit ``-inf``) keeps ``m = -inf`` and is shifted by 0 instead: ``p = 0``, ``L = 0``,
    ``N = 0`` (``_finish`` relies on it). ``zero``: a 0-dim float64 0 on the device. Returns ``(N,
    m, L, Na)``: ``Na`` (``want_abs``, else None) the numerator of ``pv_abs``, ``sum_k p_k |v_k|``:
    from the bfloat16 rows ``gb`` (consumed) one bfloat16 GEMM of ``bf16(p)`` and ``|V|`` times
    ``bf16_abs_factor(K)`` (an upper bound within 1.2%, a fraction of the float64 GEMM's memory
    traffic), else the float64 ``bmm(p, |V|)`` (``g`` consumed)."""
    m = s.amax(dim=2, keepdim=True)
    if not canonical:
        m.add_(0.0)  # -0.0 -> +0.0, as the ordered oracle's max
    p = s.sub_(torch.where(lonely, zero, m)).exp_()  # p = exp(s - m) (torch.exp, one pass, in place)
    L = p.sum(dim=2, keepdim=True)
    v = g if d_v == g.shape[2] else g[:, :, :d_v]
    N = torch.bmm(p, v)
    if not want_abs:
        return N, m, L, None
    if gb is not None:  # |V| in place: the rows are not read again
        vb = gb if d_v == gb.shape[2] else gb[:, :, :d_v]
        Na = torch.bmm(p.to(torch.bfloat16), vb.abs_()).to(torch.float64).mul_(bf16_abs_factor(gb.shape[1]))
    else:
        Na = torch.bmm(p, v.abs_())
    return N, m, L, Na


def _row_tests(stats, gflat, qrows, c, lims):
    """Step 1's per-row decisions for one chunk of ``c`` tokens from the row statistics
    (``row_stats`` of the table), ``gflat`` the flat ``[c*K]`` table rows of the slots, ``qrows``
    the chunk's q rows of the table: ``(x, vmax, both)``, ``x`` ``[c, H, 1]``, ``vmax`` ``[c, 1, 1]``
    and ``both`` ``[2, c, H, 1]`` bool, ``(exact, fast)`` (one tensor: one count for the host, and the
    two split only where a chunk is redone; the kernels that compute the tests give it as uint8, 1:
    true). ``exact``: the row's logits are proven exact; ``fast``: the row keeps the fast logits (else
    it must take the ordered logits: its products are NaN/Inf/huge, or its ``delta`` exceeds
    ``DELTA_MAX``); the rows with approximate (bounded) logits are those fast and not
    exact. ``x = fl(n_q max_k n_k)`` on rows not proven exact, else 0 (the bound's feature on the
    rows that keep the fast logits; ``_chunk_ordered`` sets it to 0 on the others); ``vmax``:
    ``max |v|`` over the token's slots. ``lims``:
    ``(exact_bits, x limit of exact rows, x limit of approximate rows, 0)``, the last three as
    0-dim tensors of the statistics' dtype (the limits rounded down; a fifth element, the same
    as one tensor, is ``fast_fused``'s). The fused kernels compute these in the logits kernel
    (``fast_fused.softmax_pv``)."""
    ebits, lim_exact, lim_approx, zero = lims[:4]
    nk, bk, vk = stats.index_select(1, gflat).view(3, c, 1, -1).amax(dim=3, keepdim=True).unbind(0)
    nq, aq, _ = stats[:, qrows].view(3, c, -1, 1).unbind(0)  # [c, H, 1]
    nqb = nq * nk  # NaN/inf where a norm is
    both = torch.empty((2, *nqb.shape), dtype=torch.bool, device=nqb.device)  # one count for the host
    exact, fast = both.unbind(0)
    torch.lt(aq + bk, ebits, out=exact)
    torch.lt(nqb, torch.where(exact, lim_exact, lim_approx), out=fast)  # NaN: False
    return torch.where(exact, zero, nqb), vk, both


def _chunk_ordered(table, vfin, gidx, valid, lonely, qc, scale, d_v, tests, zero, want_abs=False):
    """A chunk with rows that need the ordered logits: ``_softmax_pv`` with those rows' logits
    recomputed by ``ordered_dots`` (bit-identical to the ordered oracle, so NaN/Inf logits match)
    and invalid slots masked to ``-inf`` whatever their logit. ``tests``: the chunk's
    ``_row_tests``. Returns the chunk's part for ``_finish_parts``, ``(N, m, L, x, vmax, Na)``
    (``x`` 0 on the rows that take the ordered logits, ``vmax`` over the finite values only,
    ``vfin``: ``vmax_finite`` of the table), and its rows with approximate logits ``[c, H, 1]``
    (those that keep the fast logits and are not proven exact)."""
    c, K = gidx.shape
    gflat = gidx.reshape(-1)
    g, gb = _gather(table, gflat, c, want_abs)
    qc = qc.to(torch.float64)
    s = torch.bmm(qc, g.transpose(1, 2)).mul_(scale)
    x, vk, both = tests
    exact, fast = both.view(torch.bool).unbind(0)  # uint8 where a kernel computed the tests
    vmax = vfin.index_select(0, gflat).view(c, K).amax(dim=1).to(vk.dtype).view(c, 1, 1)  # finite values
    w = (~fast & valid.unsqueeze(1)).nonzero()
    piece = _redo_piece(c, qc.shape[1], K, qc.shape[2], table.element_size())
    s[w[:, 0], w[:, 1], w[:, 2]] = ordered_dots(qc, g, w, scale, piece)
    s.masked_fill_(~valid.unsqueeze(1), -math.inf)
    N, m, L, Na = _softmax_tail(s, g, d_v, lonely, zero, want_abs=want_abs, gb=gb)
    return (N, m, L, x.masked_fill(~fast, 0.0), vmax, Na), fast & ~exact


def _finish(N, m, L, x, vmax, lonely, sink, coef, one, Na=None):
    """Steps 4-7 and the bounds for all tokens at once (a fixed number of kernel launches per
    call), with the ordered oracle's lonely-row conventions. ``N``, ``m``, ``L``: ``_softmax_tail``'s
    (``[T, H, d_v]``, ``[T, H, 1]``; ``N`` is divided in place), ``x`` ``[T, H, 1]``, ``vmax``
    ``[T, 1, 1]``, ``lonely`` ``[T, 1, 1]``, ``coef``: ``bound_coefficients``' columns ``(x, ln L,
    |lse|, |sink|, 1)`` on the device (``[4, 1, 1, 1]`` each), ``one``: a 0-dim float64 1. ``out =
    N / L`` (no sink) or ``N / (L + L e)``, ``e = exp(sink - lse)``: one division by ``L (1 + e)``
    rounded twice (or once, fused), no more roundings than the ordered ``(N / L) f`` with ``f = 1 /
    (1 + e)`` (steps 5-6; where ``L (1 + e)`` overflows, ``f < 2**-1000`` and ``out`` is 0, within
    the bound's absolute ``V_j 2u`` term); lonely rows divide by 1 (``N = 0``). A row with a finite
    output has finite features (``x <= 2**1000``, ``ln L`` in ``[0, ln K]``, finite ``lse`` and
    sink), so its bounds are finite; a lonely row has ``lse = -inf``, so every bound of it comes out
    non-finite and is set to 0, as are the bounds of rows whose ``lse`` is NaN/Inf. Bounds at other
    non-finite outputs (NaN/Inf values, a ``+inf`` sink's ``lse_with_sink``: the same values in both
    modes) are finite and carry no meaning. Returns ``(out, lse, lws, m, pv_abs)`` (``[T, H, d_v]``,
    then ``[T, H]``, then ``Na`` divided in place by the same ``L (1 + e)``, or None without ``Na``)
    and the bounds ``(b_lse, b_lws, b_max)`` ``[T, H]`` and ``b_out`` ``[T, H, 1]`` (``V_j B[t,
    h]``: the ``out`` bound is its broadcast to ``[T, H, d_v]``)."""
    T, H, _ = m.shape
    cx, cl, ce, cs, cb = coef
    lnL = torch.log(L)  # -inf on lonely rows (L = 0)
    lse = m + lnL  # -inf + -inf on lonely rows
    if sink is None:
        den, lws, base = torch.where(lonely, one, L), lse, cb
    else:
        sk = sink.view(1, H, 1)
        den = torch.where(lonely, one, torch.addcmul(L, L, torch.exp(sk - lse)))
        lws = torch.logaddexp(lse, sk)
        # +-inf sinks enter as 0 ("Evaluation"); a NaN sink is rejected by the caller's validation
        base = torch.addcmul(cb, cs, sk.abs().nan_to_num_(posinf=0.0))  # [4, 1, H, 1]
    out = N.div_(den)
    pv = None if Na is None else Na.div_(den)
    # B = cb + cs |sink| + cl ln L + ce |lse| + cx x, [4, T, H, 1]; ln L >= 0 but on lonely rows
    # (-inf there: their B is reset below)
    B = torch.addcmul(base, cl, lnL).addcmul_(ce, lse.abs()).addcmul_(cx, x).nan_to_num_(nan=0.0, posinf=0.0)
    b_lse, b_lws, b_max, _ = B.view(4, T, H).unbind(0)
    return (out, lse.view(T, H), lws.view(T, H), m.view(T, H), pv), (b_lse, b_lws, b_max, B[3].mul_(vmax))


def _finish_any(parts, lonely, n_valid, sink, consts, fused: bool):
    """``_finish_parts``, or its one-kernel form ``fast_fused.finish`` (``fused``): the same steps,
    conventions and return value. ``consts``: ``_constants``' tuple."""
    if fused:
        return fast_fused.finish(parts, n_valid, sink, consts[3], consts[4])
    return _finish_parts(parts, lonely, sink, consts[0], consts[2][2])


def _finish_parts(parts, lonely, sink, coef, one):
    """``_finish`` over the chunks' ``(N, m, L, x, vmax, Na)`` (one chunk: its own tensors, ``N``
    divided in place; several: concatenated; ``Na`` None in every chunk or in none)."""
    if len(parts) == 1:
        return _finish(*parts[0][:5], lonely, sink, coef, one, parts[0][5])
    N, m, L, x, vmax, Na = [c[0] if c[0] is None else torch.cat(c, dim=0) for c in zip(*parts)]
    return _finish(N, m, L, x, vmax, lonely, sink, coef, one, Na)


def _constants(K: int, D: int, scale: float, with_sink: bool, sdt: torch.dtype, dev: torch.device) -> tuple:
    """Per ``(K, D, scale, sink?, statistics dtype, device)``, kept: ``bound_coefficients``' columns
    as ``_finish`` takes them (``[4, 1, 1, 1]`` each), ``_row_tests``' ``lims`` (the x limits
    rounded down to the statistics' dtype, its 0, and the four as one ``[4]`` tensor with
    ``exact_bits(D)`` in the statistics' dtype: ``(la, le, 0, exact_bits)``, what ``fast_fused``
    reads), the float64 ``(0, -inf, 1)`` of the logit mask and the lonely rows (0-dim tensors on
    the device) and the coefficients as one float64 ``[20]`` tensor (``cx, cl, ce, cs, cb``, 4
    each, for ``fast_fused.finish``) and the float64 ``[2]`` ``(scale, bf16_abs_factor(K))`` the fused
    kernels read (a Python float would reach a Triton kernel as float32)."""
    key = (K, D, scale, with_sink, sdt, dev)
    hit = _COEF.get(key)
    if hit is None:
        if len(_COEF) >= _COLUMNS_MAX:
            _COEF.pop(next(iter(_COEF)))
        coef = bound_coefficients(K, D, scale, with_sink)
        lim = torch.tensor([DELTA_MAX / delta_coefficient(D, scale), BIG / x_factor(D)], dtype=torch.float64)
        low = lim.to(sdt)
        low = torch.where(low.double() > lim, torch.nextafter(low, torch.zeros_like(low)), low)
        mask = torch.tensor([0.0, -math.inf, 1.0], dtype=torch.float64)
        both = torch.cat([coef[:, F_X], coef[:, F_LNL], coef[:, F_LSE], coef[:, F_SINK], coef[:, -1],
                          low.double(), mask, torch.tensor([exact_bits(D), scale, bf16_abs_factor(K) if K < BF16_ABS_MAX_K
                                                            else 1.0], dtype=torch.float64)]).to(dev)
        coefs = tuple(both[:20].view(5, 4, 1, 1, 1).unbind(0))  # cx, cl, ce, cs, cb
        lim4 = torch.cat([both[20:22], both[21:22] * 0, both[25:26]]).to(sdt)  # la, le, 0, exact_bits
        la, le, zero, _ = lim4.unbind(0)
        hit = _COEF[key] = (coefs, (exact_bits(D), le, la, zero, lim4), both[22:25].unbind(0), both[:20], both[26:28])
    return hit


@dataclass
class _Issued:
    """What ``_issue`` leaves for ``_complete``: device tensors only (in a CUDA graph: its static
    buffers). ``host``: the int64 vector the one host sync reads; ``keep``: the cached constants
    the work reads (a captured graph must keep them alive); ``packed`` (``pack=True``, for a graph): the
    ``[T, H]`` outputs and bounds stacked ``[7, T, H]`` (``lse``, ``lse_with_sink``, ``max_logits``,
    their bounds, ``out``'s bound), so a replay returns them with one copy. ``valid``: ``[T, K]``
    bool, or uint8 (1: valid) where the layout kernel wrote it (viewed as bool only where a chunk is
    redone)."""

    spans: list
    valid: torch.Tensor
    gidx: torch.Tensor
    n_valid: torch.Tensor
    lonely: torch.Tensor | None  # None where the layout kernel ran: ``n_valid == 0``
    table: object  # the table, or (rows gathered without one) a callable that builds it: ``_table``'s result
    tests: list
    parts: list
    res: tuple
    host: torch.Tensor
    keep: tuple
    packed: torch.Tensor | None = None
    pinned: torch.Tensor | None = None  # a replay's host vector in pinned memory (``fast_sparse_attention``)
    finish_kernel: bool = False  # steps 4-7 ran as ``fast_fused.finish``: the redone chunks finish with it too


def _spans(T: int, H: int, K: int, D: int, d_v: int, itemsize: int, dev: torch.device,
           chunk_tokens: int | None, want_abs: bool = False) -> list:
    """The chunks ``[(t0, t1)]``: ``chunk_tokens`` per chunk, by default what fits
    ``FAST_BUDGET_BYTES`` (and, on the CPU, an ~8 MiB logit tensor). Kept per arguments (at most
    ``_COLUMNS_MAX``): a call's host work before its first launch is the eager call's latency."""
    key = (T, H, K, D, d_v, itemsize, dev.type, chunk_tokens, want_abs, FAST_BUDGET_BYTES)
    hit = _SPANS.get(key)
    if hit is None:
        if len(_SPANS) >= _COLUMNS_MAX:
            _SPANS.pop(next(iter(_SPANS)))
        hit = _SPANS[key] = tuple(_chunk_spans(T, H, K, D, d_v, itemsize, dev, chunk_tokens, want_abs))
    return list(hit)


_SPANS: dict = {}


def _chunk_spans(T: int, H: int, K: int, D: int, d_v: int, itemsize: int, dev: torch.device,
                 chunk_tokens: int | None, want_abs: bool) -> list:
    """``_spans``' value, computed."""
    if chunk_tokens is None:
        per = peak_bytes_estimate_fast(1, H, K, D, d_v, itemsize, want_abs)
        chunk_tokens = max(1, FAST_BUDGET_BYTES // per)
        if dev.type == "cpu":
            chunk_tokens = min(chunk_tokens, max(1, _CPU_LOGIT_BYTES // max(1, 8 * H * K)))
    return [(t0, min(T, t0 + chunk_tokens)) for t0 in range(0, T, chunk_tokens)]


def _part(x: torch.Tensor, t0: int, t1: int, one_chunk: bool) -> torch.Tensor:
    """Tokens ``[t0, t1)`` of a per-token tensor (the tensor itself when the call has one chunk:
    no slicing view to issue)."""
    return x if one_chunk else x[t0:t1]


# per float dtype: the integer dtype of its width, its exponent mask (an exponent of all ones and a
# nonzero mantissa is a NaN) and the mask of its magnitude bits
_FLOAT_BITS = {torch.float64: (torch.int64, 0x7FF0000000000000, 0x7FFFFFFFFFFFFFFF),
               torch.float32: (torch.int32, 0x7F800000, 0x7FFFFFFF),
               torch.float16: (torch.int16, 0x7C00, 0x7FFF),
               torch.bfloat16: (torch.int16, 0x7F80, 0x7FFF)}


def _issue(q, segments, rules, sink, sc, d_v, nan_policy, spans, pack: bool = False,
           want_abs: bool = False, fused: bool = False, passes: bool = False) -> _Issued:
    """Every kernel of a call up to its one host sync, issued without reading a device value
    (so a CUDA graph can capture it), in the order that keeps the GPU busy from the first launch
    (an eager call's host issues ~60 kernels at ~10-25 us each; the GPU work is ~1 ms at
    production decode shapes): the table and its row statistics (a few long kernels, which the
    GPU runs while the host issues the slot layout), per chunk the GEMMs and softmax passes
    (``want_abs``: one more GEMM, ``p |V|``), the deferred validation flags, the exactness tests,
    steps 4-7 and the bounds, and the host vector. ``fused``: the chunks' heavy steps by
    ``fast_fused``; ``passes``: the memory-bound passes by ``fast_passes`` (and steps 4-7 by
    ``fast_fused.finish``): the layout, flags and host vector by one kernel, and where the rows
    allow it (``direct_rows``) no table -- q's rows and the first chunk's slot rows gathered from
    the segments with their statistics in the layout's launch, the other chunks' by their own --
    about 10 kernels in all."""
    T, H, D = q.shape
    dev = q.device
    K = sum(s.idx.shape[1] for s in segments)
    passes = passes and not fused and K > 0
    # bfloat16 rows of at most two segments: no table (each gathered row's statistics come with it)
    direct = passes and direct_rows(segments, q)
    if direct:  # the layout, the flags, the host vector, q's rows and the first chunk's slot rows by one kernel
        table, Nrows, stats, passes_heavy = None, sum(s.rows.shape[0] for s in segments), None, True
        seg_rows, scrub = [s.rows for s in segments], nan_policy == NanPolicy.SCRUB
        rows = (q.reshape(T * H, D), (T, H), seg_rows, spans[0][1] - spans[0][0], d_v,
                want_abs and bf16_abs_gemm(torch.bfloat16, K), scrub)
        valid, gidx, n_valid, hv, cols, at, hv_init, (q64, qst), first = layout_by_kernel(
            segments, rules, T, dev, sink, len(spans), rows)
        lonely = None
    else:
        table, Nrows = _table(segments, q, nan_policy)
        passes_heavy = passes and fast_passes.gathers(table)  # else the PyTorch heavy steps, Triton finish
        if passes and table.dtype == torch.bfloat16:
            stats = fast_passes.row_stats(table, d_v)
        else:
            stats = row_stats(table, d_v)
        if passes_heavy:  # the layout, the flags and the host vector by one kernel; lonely rows: n_valid == 0
            valid, gidx, n_valid, hv, cols, at, hv_init = layout_by_kernel(segments, rules, T, dev, sink,
                                                                           len(spans))
            lonely = None
        else:
            valid, gidx, n_valid, pending, cols = slot_layout(segments, rules, T, dev)
            lonely, hv_init = n_valid.view(T, 1, 1) == 0, None
    q0 = Nrows + 1
    tdt = torch.bfloat16 if direct else table.dtype
    sdt = torch.float32 if tdt == torch.bfloat16 else torch.float64
    consts = _constants(K, D, sc, sink is not None, sdt, dev)
    coef, lims, (zero, ninf, one) = consts[:3]
    one_chunk = len(spans) == 1
    gflat = gidx.view(-1)

    def part(x, t0, t1):
        return _part(x, t0, t1, one_chunk)

    def flat(t0, t1):
        return gflat if one_chunk else gflat[t0 * K:t1 * K]

    if K == 0:  # every row lonely (m = -inf, as ``_finish`` expects of a lonely row)
        z = torch.zeros(T, H, 1, dtype=torch.float64, device=dev)
        z3 = torch.zeros(T, H, d_v, dtype=torch.float64, device=dev)
        heavy = [(z3, torch.full_like(z, -math.inf), z, torch.zeros_like(z3) if want_abs else None)]
        spans = [(0, T)]
    elif fused:  # two Triton kernels per chunk (``fast_fused``), which also run the row tests
        gc, t64 = gidx.contiguous(), fast_fused.table64(table)
        fz = [fast_fused.softmax_pv(t64, part(gc, t0, t1), Nrows, q0 + t0 * H, H, consts[4], d_v, stats, lims[4],
                                    want_abs, table16=table if table.dtype == torch.bfloat16 else None)
              for t0, t1 in spans]
        heavy, ftests = [f[:4] for f in fz], [f[4] for f in fz]
    elif direct:  # q's rows and the first chunk's slot rows came with the layout; the other chunks' here
        def gather(gf, c, ab):  # ga is None without |V| (the layout's first chunk takes the same ab)
            nonlocal first
            if first is None:
                return fast_passes.gather_stats(seg_rows, gf, (c, K), d_v, ab, Nrows, scrub)
            out, first = first, None
            return out

        pz = [_softmax_pv_passes(gather, tdt, flat(t0, t1), part(valid, t0, t1), part(q64, t0, t1), consts[4], d_v,
                                 (None, None, t0 * H, lims[4]), want_abs, (hv, at + 2 * i), qst)
              for i, (t0, t1) in enumerate(spans)]
        heavy, ftests = [z[0] for z in pz], [z[1] for z in pz]
    elif passes_heavy:
        def gather(gf, c, ab):
            return (*fast_passes.gather(table, gf, c, d_v, ab), None)

        pz = [_softmax_pv_passes(gather, tdt, flat(t0, t1), part(valid, t0, t1), part(q, t0, t1).to(torch.float64),
                                 consts[4], d_v, (stats, part(gidx, t0, t1), q0 + t0 * H, lims[4]), want_abs,
                                 (hv, at + 2 * i))
              for i, (t0, t1) in enumerate(spans)]
        heavy, ftests = [z[0] for z in pz], [z[1] for z in pz]
    else:
        negmask = torch.where(valid.unsqueeze(1), zero, ninf)  # float64 [T, 1, K]: 0 / -inf
        heavy = [_softmax_pv(table, flat(t0, t1), part(negmask, t0, t1), part(lonely, t0, t1), part(q, t0, t1),
                             sc, d_v, zero, want_abs) for t0, t1 in spans]
    checks = None if passes_heavy else layout_flags(pending)
    if K == 0:  # every row lonely: exact (no logits), and it keeps the (no) fast logits
        z2 = torch.zeros(T, H, 1, dtype=stats.dtype, device=dev)
        tests = [(z2, z2[:, :1], torch.ones(2, T, H, 1, dtype=torch.bool, device=dev))]
    elif fused or passes_heavy:
        tests = ftests
    else:
        tests = [_row_tests(stats, flat(t0, t1), slice(q0 + t0 * H, q0 + t1 * H), t1 - t0, lims)
                 for t0, t1 in spans]
    parts = [(*h[:3], *t[:2], h[3]) for h, t in zip(heavy, tests)]
    fused = fused and K > 0
    res = _finish_any(parts, lonely, n_valid, sink, consts, fused or passes)
    # the host vector, integers only (``cat`` promotes them to int64, exactly; a float among them
    # would turn every count and length into the float, e.g. a bfloat16 sink: 513 -> 512): lengths'
    # min and max per segment, [the -1-only range offsets' min and max], per chunk its count of
    # rows with proven-exact logits and its count of rows that keep the fast logits, [per sink value
    # 1 if it is NaN, else 0 (a NaN sink is an error)]
    if passes_heavy:  # written by the layout and softmax kernels
        host = hv
    else:
        vals = checks + [t[2].sum(dim=(1, 2, 3)) for t in tests]  # [2, c, H, 1] -> [2]
        if sink is not None:
            vals.append(torch.isnan(sink))  # bool: cat makes it int64
        host = torch.cat(vals)
    keep = (consts, cols, _ZERO_ROWS.get((D, tdt, dev)), BF16_LUT.get(dev), hv_init)
    packed = None
    if pack:
        (_, lse, lws, m, _), (b_lse, b_lws, b_max, b_out) = res
        packed = torch.stack([lse, lws, m, b_lse, b_lws, b_max, b_out.view(T, H)])
    if table is None:  # built only if a chunk must be redone with the ordered logits (``_complete``)
        table = functools.partial(_table, segments, q, nan_policy)
    return _Issued(spans, valid, gidx, n_valid, lonely, table, tests, parts, res, host, keep, packed,
                   finish_kernel=fused or passes)


def _owned(iss: _Issued) -> tuple:
    """Fresh copies of a replayed graph's outputs (``_issue(pack=True)``), issued before the host
    sync so that the host's cost of issuing them overlaps the GPU work: ``(res, n_valid)`` as
    ``_Issued.res`` and ``.n_valid`` hold them."""
    lse, lws, m, b_lse, b_lws, b_max, b_out = iss.packed.clone().unbind(0)
    out, pv = iss.res[0][0].clone(), iss.res[0][4]
    return ((out, lse, lws, m, None if pv is None else pv.clone()), (b_lse, b_lws, b_max, b_out.unsqueeze(2))), \
        iss.n_valid.clone()


def _complete(fn, q, segments, rules, scale, sc, sink, d_v, chunk_tokens, iss: _Issued, host: list,
              owned=None, orig=None, want_abs: bool = False) -> FastOracleOut:
    """Everything after the host sync: the deferred validation (``check_common`` raises the
    precise error), the chunks whose rows need the ordered logits (run again with them, steps 4-7
    redone), and the result. ``owned``: ``_owned(iss)`` after a graph replay (its static buffers are
    overwritten by the next replay), returned instead of them. ``orig``: the caller's ``(q,
    segments)`` when ``q`` / ``segments`` are their bucketed padding (``fast_buckets``): validated
    against, and the result sliced to their tokens."""
    T, H, _ = q.shape
    issued = segments  # what the device work ran on (the bucketed padding, if any): its host values
    vq, segments = orig if orig is not None else (q, segments)
    S, spans = len(segments), iss.spans
    nc = len(spans)
    lmin, lmax, rest = host[:S], host[S:2 * S], host[2 * S:]
    bad = False
    if iss.gidx.shape[1] and any(r == IndexRule.MINUS1_ONLY for r in rules):  # the -1-only range offsets
        bad, rest = rest[0] < -1 or rest[1] > 0, rest[2:]
    n_exact, kept, sink_nan = rest[:2 * nc:2], rest[1:2 * nc:2], rest[2 * nc:]
    # a given length may not pass the caller's K (padded columns must not admit it); with no lengths the
    # issued call's implied length is its own (padded) K
    limits = [s.idx.shape[1] if s.length is not None else p.idx.shape[1] for s, p in zip(segments, issued)]
    bad = bad or any(sink_nan) or any(v < 0 for v in lmin) or any(v > k for v, k in zip(lmax, limits))
    if bad:
        check_common(fn, vq, segments, scale, sink, d_v, chunk_tokens)  # raises the precise error
        raise AssertionError("fast_sparse_attention: deferred validation flagged an input that "
                             "check_common accepts")  # pragma: no cover - a bug, not an input error
    res, n_valid = owned if owned is not None else (iss.res, iss.n_valid)
    # rows with approximate logits: per chunk those that keep the fast logits and are not proven exact
    n_ap = [(t1 - t0) * H - e for e, (t0, t1) in zip(n_exact, spans)]  # where every row keeps them
    redo = [k != (t1 - t0) * H for k, (t0, t1) in zip(kept, spans)]
    if any(redo):
        coef, _, (zero, _, one) = iss.keep[0][:3]
        table = iss.table if isinstance(iss.table, torch.Tensor) else iss.table()[0]
        vfin = vmax_finite(table, d_v)
        lonely = iss.lonely if iss.lonely is not None else iss.n_valid.view(T, 1, 1) == 0
        valid = iss.valid.view(torch.bool)  # uint8 where the layout kernel wrote it
        single = nc == 1
        parts = list(iss.parts)
        for i, (t0, t1) in enumerate(spans):
            if redo[i]:
                parts[i], approx = _chunk_ordered(
                    table, vfin, _part(iss.gidx, t0, t1, single), _part(valid, t0, t1, single),
                    _part(lonely, t0, t1, single), _part(q, t0, t1, single), sc, d_v, iss.tests[i], zero, want_abs)
                n_ap[i] = float(approx.sum())
        res = _finish_any(parts, lonely, iss.n_valid, sink, iss.keep[0], iss.finish_kernel)
    n_ap = sum(n_ap)
    (out, lse, lws, m, pv), (b_lse, b_lws, b_max, b_out) = res
    bound = {"out": b_out.expand(T, H, out.shape[2]), "lse": b_lse, "lse_with_sink": b_lws, "max_logits": b_max}
    Tr = vq.shape[0]  # padded tokens are lonely rows: they count no approximate logits
    res = FastOracleOut(out, lse, lws, m, n_valid, bound, (1.0 - n_ap / (Tr * H)) if Tr * H else 1.0, pv)
    return res if Tr == T else _first_tokens(res, Tr)


def _static_segments(static: list, rules) -> list:
    """The segments held by a graph's static inputs (``fast_buckets.flat_signature``'s order: q, sink,
    then rows, indices and lengths per segment), with their index rules."""
    return [Segment(*static[2 + 3 * i:5 + 3 * i], r) for i, r in enumerate(rules)]


def _first_tokens(r: FastOracleOut, T: int) -> FastOracleOut:
    """``r`` restricted to its first ``T`` tokens (views; a bucketed call's own tokens)."""
    return FastOracleOut(r.out[:T], r.lse[:T], r.lse_with_sink[:T], r.max_logits[:T], r.n_valid[:T],
                         {k: v[:T] for k, v in r.bound.items()}, r.exact_logits,
                         None if r.pv_abs is None else r.pv_abs[:T])


def _graph_bytes(spans, T: int, H: int, K: int, D: int, d_v: int, itemsize: int, n_rows: int, sig: tuple,
                 want_abs: bool = False, fused: bool = False) -> int:
    """Estimated device bytes a captured call holds (``fast_graphs``): its static inputs (``sig``: their
    ``fast_graphs.signature``), the largest chunk's ``peak_bytes_estimate_fast``, and the per-call
    terms that estimate's docstring lists (table, statistics and their temporaries, outputs and
    bounds); ``fused``: plus the fused kernels' float64 copy of the table (``fast_fused.table64``)."""
    c = max(t1 - t0 for t0, t1 in spans)
    rows = n_rows + 1 + T * H
    inputs = sum(math.prod(shape) * dt.itemsize for shape, dt in (x for x in sig if x is not None))
    stats = 24 * rows + min(STAT_BYTES, rows * D * (STAT_PER_ELEM_BF16 if itemsize == 2 else STAT_PER_ELEM))
    return (inputs + peak_bytes_estimate_fast(c, H, max(K, 1), D, d_v, itemsize, want_abs) + rows * D * itemsize
            + stats + T * ((3 if want_abs else 2) * H * d_v + 12 * H) * 8 + (rows * D * 8 if fused else 0))


def _triton_option(fn: str, arg: str, value: bool | None, default_on, what: str, dev: torch.device) -> bool:
    """A Triton backend option of ``fast_sparse_attention`` resolved: ``None`` -> ``default_on(dev)``;
    ``True`` needs Triton on ``dev`` (``fast_fused.available``), else an error naming ``arg`` and
    the reason."""
    if value is None:
        return default_on(dev)
    if value:
        ok, why = fast_fused.available(dev)
        if not ok:
            fail(fn, arg, f"True needs {what}: {why}")
    return value


def fast_sparse_attention(q: torch.Tensor, segments: list, scale: float, sink: torch.Tensor | None = None,
                          d_v: int | None = None, nan_policy: NanPolicy | str = NanPolicy.PROPAGATE,
                          chunk_tokens: int | None = None, graph: bool | None = None,
                          bucket: bool | None = None, want_abs: bool = False,
                          fused: bool | None = None, passes: bool | None = None) -> FastOracleOut:
    """Fast judging oracle (``fast_bound``: derivation of ``bound``). Arguments, validation
    and conventions as ``attention.sparse_attention`` (mode EXACT only). ``graph``: replay the
    device work as a CUDA graph (``fast_graphs``): ``None`` (default) once the same call signature
    (shapes, dtypes, rules, scale, options, device) comes again on a CUDA device and graphs are
    enabled (``fast_graphs.set_enabled``, ``DSV4_FAST_GRAPHS=0``), ``False`` never, ``True`` from
    the first call on CUDA. The results are the same tensors either way (fresh, owned by the
    caller); a replay skips the host's per-kernel launch cost. ``bucket``: pad the call to its
    shape bucket (``fast_buckets``: tokens, columns and rows per segment; invalid padding, so the
    result is within the padded call's bound of the ordered oracle of this call) so that nearby
    shapes share one graph: ``None`` (default) on a CUDA device wherever a graph may be used,
    ``True`` always (also on the CPU), ``False`` never. ``want_abs``: also return ``pv_abs``
    (``FastOracleOut``; one more GEMM per chunk, bfloat16 from a bfloat16 table, else float64).
    ``fused``: steps 1-3 and ``N`` by two Triton kernels per chunk (``fast_fused``; the same bound):
    ``None`` (default) only where ``DSV4_FUSED_JUDGE=1`` asks for them (a CUDA device, Triton
    importable, the float64 table within ``fast_fused.TABLE64_BYTES``; off otherwise: slower than
    this path at production decode batch 128 on an H200, ``fast_fused``'s "Speed");
    ``True`` always (a CUDA device, or the CPU under ``TRITON_INTERPRET=1``; else an error naming
    the reason); ``False`` never (the PyTorch path). ``passes``: the memory-bound passes around the
    cuBLAS GEMMs (row statistics, gather, softmax, steps 4-7) by Triton kernels (``fast_passes``; the
    same bound): ``None`` (default) on a CUDA device where Triton is importable unless
    ``DSV4_FAST_PASSES=torch``; ``True`` always (a CUDA device, or the CPU under
    ``TRITON_INTERPRET=1``; else an error naming the reason); ``False`` never. Ignored where the fused
    kernels run."""
    fn = "fast_sparse_attention"
    T, H, D, rules, sc, d_v = check_host(fn, q, segments, scale, sink, d_v, chunk_tokens)
    nan_policy = check_enum(fn, "nan_policy", NanPolicy, nan_policy)
    for arg, v in (("graph", graph), ("bucket", bucket), ("fused", fused), ("passes", passes)):
        if v is not None and not isinstance(v, bool):
            fail(fn, arg, f"must be None, True or False, got {v!r}")
    if not isinstance(want_abs, bool):
        fail(fn, "want_abs", f"must be True or False, got {want_abs!r}")
    dev = q.device
    explicit = fused is not None
    fused = _triton_option(fn, "fused", fused, fast_fused.default_on, "the fused kernels", dev)
    passes = _triton_option(fn, "passes", passes, fast_passes.default_on, "the Triton passes", dev)
    K = sum(s.idx.shape[1] for s in segments)
    if T == 0:
        check_common(fn, q, segments, scale, sink, d_v, chunk_tokens)  # sink values
        e2 = torch.empty(0, H, dtype=torch.float64, device=dev)
        e3 = torch.empty(0, H, d_v, dtype=torch.float64, device=dev)
        return FastOracleOut(e3, e2, e2, e2, torch.empty(0, dtype=torch.int32, device=dev),
                             {"out": e3, "lse": e2, "lse_with_sink": e2, "max_logits": e2}, 1.0,
                             e3 if want_abs else None)
    if bucket is None:
        bucket = dev.type == "cuda" and graph is not False and (graph is True or fast_graphs.CACHE.enabled)
    orig = (q, segments) if bucket else None
    padded = None
    if bucket:  # the padded call's shapes (``fast_buckets``); its tensors are built only where needed
        padded = T, shapes = fast_buckets.padded_shapes(T, segments)
        K = sum(k for _, k in shapes)
    itemsize = table_dtype(segments, q).itemsize
    if fused and not explicit:  # the default takes the fused kernels where their float64 table fits
        fused = (sum(s.rows.shape[0] for s in segments) + 1 + T * H) * D * 8 <= fast_fused.TABLE64_BYTES
    spans = _spans(T, H, K, D, d_v, itemsize, dev, chunk_tokens, want_abs)
    if dev.type == "cuda" and graph is not False:
        sig = fast_buckets.flat_signature(q, sink, segments, bucket, padded)
        key = (str(dev), sig, tuple(rules), sc, d_v, nan_policy, tuple(spans), want_abs, fused, passes)
        vq, vsegs = q, segments

        def flat():  # the (padded) call's tensors: built only to capture
            qp, sp = fast_buckets.pad_call(vq, vsegs) if bucket else (vq, vsegs)
            return [qp, sink] + [t for s in sp for t in (s.rows, s.idx, s.length)]

        def fill(st, written):
            return fast_buckets.write_padded(st, vq, sink, vsegs, written)

        def nbytes():
            return _graph_bytes(spans, T, H, K, D, d_v, itemsize, sum(sh[0][0] for sh in sig[2::3]), sig, want_abs,
                                fused)

        def issue(st):
            qs, ss = st[0], st[1]
            return _issue(qs, _static_segments(st, rules), rules, ss, sc, d_v, nan_policy, spans, pack=True,
                          want_abs=want_abs, fused=fused, passes=passes)

        with fast_graphs.LOCK:
            hit = fast_graphs.CACHE.replay(key, flat, nbytes, issue, fill, always=graph is True)
            if hit is not None:  # the static inputs hold the (padded) call until the next replay
                iss, st = hit
                # the host vector first, into pinned memory, then the copies of the outputs: the host
                # waits for the replay only, and finishes the call while the GPU copies
                if iss.pinned is None:
                    iss.pinned = torch.empty(iss.host.shape, dtype=iss.host.dtype, pin_memory=True)
                iss.pinned.copy_(iss.host, non_blocking=True)
                read = torch.cuda.Event()
                read.record(torch.cuda.current_stream(dev))  # the copy's stream (q's device), not the current device's
                owned = _owned(iss)  # issued before the host waits: they overlap the replay
                read.synchronize()
                return _complete(fn, st[0], _static_segments(st, rules), rules, scale, sc, sink, d_v, chunk_tokens,
                                 iss, iss.pinned.tolist(), owned=owned, orig=(vq, vsegs), want_abs=want_abs)
    if bucket:
        q, segments = fast_buckets.pad_call(q, segments)
    args = (fn, q, segments, rules, scale, sc, sink, d_v, chunk_tokens)
    iss = _issue(q, segments, rules, sink, sc, d_v, nan_policy, spans, want_abs=want_abs, fused=fused, passes=passes)
    return _complete(*args, iss, iss.host.tolist(), orig=orig, want_abs=want_abs)
