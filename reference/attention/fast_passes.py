"""Triton kernels for the fast oracle's memory-bound passes, around cuBLAS's float64 GEMMs.

On a GPU the fast oracle's PyTorch path (``fast._softmax_pv``) spends most of its time outside the
two float64 ``bmm`` calls: at production decode shapes, batch 128 on one H200 (h64 top-512 / h128
top-1024), the GEMMs took 0.23 / 0.66 ms of a 1.05 / 2.20 ms call; the rest was one-operation
passes over large tensors -- the table's row statistics (six kernels, 0.19 / 0.30 ms), the gather
and its bfloat16-to-float64 conversion (0.22 / 0.39 ms, the conversion through PyTorch's
non-vectorised cast kernel), the softmax's mask, max, subtract, ``exp`` and sum (five passes over
the ``[c, H, K]`` float64 logits, 0.07 / 0.32 ms), ``|V|`` and ``bf16(p)`` for ``pv_abs``, and
steps 4-7 in about twenty small kernels. Each kernel here does one of those jobs in one pass:

* ``layout``: the slot layout (validity, table row and count of valid slots per token), the
  deferred validation's flags and the start of the host vector the call's one sync reads
  (``fast.slot_layout`` and ``fast.layout_flags``: about twenty PyTorch operations), one read of
  the indices.
* ``gather_stats`` (bfloat16 rows of one or two segments, the usual decode and prefill call): each
  slot's row read from its segment (no table is built), written as float64 (and ``|V|`` for
  ``pv_abs``) with its row statistics (``fast_rows.row_stats``, per slot: the same values the
  table's row gives), and q's rows converted with theirs by the same kernel.
* ``layout(rows=...)``: the two above in one launch (``layout_gather_kernel``) -- the layout, q's rows
  and the first chunk's slot rows; each gathering program computes its own slots' table rows with the
  layout's rule (``_slot``), so no program reads what another writes. An eager call then issues one
  Triton launch before its first heavy kernel instead of three (the other chunks' rows, where a
  call has several, are gathered by ``gather_stats``).
* ``row_stats`` (other bfloat16 tables): ``fast_rows.row_stats`` in one read of the table.
* ``gather``: the chunk's slot rows as float64 straight from the table's dtype (and ``|V|`` in that
  dtype for ``pv_abs``), one read of the rows and one write.
* ``softmax``: the scaled, masked logits' max, ``p = exp(s - m)`` written over the logits, ``L =
  sum p`` (and ``bf16(p)`` for ``pv_abs``), two reads of the logits and one write.
* steps 4-7 and the bounds: ``fast_fused.finish`` (one launch; its analysis is in ``fast_fused``).

The GEMMs stay cuBLAS's (``N = bmm(p, V)``; ``pv_abs``: the bfloat16 ``bmm`` of ``bf16(p)`` and
``|V|``, as in the PyTorch path).

Why ``fast_bound``'s bound holds unchanged (its steps; nothing is widened):

- Row statistics (step 1's test and ``x``): the bfloat16 squares are exact in float64 and summed
  there in any order, then rounded once to float32: within ``(D - 1) 2**-53 + 2**-24`` relative of
  the exact sum, inside the ``g32_D`` that ``norm_factor`` allows for any float32-or-wider order;
  ``sqrt_rn`` and ``+ floor`` round once each, as ``row_stats`` states. The lsb exponent is read from
  the 16 bits exactly (the power of two ``sig & -sig`` converted to float32, its exponent field).
  ``log2 n - lsb`` is evaluated in float64 (libdevice's ``log2``) and rounded once to float32:
  within ``2**-15`` of its exact value for every finite bfloat16 row, inside ``exact_bits``' ``2**-12``
  margin. ``max |x_j|`` is exact (NaN where a value is NaN).
- Gather: a bfloat16, float16 or float32 value converts to float64 exactly. The layout is
  integer arithmetic; its flags are minima and maxima and its counts sums of integers, so the
  atomics that combine them give the same values in any order.
- Logits (step 1): cuBLAS's ``bmm`` as before, then ``fl(scale s) + 0`` once (no FMA contraction:
  the kernel is compiled with ``enable_fp_fusion=False``, so a ``-0`` logit turns ``+0`` as the
  PyTorch path's mask addition does and the max equals the ordered oracle's on exact rows).
- Step 2: one float64 subtraction and libdevice's ``exp`` (``__nv_exp``, within 2 ulps: ``eps_e``;
  NumPy's under the interpreter). Step 3: ``L`` summed in float64, a tree inside blocks of ``BK``
  slots and the blocks in sequence: an order the step's ``g_K`` covers. The max is final before any
  ``exp`` (no online rescale).
- ``pv_abs``: ``bf16(p)`` from float64 through float32 (RNE twice), as PyTorch's conversion does, so
  ``bf16_abs_factor`` applies as before.

Rows whose logits must be the ordered oracle's (NaN/Inf, extreme magnitudes) are found by the same
row tests; their chunk is recomputed by ``fast._chunk_ordered`` (PyTorch) as before.

Where: on a CUDA device with Triton importable, by default (``fast_sparse_attention(passes=None)``);
``DSV4_FAST_PASSES=torch`` keeps the PyTorch passes; on the CPU only under ``TRITON_INTERPRET=1``
with ``passes=True`` (the tests). Triton is imported on the first call that uses them, never at the
fast oracle's import. Speed and memory: the performance page (``python -m dsv4_numerics.bench.gpu``
times both paths side by side); the tensors are those of the PyTorch path (the gathered float64
rows, the logits, ``|V|`` and ``bf16(p)`` for ``pv_abs``), within ``fast.peak_bytes_estimate_fast``.
"""
from __future__ import annotations

