"""The fast oracle's a-priori bound: how far ``fast.fast_sparse_attention`` may be from the ordered
oracle (``ordered.sparse_attention``), derived step by step, and its evaluation as one affine
function per output (``bound_coefficients``); the norm and exactness constants the row statistics
(``fast_rows``) are tested against; and the factor that makes ``pv_abs``' bfloat16 GEMM an upper bound.

Derivation (per token t, head h; ``u = 2**-53``, ``g_n = n u / (1 - n u)``, valid slots only):

1. Logits ``s~ = fl(bmm(q, K^T) * scale)``. Each q*k product of a bf16 q and a K value that is an
   FP8 code times a power of two (NoPE) or bf16 (RoPE, prefill rows) has <= 16 significant bits.
   If every product is a multiple of ``2**(lq + lk)`` (``lq``, ``lk``: the least-significant-bit
   exponents, minimum over the row's dims, of q[t,h] and K_k) and ``sum_d |q_d k_d| < 2**(53 + lq
   + lk)``, every product and partial sum is an exact float64 integer multiple of that unit, so
   the dot product is EXACT in any order (FMA or not): ``s~_k`` equals the ordered oracle's logit
   bit for bit. With ``sum |q_d k_d| <= A = ||q||_2 ||K_k||_2`` (Cauchy-Schwarz) the test is per
   row: ``alpha[t,h] + max_k beta[t,k] < exact_bits(D)`` (53 less the norms' upper-bound factor
   ``norm_factor(D)`` in bits, less a margin for evaluating the test in float32) with ``alpha =
   log2 n_q - lq``, ``beta = log2 n_k - lk`` (``n``: the computed norm, ``||x|| <= norm_factor(D)
   n``; norms and lsb exponents of q and of the table rows are computed once per call, float32
   for a bfloat16 table, then gathered, ``row_stats``: every use of a norm below only needs an
   upper bound, and ``A <= x_factor(D) x`` for the computed product ``x = fl(n_q max_k n_k)``).
   Elsewhere both the
   GEMM and the ordered d-loop are within ``g_D A`` of the exact dot product, and the two scale
   multiplications add ``u`` each: ``e_k = scale A (2 g_D + 4u)``, bounded per row by
   ``scale ||q|| max_k ||K_k|| (2 g_D + 4u)``. Logits whose ``A`` may be
   non-finite or above ``2**1000`` (NaN/Inf in q or a valid row, a bfloat16 value of magnitude
   ``>= 2**64`` whose float32 square overflows, overflow risk) make their whole (t, h) row
   recomputed by the ordered d-loop itself (bit-identical, so non-finite logits match), ``e_s =
   0`` there.
   ``e_s = max_k e_k``; ``max_logits``: ``|m~ - m| <= e_s`` (max is 1-Lipschitz), 0 if all exact.
   A (t, h) row whose ``delta`` (step 2) would exceed ``2**-30`` (logits so large that ``g_D A``
   is not small against 1: extreme magnitudes) takes the ordered logits too (``e_s = 0``), so
   ``r`` below never exceeds ~``2**-30`` and every bound stays meaningful.
2. ``p~_k = torch.exp(s~_k - m~)`` (one elementwise pass; the ordered oracle uses ``det_exp``).
   The fast path uses torch's own float64 ``exp``/``log``/``logaddexp`` everywhere (steps 2, 4, 6,
   7): CUDA's libdevice ``exp``/``log``/``log1p`` are documented within 1-2 ulps, CPU's (SLEEF
   1.0-ulp variants or libm) within 1 ulp; ``det_exp``/``det_log`` are within a few ulps
   (``detmath``). One ulp is at most ``2u = 2**-52`` relative, so ``eps_e = eps_l = 2**-48`` (16
   ulps) covers either side with margin. Both exps are within ``eps_e`` relative of ``exp``, plus
   ``eta = 2**-1022`` absolute in the subnormal range. The arguments agree to ``delta = 2 e_s (1 +
   2u) + 2u (max|d~| + 2 e_s)`` (0 where ``e_s = 0``: the same logits give the same difference),
   with ``max|d~| <= 2 scale ||q|| max_k ||K_k|| (1 + 2**-40)`` (Cauchy-Schwarz again; no pass
   over the logits). So ``|p~_k - p_k| <= r p_k + eta`` with
   ``r = e^delta (1 + eps_e)/(1 - eps_e) - 1 + 2 eps_e/(1 - eps_e)``.
3. ``L = sum p`` (ordered: sequential; fast: ``torch.sum``): both within ``g_K`` of their exact
   sums ``S~``, ``S``; ``S <= (S~ + K eta)/(1 - r)``, ``S~ <= L~/(1 - g_K)``:
   ``|L~ - L| <= rho L~``, ``rho = [g_K + (g_K + r)/(1 - r)]/(1 - g_K) + K eta (1 + (g_K+r)/(1-r))``
   (``L~ >= 1``: the arg-max slot contributes ``exp(0) = 1`` exactly).
4. ``lse = m + log(L)`` (ordered: ``det_log``; fast: ``torch.log``): ``e_lse = e_s + rho/(1 - rho)
   + 2 eps_l (|ln L~| + 1) + 2u (|lse~| + e_s + 1)`` with ``eps_l = 2**-48`` (a few ulps, step 2).
5. ``O = bmm(p, V) / L`` (fast: ``N = bmm(p, V)``, divided once in step 6): with ``V_j = max |v_kj|``
   over the token's valid slots k and all dims
   (finite values only: a non-finite value reaches only outputs that are non-finite in both
   modes) the same argument as 3 bounds ``|N~ - N| <= rho L~ V_j`` and ``|O| <= V_j (1 + 3 g_K)``,
   so ``e_O = V_j (2 rho + 2u) (1 + 3 g_K)``.
6. Sink factor ``f = 1/(1 + exp(sink - lse))`` (``det_exp`` / ``torch.exp``): ``|df/dlse| <=
   1/4``; each side's rounding is
   ``<= eps_f f``, ``eps_f = eps_e + u (|sink - lse~| + e_lse) + 3u``: ``e_f = e_lse / 4 + 2
   eps_f`` (0 for +-inf sinks: ``f`` is exactly 0 or 1 on both sides). ``out = O f``:
   ``e_out = e_O + V_j (1 + 3 g_K) (e_f + 2u)``. The fast side computes ``out = N / (L + L e)``
   (``e = exp(sink - lse)``; no sink: ``N / L``): three roundings after ``e`` (product, sum, or
   one fused, and the division) against the four of ``fl(fl(N/L) fl(1/fl(1 + e)))`` that the
   terms above allow it, so the same bound holds.
7. ``lse_with_sink = logaddexp(lse, sink)`` (ordered: ``hi + det_log1p_exp_neg(lo - hi)``; fast:
   ``torch.logaddexp``, the same ``max + log1p(exp(-|d|))`` form) is 1-Lipschitz in ``lse``; each
   side rounds ``<= eps_l (1 + |lws|) + 2u |lws|`` (the rounding ``u |d|`` of ``d`` moves
   ``log1p(exp(-|d|))`` by ``<= u |d| e^-|d| <= u/e``): ``e_lws = e_lse + 2 eps_l (1 + |lws~|) + 4u (|lws~| + e_lse)``
   (= ``e_lse`` without a sink, 0 with a ``+inf`` sink).
Every bound is multiplied by ``1 + 2**-20`` (second-order terms, and the few float64 roundings of
evaluating the bound itself). Magnitude at DSv4 shapes
(K = 640..1152, D = 512, random FP8 caches): ``e_out <= 2e-10 V`` and ``e_lse <= 1.1e-10`` on rows
whose logits are not proven exact, ``~1e-13 V`` and ``~1e-13`` on rows that are (the default
cases: ``<= 3e-11``), against bf16 output tolerances ~4e-3 relative and LSE tolerances ~1e-5
absolute: at least 1e5 times smaller.

Evaluation (``bound_coefficients``): steps 2-7 are evaluated as one affine function per output of
the per-row features ``x`` (``||q|| max_k ||K_k||`` on rows whose logits are approximate, else 0:
``e_s = ck x``, ``delta = cd x``), ``ln L``, ``|lse|`` and ``|sink|``, whose non-negative
coefficients upper-bound the formulas above on every row the fast logits serve (``delta <=
2**-30``): ``e^delta - 1 <= delta (1 + 2**-30)``, ``1/(1 - r)`` and ``1/(1 - rho)`` at most their
values at ``delta = 2**-30``, ``|sink - lse| <= |sink| + |lse|`` and ``|lse_with_sink| <= max(|lse|,
|sink|) + ln 2``. A ``+-inf`` sink enters as 0: the sink factor is then exactly 1 or 0 in both
modes (and ``lse_with_sink`` is ``lse`` or ``+inf``), so any non-negative bound holds there. The
combination is three float64 ``addcmul`` (``ln L``, ``|lse|``, ``x``) and one add (``|sink|``) of
non-negative terms (relative rounding ``g_5``, inside the ``1 + 2**-20``; an ``addmm`` cost the
host ~50 us).

Assumes float32 arithmetic per IEEE for the row statistics of a bfloat16 table (any summation
order or accumulator width; ``log2`` within 1 ulp, as CUDA documents for ``log2f`` and SLEEF for
its 1-ulp variants).

Assumes IEEE float64 GEMMs (every product and sum correctly rounded or fused; no reduced-precision
float64 emulation) and denormals not flushed.

The optional fused Triton kernels (``fast_fused``) compute steps 1-3 and 5 in another order (float64
``tl.dot`` in blocks, two passes over the slots, no online rescaling) and steps 4-7 in one kernel;
every step above holds for any order and fusion, so these coefficients apply to them unchanged
(``fast_fused``'s docstring goes through the steps).
"""
from __future__ import annotations

