"""Deterministic float64 ``exp`` and ``log`` built from IEEE basic operations only.

Why: ``torch.exp``/``torch.log`` call different libraries on CPU (SLEEF / libm) and CUDA
(libdevice); their float64 results can differ in the last bit, so an oracle that must give the
same bits on every device cannot use them. These functions use only float64 ``+ - * /``,
``torch.round`` (exact), comparisons, integer bit manipulation and ``where``: every step is
correctly rounded (or exact) IEEE arithmetic, evaluated in a fixed order, so CPU and GPU produce
identical bits. Each arithmetic step is a separate eager torch op, so no FMA contraction can
occur. Accuracy: a few float64 ulps (relative error < 1e-15), far below every tolerance in use.

Owner: attention (used by ``attention.py`` and ``compressor.py``).
"""

from __future__ import annotations

import math

import torch

__all__ = ["det_exp", "det_log", "det_log1p_exp_neg", "pow2_int", "fixed_sum"]

_LOG2E = 1.4426950408889634  # fl64(1/ln 2)
# fdlibm's split of ln 2: LN2_HI has 32 significant bits, so k*LN2_HI is exact for |k| < 2**21.
_LN2_HI = 6.93147180369123816490e-01
_LN2_LO = 1.90821492927058770002e-10
# Taylor coefficients 1/n!, n = 13..0 (int -> float conversion exact, one correctly rounded division)
_EXP_COEF = [1.0 / math.factorial(n) for n in range(13, -1, -1)]
# atanh series coefficients 1/(2n+1), n = 12..0 (log(m) = 2 atanh(z), z = (m-1)/(m+1))
_LOG_COEF = [1.0 / (2 * n + 1) for n in range(12, -1, -1)]
_SQRT2 = 1.4142135623730951
_EXP_MAX = 709.782712893384  # above: overflow to +inf
_EXP_MIN = -745.1332191019412  # below: underflow to 0


def pow2_int(k: torch.Tensor) -> torch.Tensor:
    """Exact ``2.0**k`` (float64) for integer-valued ``k`` in ``[-1022, 1023]`` built from bits."""
    kk = k.to(torch.int64)
    return ((kk + 1023) << 52).view(torch.float64)


def det_exp(x: torch.Tensor) -> torch.Tensor:
    """``exp(x)`` for float64 ``x``; deterministic bits on every device.

    Range reduction ``x = k ln2 + r``, ``k = round(x / ln2)``, ``|r| <= 0.347`` (Cody-Waite with
    the two-part ln 2), degree-13 Taylor polynomial by Horner (truncation < 4e-18 relative),
    then an exact scaling by ``2**k`` done as two multiplications by normal powers of two (the
    second one is the only rounding when the result is subnormal). ``exp(-inf) = 0``,
    ``exp(+inf) = inf``, NaN propagates.
    """
    if x.dtype != torch.float64:
        raise TypeError("det_exp expects float64")
    xc = torch.clamp(x, _EXP_MIN - 1.0, _EXP_MAX + 1.0)  # keeps k in range; NaN stays NaN
    xs = torch.where(torch.isnan(xc), torch.zeros_like(xc), xc)
    k = torch.round(xs * _LOG2E)
    r = (xs - k * _LN2_HI) - k * _LN2_LO
    p = torch.full_like(r, _EXP_COEF[0])
    for c in _EXP_COEF[1:]:
        p = p * r
        p = p + c
    k1 = torch.div(k, 2, rounding_mode="floor")
    k2 = k - k1
    y = (p * pow2_int(k1)) * pow2_int(k2)
    y = torch.where(x > _EXP_MAX, torch.full_like(y, math.inf), y)
    y = torch.where(x < _EXP_MIN, torch.zeros_like(y), y)
    return torch.where(torch.isnan(x), x, y)


def det_log(y: torch.Tensor) -> torch.Tensor:
    """Natural ``log(y)`` for float64 ``y``; deterministic bits on every device.

    ``y = m * 2**e`` with ``m in [sqrt(1/2), sqrt(2))`` taken from the bits (subnormals are first
    scaled by ``2**54``, exact); ``log m = 2 atanh(z)``, ``z = (m-1)/(m+1)``, ``|z| <= 0.1716``,
    13-term odd series (truncation < 1e-19); ``log y = e*LN2_HI + (e*LN2_LO + log m)``.
    ``log(0) = -inf``, ``log(inf) = inf``, negative or NaN -> NaN.
    """
    if y.dtype != torch.float64:
        raise TypeError("det_log expects float64")
    pos_finite = (y > 0) & torch.isfinite(y)
    ys = torch.where(pos_finite, y, torch.ones_like(y))
    sub = ys < 2.2250738585072014e-308
    ys = torch.where(sub, ys * 18014398509481984.0, ys)  # * 2**54, exact
    bits = ys.view(torch.int64)
    e = ((bits >> 52) & 0x7FF) - 1023
    m = ((bits & 0x000FFFFFFFFFFFFF) | (1023 << 52)).view(torch.float64)  # [1, 2)
    big = m > _SQRT2
    m = torch.where(big, m * 0.5, m)
    e = e + big.to(torch.int64) - torch.where(sub, 54, 0)
    ef = e.to(torch.float64)
    z = (m - 1.0) / (m + 1.0)
    w = z * z
    s = torch.full_like(w, _LOG_COEF[0])
    for c in _LOG_COEF[1:]:
        s = s * w
        s = s + c
    logm = (2.0 * z) * s
    out = ef * _LN2_HI + (ef * _LN2_LO + logm)
    out = torch.where(y == 0, torch.full_like(out, -math.inf), out)
    out = torch.where(y == math.inf, torch.full_like(out, math.inf), out)
    out = torch.where((y < 0) | torch.isnan(y), torch.full_like(out, math.nan), out)
    return out


def det_log1p_exp_neg(d: torch.Tensor) -> torch.Tensor:
    """``log(1 + exp(-d))`` for float64 ``d >= 0`` (the softplus tail of a logaddexp)."""
    return det_log(1.0 + det_exp(-d))


def fixed_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum of all elements of ``x`` (0-dim, x's dtype) in a fixed pairwise order: the flattened
    tensor is zero-padded to a power of two and halved, ``v[:h] + v[h:]``, until one element is
    left. Only elementwise IEEE additions, so the bits are the same on every device, thread
    count, BLAS and torch version (``torch.sum`` picks its order per backend)."""
    v = x.reshape(-1)
    n = v.numel()
    if n == 0:
        return torch.zeros((), dtype=x.dtype, device=x.device)
    size = 1 << (n - 1).bit_length()
    if size != n:
        v = torch.cat([v, v.new_zeros(size - n)])
    while v.numel() > 1:
        h = v.numel() // 2
        v = v[:h] + v[h:]
    return v[0]