import functools
import math
import os

import torch

from .fast_fused import available, interpreter_index_shim, kernel_mode, triton_importable
from .fast_rows import bf16_norm_floor

__all__ = ["ENV", "BLOCKS", "available", "block", "default_on", "gather", "gather_stats", "gathers", "kernels",
           "layout", "row_stats", "softmax"]

ENV = "DSV4_FAST_PASSES"  # "torch": the fast oracle's default keeps its PyTorch passes
# (rows, dims, warps) of the statistics and gather kernels (gather_stats: of the slots' rows, of q's rows, of the
# slots' rows without |V|); (heads, slots, warps) of the softmax kernel; (slots, warps) of the layout kernel;
# (rows, dims, warps) of the layout with the gathers in one launch, with and without |V| (its layout programs take
# the layout's slots). Chosen by timing CUDA-graph replays of each kernel alone at production decode shapes (batch
# 128, h64 top-512 and h128 top-1024) on one H200; the variants without |V| (or bf16(p)) ran up to 1.8x slower at
# the blocks of those with it, hence their own
BLOCKS = {"stats": (2, 512, 1), "gather": (4, 512, 4), "gather_stats": (4, 256, 4), "gather_stats_q": (2, 512, 2),
          "gather_stats_plain": (1, 512, 2), "softmax": (4, 256, 4), "layout": (256, 4), "layout_gather": (4, 256, 4),
          "layout_gather_plain": (1, 256, 1)}
_GATHER_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def default_on(device: torch.device) -> bool:
    """Whether ``fast_sparse_attention(passes=None)`` takes these kernels: a CUDA device, Triton
    importable, and ``DSV4_FAST_PASSES`` not ``torch``."""
    return (device.type == "cuda" and os.environ.get(ENV, "").strip().lower() != "torch"
            and triton_importable())


@functools.lru_cache(maxsize=1)
def kernels():
    """``(triton, fast_passes_kernels)`` (compiled per signature on first launch). Imports Triton."""
    if kernel_mode():
        interpreter_index_shim()
    import triton

    from . import fast_passes_kernels as pk

    return triton, pk


def block(n: int, cap: int) -> int:
    """A Triton block size for ``n`` elements: the power of two covering ``n``, at least 16, at most
    ``cap`` (a power of two >= 16)."""
    return max(16, min(cap, 1 << max(0, n - 1).bit_length()))


def row_stats(rows: torch.Tensor, d_v: int) -> torch.Tensor:
    """``fast_rows.row_stats`` of a contiguous 2-D bfloat16 table ``[N, D]``: ``[3, N]`` float32
    (norm, ``log2 n - lsb``, ``max |x_j|`` over ``j < d_v``), one kernel launch."""
    triton, pk = kernels()
    N, D = rows.shape
    st = torch.empty(3, N, dtype=torch.float32, device=rows.device)
    if N == 0:
        return st
    br, bd, w = BLOCKS["stats"]
    floor = bf16_norm_floor(D)
    pk.row_stats_bf16_kernel[(triton.cdiv(N, br),)](rows, st, N, D, d_v, floor, INTERP=kernel_mode(), BR=br,
                                                    BD=block(D, bd), num_warps=w)
    return st


