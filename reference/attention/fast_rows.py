"""The fast oracle's row statistics: per row of its table (every segment's rows, a zero row, q's
rows) a norm, the least-significant-bit exponent and ``max |x|``, from which ``fast._row_tests``
decides which (token, head) rows have exact logits (``fast_bound``, step 1) and bounds the rest."""
from __future__ import annotations

import math

import torch

__all__ = ["BF16_LUT", "NO_LSB_BF16", "STAT_BYTES", "STAT_PER_ELEM", "STAT_PER_ELEM_BF16", "bf16_norm_floor",
           "row_stats", "vmax_finite"]

_NO_LSB = 1 << 20  # lsb exponent of a zero value in a float64 table ("none")
NO_LSB_BF16 = 1 << 14  # the same in the bfloat16 lookup (float32; any value > 127 works)
STAT_BYTES = 2**30  # temporaries of one piece of the row statistics
STAT_PER_ELEM = 56  # bytes per table element of the statistics temporaries (float64 copy, int64 bits, ...)
STAT_PER_ELEM_BF16 = 14  # bfloat16 tables: int32 lookup index, int16 lookup result, float32 norm input


BF16_LUT: dict = {}


def _lsb_exp(x: torch.Tensor) -> torch.Tensor:
    """int64 exponent of the least significant set bit of each float64 ``x`` (``_NO_LSB`` for
    zeros; NaN/Inf give garbage and are excluded by the caller's finiteness test)."""
    bits = x.view(torch.int64) & 0x7FFFFFFFFFFFFFFF
    ef = bits >> 52
    man = bits & 0x000FFFFFFFFFFFFF
    sig = torch.where(ef > 0, man | (1 << 52), man)
    low = (sig & (-sig)).to(torch.float64)  # a power of two (exact)
    _, e = torch.frexp(low)
    lsb = (e.to(torch.int64) - 1) + torch.where(ef > 0, ef - 1075, torch.full_like(ef, -1074))
    return torch.where(sig == 0, torch.full_like(lsb, _NO_LSB), lsb)


def _lsb_exp_bf16_bits(x: torch.Tensor) -> torch.Tensor:
    """int32 lsb exponent of each bfloat16 ``x`` read from its 16 bits: a finite bf16 is
    ``sig * 2**(ef - 134)`` (normal: ``sig = 0x80 | man``, ``ef >= 1``) or ``man * 2**-133``
    (subnormal); ``NO_LSB_BF16`` for zeros, garbage for NaN/Inf (excluded by the caller)."""
    b = x.view(torch.int16).to(torch.int32) & 0x7FFF
    ef = b >> 7
    sig = torch.where(ef > 0, (b & 0x7F) | 0x80, b)
    _, e = torch.frexp((sig & (-sig)).to(torch.float32))  # a power of two <= 2**7 (exact)
    lsb = e - 1 + torch.clamp(ef, min=1) - 134
    return torch.where(sig == 0, NO_LSB_BF16, lsb)