import math

import torch

__all__ = ["bound_coefficients", "bf16_abs_factor", "bf16_abs_gemm", "exact_bits", "norm_factor"]

_U = 2.0**-53
_U32 = 2.0**-24  # float32 unit roundoff (row statistics of a bfloat16 table)
_EPS_E = 2.0**-48  # exp relative accuracy allowance (det_exp, torch.exp: a few ulps)
_EPS_L = 2.0**-48  # log accuracy allowance (relative to |ln x| + 1; det_log, torch.log/logaddexp)
_ETA = 2.0**-1022  # subnormal rounding of one exp value
_SAFE = 1.0 + 2.0**-20
BIG = 2.0**1000
DELTA_MAX = 2.0**-30  # larger logit-difference bounds: those rows take the ordered logits
BF16_ABS_MAX_K = 2**20  # bf16_abs_factor's domain: pv_abs' bfloat16 GEMM below this many slots, float64 beyond
_EXACT_MARGIN = 2.0**-10  # >= the float32/float64 evaluation error of alpha + beta (``row_stats``)
# rows of the bound coefficient matrix (``bound_coefficients``) and columns of the feature matrix
_B_LSE, _B_LWS, _B_MAX, _B_OUT = range(4)
F_X, F_LNL, F_LSE, F_SINK = range(4)