def gather(table: torch.Tensor, gflat: torch.Tensor, c: int, d_v: int, want_abs: bool):
    """``(g, ga)``: the chunk's slot rows ``table[gflat]`` as float64 ``[c, K, D]`` (exact) and, with
    ``want_abs``, ``|table[gflat, :d_v]|`` in the table's dtype ``[c, K, d_v]`` (else None). ``table``
    contiguous ``[R, D]`` of a dtype in ``_GATHER_DTYPES``, ``gflat`` ``[c*K]`` int64 rows in range."""
    triton, pk = kernels()
    S = gflat.numel()
    D = table.shape[1]
    g = torch.empty(S, D, dtype=torch.float64, device=table.device)
    ga = torch.empty(S, d_v, dtype=table.dtype, device=table.device) if want_abs else None
    if S:
        br, bd, w = BLOCKS["gather"]
        pk.gather_kernel[(triton.cdiv(S, br),)](table, gflat, g, ga if want_abs else g, S, D, d_v,
                                                IS_BF16=table.dtype == torch.bfloat16, WANT_ABS=want_abs, BR=br,
                                                BD=block(D, bd), num_warps=w)
    return g.view(c, -1, D), (ga.view(c, -1, d_v) if want_abs else None)


def gather_stats(rows: list, idx: torch.Tensor | None, lead: tuple, d_v: int, want_abs: bool, zrow: int,
                 scrub: bool):
    """``gather`` and ``row_stats`` in one kernel, reading the segments' bfloat16 rows themselves
    (``fast_passes_kernels.gather_stats_kernel``): ``(g, ga, st)`` -- ``[*lead, D]`` float64 rows,
    ``|rows[..., :d_v]|`` in bfloat16 ``[*lead, d_v]`` (``want_abs``, else None) and their ``[3,
    count]`` float32 statistics (``fast_rows.row_stats`` of each gathered row), ``count`` the product
    of ``lead`` (the rows' leading shape, e.g. ``(c, K)``: the kernel writes them flat, row after
    row). ``rows``: one or two bfloat16 ``[N_s, D]`` tensors (unit column stride) standing for the
    table ``[rows_0; rows_1; zero row]``;
    ``idx``: ``[count]`` table rows (``zrow``, or anything outside the rows, reads zeros), or None for
    rows ``0 .. count - 1`` of ``rows[0]``; ``scrub``: NaN read as 0 (``NanPolicy.SCRUB``)."""
    triton, pk = kernels()
    D = rows[0].shape[1]
    g, ga, st = _gathered(rows[0], lead, d_v, want_abs)
    count = st.shape[1]
    if count:
        br, bd, w = BLOCKS["gather_stats_q" if idx is None else "gather_stats" if want_abs else "gather_stats_plain"]
        floor = bf16_norm_floor(D)
        pk.gather_stats_kernel[(triton.cdiv(count, br),)](
            *_sources(rows), idx if idx is not None else g, g, ga if want_abs else g, st, count, D, d_v, zrow, floor,
            IDENT=idx is None,
            TWO=len(rows) > 1, SCRUB=scrub, WANT_ABS=want_abs, INTERP=kernel_mode(), BR=br, BD=block(D, bd),
            num_warps=w)
    return g, ga, st


def _sources(rows: list) -> tuple:
    """The gathering kernels' ``(A, s0, N0, B, s1, N1)`` for one or two bfloat16 ``[N_s, D]`` row
    tensors: each with its row stride and row count (``B`` is ``A`` with no rows where there is one)."""
    a = rows[0]
    b = rows[1] if len(rows) > 1 else a
    return a, a.stride(0), a.shape[0], b, b.stride(0), b.shape[0] if len(rows) > 1 else 0


def gathers(table: torch.Tensor) -> bool:
    """Whether ``gather`` takes this table's dtype."""
    return table.dtype in _GATHER_DTYPES