def _bf16_lut(dev: torch.device) -> torch.Tensor:
    """int16 ``[2**16]``: ``-lsb`` of each bfloat16 bit pattern (as uint16; ``_lsb_exp_bf16_bits``,
    ``-NO_LSB_BF16`` for zeros, garbage for NaN/Inf). Built once per device."""
    lut = BF16_LUT.get(dev)
    if lut is None:
        pat = torch.arange(2**16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
        lut = BF16_LUT[dev] = (-_lsb_exp_bf16_bits(pat)).to(torch.int16).to(dev)
    return lut


def bf16_norm_floor(D: int) -> float:
    """The power of two ``2**(ceil(log2 sqrt D) - 75)`` added to a bfloat16 row's float32 norm
    (``row_stats``): it covers the float32 squares' underflow, ``sqrt(D) 2**-75``; exact in float32."""
    return 2.0 ** (math.ceil(math.log2(math.sqrt(D))) - 75)


def vmax_finite(rows: torch.Tensor, d_v: int) -> torch.Tensor:
    """``[N]`` ``max |x_j|`` over the finite values of the first ``d_v`` dims of each table row
    (``_chunk_ordered``'s ``V_j``), in pieces of ``STAT_BYTES`` of temporaries."""
    step = max(1, STAT_BYTES // (max(1, d_v) * rows.element_size()))
    pieces = [torch.linalg.vector_norm(rows[r0:r0 + step, :d_v].nan_to_num(nan=0.0, posinf=0.0, neginf=0.0),
                                       ord=math.inf, dim=1) for r0 in range(0, rows.shape[0], step)]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def row_stats(rows: torch.Tensor, d_v: int) -> torch.Tensor:
    """``[3, N]`` per row of a 2-D table (read as it is: the caller scrubs NaN where the policy
    says so), float32 for a bfloat16 table, else float64: a norm ``n`` with ``||x||_2 <= c_D n``
    (``norm_factor``), ``log2(n) - lsb`` (``lsb``: the least-significant-bit exponent, min over the
    dims; a zero row gives a very negative value) and ``max_j |x_j|`` over the first ``d_v`` dims
    (NaN/Inf on a row with a non-finite value, whose norm is non-finite too: every
    token that reads the row takes the ordered path, ``_chunk_ordered``, which takes ``max |v|``
    over the finite values of its gathered rows). Pieces of ``STAT_BYTES`` of temporaries.

    bfloat16 table (one float32 norm, one lookup): ``n = fl32(||x||_fl32 + 2**(ceil(log2 sqrt D)
    - 75))``. A bfloat16 value squares exactly in float32 (16 significant bits) unless the square
    is below ``2**-126`` (absolute rounding ``<= 2**-150`` each: the power-of-two floor covers
    ``sqrt(D) 2**-75``) or overflows (``|x| >= 2**64``: ``n = inf``, the caller takes the ordered
    path, as for NaN/Inf). Any summation order (float32 or wider, then rounded to float32) is
    within ``g32_D`` relative, the square root and the floor's addition round once each:
    ``norm_factor``. The lsb: one lookup of the 16 bits (as uint16) in ``_bf16_lut`` (``-lsb``;
    the row's ``max`` is ``-min lsb``).

    Other tables (float64 arithmetic): ``torch.linalg.vector_norm(dtype=float64)``, plus ``sqrt(D)
    2**-537`` (float64 squares can underflow), within ``1 + 2**-30 <= c_D``; the lsb from the
    float64 bits. NaN/Inf give a non-finite ``n``: the caller then takes the ordered path. Both
    ``log2(n) - lsb`` evaluations are within ``2**-12`` of their exact values (float32: ``log2`` 1
    ulp, two roundings), inside ``exact_bits``' margin."""
    N, D = rows.shape
    bf16 = rows.dtype == torch.bfloat16
    step = max(1, STAT_BYTES // (max(1, D) * (STAT_PER_ELEM_BF16 if bf16 else STAT_PER_ELEM)))
    st = torch.empty(3, N, dtype=torch.float32 if bf16 else torch.float64, device=rows.device)
    floor = bf16_norm_floor(D)
    for r0 in range(0, N, step):
        x = rows if step >= N else rows[r0:r0 + step]
        n, beta, vmax = st.unbind(0) if step >= N else st[:, r0:r0 + step].unbind(0)
        if bf16:
            torch.linalg.vector_norm(x, dim=1, dtype=torch.float32, out=n).add_(floor)
            bits = x.view(torch.uint16).to(torch.int32).view(-1)
            neg_lsb = _bf16_lut(x.device).index_select(0, bits).view(x.shape).amax(dim=1)  # -(min lsb)
            torch.log2(n, out=beta).add_(neg_lsb)
        else:
            x = x.to(torch.float64)
            torch.linalg.vector_norm(x, dim=1, out=n).add_(math.sqrt(D) * 2.0**-537)
            torch.log2(n, out=beta).sub_(_lsb_exp(x).amin(dim=1))
        torch.linalg.vector_norm(x if d_v == D else x[:, :d_v], ord=math.inf, dim=1, dtype=st.dtype, out=vmax)
    return st