def _gamma(n: int) -> float:
    return n * _U / (1.0 - n * _U)


def norm_factor(D: int) -> float:
    """``c_D`` with ``||x||_2 <= c_D n`` for the norm ``n`` that ``row_stats`` computes of a row of
    ``D`` values (module docstring, step 1; ``row_stats``): ``1 / ((1 - u32)**3 sqrt(1 - g32_D))``
    (a float32 sum of exact squares in any order, its rounding to float32 if accumulated wider,
    the square root, the underflow floor's addition), which also covers the float64 table's ``1 +
    2**-30``. ``D <= 2**20``."""
    g32 = D * _U32 / (1.0 - D * _U32)
    return 1.0 / ((1.0 - _U32) ** 3 * math.sqrt(1.0 - g32)) * (1.0 + 2.0**-40)


def x_factor(D: int) -> float:
    """Upper bound of ``A / x``: ``x = fl(n_q n_k)`` (float32 or float64, relative ``u32`` at most)
    and each norm within ``c_D``: ``c_D**2 / (1 - u32)``."""
    return norm_factor(D) ** 2 / (1.0 - _U32) * (1.0 + 2.0**-40)


def exact_bits(D: int) -> float:
    """The exactness test's threshold (step 1): ``alpha + beta`` below it proves ``sum |q_d k_d| <
    2**(53 + lq + lk)``: ``53 - 2 log2(c_D)`` (the norms are upper bounds within ``c_D``) less
    ``_EXACT_MARGIN`` (the float32 evaluation of ``log2(n) - lsb`` and of the sum, ``< 2**-12``)."""
    return 53.0 - 2.0 * math.log2(norm_factor(D)) - _EXACT_MARGIN