def layout(idx: torch.Tensor, K: int, lens: torch.Tensor, lens_at: tuple, cc: torch.Tensor, S: int, zrow: int,
           hv: torch.Tensor, hv_w: int | None, sink_bits: torch.Tensor | None, hv_sink: int, sink_nan: tuple = (0, 0),
           rows=None):
    """``fast.slot_layout`` and ``fast.layout_flags`` in one kernel launch (``fast_passes_kernels.layout_kernel``):
    ``(valid, gidx, n_valid)`` -- ``[T, K]`` uint8 (1: valid), ``[T, K]`` int64 table rows (``zrow``
    for invalid slots), ``[T]`` int32 -- with the validation flags written into the int64 host vector
    ``hv`` (which holds their neutral values): the lengths' per-segment minima ``hv[0:S]`` and maxima
    ``hv[S:2S]``, and where ``hv_w`` is not None the -1-only columns' range offsets' minimum and maximum
    at ``hv[hv_w]``, ``hv[hv_w + 1]``; per value of ``sink_bits`` (the contiguous sink viewed as the integer
    dtype of its width, or None) whether it is NaN (1, else 0) at ``hv[hv_sink:]`` (``sink_nan``: its format's
    ``(magnitude mask, exponent mask)``; NaN iff ``bits & magnitude > exponent``; Triton's CPU interpreter
    compares bfloat16 values by their bits, so a float comparison would miss a bfloat16 NaN there). ``idx``: the slot
    indices, its first ``K`` columns ``[T, K]`` (row-strided), ``lens`` with ``lens_at = (row stride,
    first column)``: each token's ``S`` lengths, ``cc``: ``[5, K']`` int64 column constants, ``K' >= K``
    (``fast._column_constants``).

    ``rows``: also, in the same launch (``layout_gather_kernel``), q's rows and the first ``c`` tokens'
    slot rows gathered with their statistics, as ``gather_stats`` gathers them: ``(q2, (T, H), segs, c,
    d_v, want_abs, scrub)`` -- q as ``[T H, D]`` bfloat16 rows and its leading shape, the one or two
    segments' bfloat16 ``[N_s, D]`` rows, the first chunk's token count, ``d_v``, ``|V|`` of the slots,
    ``NanPolicy.SCRUB`` -- and the return value is ``(valid, gidx, n_valid, (q64, qst), (g, ga, st))``
    with ``gather_stats``' outputs for q (``q64`` ``[T, H, D]`` float64, ``qst`` ``[3, T H]``) and the
    slots (lead ``(c, K)``)."""
    triton, pk = kernels()
    T = idx.shape[0]
    dev = idx.device
    valid = torch.empty(T, K, dtype=torch.uint8, device=dev)
    gidx = torch.empty(T, K, dtype=torch.int64, device=dev)
    nv = torch.empty(T, dtype=torch.int32, device=dev)
    bk, w = BLOCKS["layout"]
    ns = 0 if sink_bits is None else sink_bits.numel()
    lay = (idx, idx.stride(0), lens, lens_at[0], lens_at[1], cc, cc.stride(0), valid, gidx, nv, hv,
           sink_bits if sink_bits is not None else hv, K, S, zrow, hv_w or 0, hv_sink, ns, *sink_nan)
    flags = dict(HAS_M1=hv_w is not None, HAS_SINK=sink_bits is not None, BK=block(K, bk),
                 BS=max(2, triton.next_power_of_2(S)))
    if rows is None:
        pk.layout_kernel[(T,)](*lay, **flags, num_warps=w)
        return valid, gidx, nv
    q2, q_lead, segs, c, d_v, want_abs, scrub = rows
    (q64, _, qst), (g, ga, st) = (_gathered(q2, q_lead, d_v, False), _gathered(segs[0], (c, K), d_v, want_abs))
    br, bd, gw = BLOCKS["layout_gather" if want_abs else "layout_gather_plain"]
    QR, CS = q2.shape[0], c * K
    nq = triton.cdiv(QR, br)
    pk.layout_gather_kernel[(T + nq + triton.cdiv(CS, br),)](
        *lay, T, nq, q2, q2.stride(0), QR, q64, qst, *_sources(segs), g, ga if want_abs else g, st, CS, q2.shape[1],
        d_v, bf16_norm_floor(q2.shape[1]), **flags, TWO=len(segs) > 1, SCRUB=scrub, WANT_ABS=want_abs,
        INTERP=kernel_mode(), BR=br, BD=block(q2.shape[1], bd), num_warps=gw)
    return valid, gidx, nv, (q64, qst), (g, ga, st)


def _gathered(like: torch.Tensor, lead: tuple, d_v: int, want_abs: bool) -> tuple:
    """``gather_stats``' outputs for rows of ``like``'s width in the leading shape ``lead`` (``count``
    rows, its product), uninitialised: ``[*lead, D]`` float64, ``[*lead, d_v]`` bfloat16
    (``want_abs``, else None), ``[3, count]`` float32."""
    dev, D = like.device, like.shape[1]
    count = math.prod(lead)
    return (torch.empty(*lead, D, dtype=torch.float64, device=dev),
            torch.empty(*lead, d_v, dtype=torch.bfloat16, device=dev) if want_abs else None,
            torch.empty(3, count, dtype=torch.float32, device=dev))


def softmax(s: torch.Tensor, valid: torch.Tensor, fconst: torch.Tensor, want_pb: bool, tests=None,
            counts: tuple | None = None, qstats: torch.Tensor | None = None):
    """Steps 1-3's elementwise part on raw logits ``s`` ``[c, H, K]`` float64 contiguous (the
    ``bmm`` of q and the rows; consumed: ``p`` is written over it): ``(p, m, L, pb, rt)`` with
    ``m``, ``L`` ``[c, H, 1]`` float64, ``pb`` ``bf16(p)`` ``[c, H, K]`` (``want_pb``, else None).
    ``valid`` ``[c, K]`` bool, ``fconst`` ``fast._constants``' float64 ``(scale, ...)`` tensor.
    ``tests``: ``(stats, gidx, q0, lim4)`` -- the table's ``row_stats`` ``[3, R]``, the chunk's
    ``[c, K]`` int64 table rows, the table row of the chunk's first q row, ``fast._constants``'
    ``(la, le, 0, exact_bits)`` -- to compute ``fast._row_tests`` in the same kernel: ``rt`` is
    then its ``(x, vmax, both)`` (``both`` uint8, 1: true), else None. ``counts`` (with ``tests``): ``(hv, o)``,
    the chunk's counts of rows with proven-exact logits and of rows that keep the fast logits added
    to the int64 ``hv[o]`` and ``hv[o + 1]``. ``valid``: bool, or uint8 (1: valid). ``qstats``: the
    statistics are per slot (``gather_stats``): ``tests``' ``stats`` then holds the chunk's ``c K``
    slots' ``[3, c K]`` (its ``gidx`` is not read) and ``qstats`` q's rows' ``[3, RQ]``, the chunk's
    first at ``q0``."""
    triton, pk = kernels()
    c, H, K = s.shape
    dev = s.device
    m = torch.empty(c, H, 1, dtype=torch.float64, device=dev)
    L = torch.empty_like(m)
    pb = torch.empty(c, H, K, dtype=torch.bfloat16, device=dev) if want_pb else None
    rt = None
    if tests is not None:
        stats, gidx, q0, lim4 = tests
        x = torch.empty(c, H, 1, dtype=stats.dtype, device=dev)
        ks = torch.empty(3, c, 1, 1, dtype=stats.dtype, device=dev)
        both = torch.empty(2, c, H, 1, dtype=torch.uint8, device=dev)
        targs = (gidx, stats, stats.shape[1], lim4, x, ks, both, q0)
    else:
        targs = (s, s, 0, s, s, s, s, 0)
    hv, hvo = counts if counts is not None else (s, 0)
    qst = qstats if qstats is not None else targs[1]
    v8 = valid if valid.dtype == torch.uint8 else valid.view(torch.uint8)
    bh, bk, w = BLOCKS["softmax"]
    pk.softmax_kernel[(c, triton.cdiv(H, bh))](
        s, v8, m, L, pb if want_pb else s, fconst, H, K, *targs, c, hv, hvo, qst,
        targs[2] if qstats is None else qstats.shape[1], WANT_PB=want_pb, TESTS=tests is not None,
        COUNT=counts is not None and tests is not None, SLOT_STATS=qstats is not None, INTERP=kernel_mode(), BH=bh,
        BK=block(K, bk), num_warps=w, enable_fp_fusion=False)
    if tests is not None:
        rt = (x, ks[2], both)
    return s, m, L, pb, rt