def bound_coefficients(K: int, D: int, scale: float, with_sink: bool) -> torch.Tensor:
    """float64 ``[4, 5]``: per output row (``lse``, ``lse_with_sink``, ``max_logits``, ``out``
    divided by ``V_j``) the coefficients of the features ``(x, ln L, |lse|, |sink|, 1)`` whose
    combination upper-bounds the module docstring's steps 1-7 (section "Evaluation"), ``_SAFE``,
    ``1 + 3 g_K`` (``out``) and, on ``x``, ``x_factor(D)`` (``x`` is the computed product of the
    computed norms; ``A`` is at most ``x_factor(D)`` times it) included. ``K``: total slots,
    ``D``: head dim."""
    u, gK = _U, _gamma(K)
    ck = scale * (2.0 * _gamma(D) + 4.0 * u)  # e_s = ck x
    cd = 2.0 * ck * (1 + 2 * u) + 4.0 * u * scale * (1.0 + 2.0**-40) + 4.0 * u * ck  # delta = cd x
    dmax = DELTA_MAX * (1.0 + 2.0**-40)
    r1 = (1.0 + dmax) * (1 + _EPS_E) / (1 - _EPS_E)  # r <= r1 delta + r0 (e^d - 1 <= d (1 + dmax))
    r0 = 4.0 * _EPS_E / (1 - _EPS_E)
    w = 1.0 / (1.0 - (r1 * dmax + r0))  # 1/(1 - r)
    c1 = 1.0 / (1 - gK) + K * _ETA
    rho1 = r1 * w * c1  # rho <= rho1 delta + rho0
    rho0 = (r0 + gK) * w * c1 + gK / (1 - gK) + K * _ETA
    w2 = 1.0 / (1.0 - (rho1 * dmax + rho0))  # 1/(1 - rho)
    # e_lse = e_s (1 + 2u) + rho/(1 - rho) + 2 eps_l (ln L + 1) + 2u (|lse| + e_s + 1)
    e_lse = [ck * (1 + 4 * u) + rho1 * cd * w2, 2 * _EPS_L, 2 * u, 0.0, rho0 * w2 + 2 * _EPS_L + 2 * u]
    e_o = [2 * rho1 * cd, 0.0, 0.0, 0.0, 2 * rho0 + 2 * u]  # 2 rho + 2u
    if with_sink:
        # e_f = e_lse (1/4 + 2u) + 2u |d| + 2 eps_e + 6u, |d| <= |sink| + |lse|; out: e_o + e_f + 2u
        a = 0.25 + 2 * u
        e_out = [e_o[0] + a * e_lse[0], a * e_lse[1], a * e_lse[2] + 2 * u, 2 * u,
                 e_o[4] + a * e_lse[4] + 2 * _EPS_E + 8 * u]
        # e_lws = e_lse (1 + 4u) + (2 eps_l + 4u) |lws| + 2 eps_l, |lws| <= |lse| + |sink| + ln 2
        b = 2 * _EPS_L + 4 * u
        e_lws = [e_lse[0] * (1 + 4 * u), e_lse[1] * (1 + 4 * u), e_lse[2] * (1 + 4 * u) + b, b,
                 e_lse[4] * (1 + 4 * u) + b * math.log(2.0) * (1 + 2.0**-40) + 2 * _EPS_L]
    else:
        e_out, e_lws = e_o, e_lse
    e_max = [ck, 0.0, 0.0, 0.0, 0.0]
    coef = torch.tensor([e_lse, e_lws, e_max, e_out], dtype=torch.float64) * _SAFE
    coef[_B_OUT] *= 1 + 3 * gK
    coef[:, F_X] *= x_factor(D)  # x is the computed product of the computed norms, not A
    return coef


def delta_coefficient(D: int, scale: float) -> float:
    """``cd`` with ``delta <= cd x`` for the computed ``x`` (``x_factor`` included)."""
    ck = scale * (2.0 * _gamma(D) + 4.0 * _U)
    return (2.0 * ck * (1 + 2 * _U) + 4.0 * _U * scale * (1.0 + 2.0**-40) + 4.0 * _U * ck) * x_factor(D)


def bf16_abs_gemm(dtype: torch.dtype, K: int) -> bool:
    """Whether ``pv_abs`` is the bfloat16 GEMM of ``bf16(p)`` and ``|V|`` (times ``bf16_abs_factor(K)``):
    a bfloat16 table and fewer than ``BF16_ABS_MAX_K`` slots; else the float64 ``p |V|``."""
    return dtype == torch.bfloat16 and K < BF16_ABS_MAX_K


def bf16_abs_factor(K: int) -> float:
    """The factor that makes ``pv_abs``' bfloat16 GEMM an upper bound of its exact value (``K`` slots,
    ``K < BF16_ABS_MAX_K = 2**20``): each ``p_k`` (in ``[0, 1]``) rounded to bfloat16 (RNE, ``>= p_k (1 - 2**-8)``),
    ``|v|`` exact (bfloat16 rows), the products of non-negative terms summed in float32 in any
    order, even with truncating tensor-core alignment (``>= (1 - K 2**-22)`` of the exact sum), the
    result rounded to bfloat16 (``>= (1 - 2**-8)``): ``1 / ((1 - 2**-8)**2 (1 - K 2**-22))``, times
    ``1 + 2**-20`` for the float64 scaling; at most 1.2% above 1 for DSv4's ``K <= 2**14``.
    Underflow (``p_k`` or products below ``2**-126`` flushed) loses at most ``K 2**-126 (1 + max
    |v|)`` in absolute terms, far below any tolerance's absolute floor."""
    return 1.0 / ((1.0 - 2.0**-8) ** 2 * (1.0 - K * 2.0**-22)) * (1.0 + 2.0**-20)
