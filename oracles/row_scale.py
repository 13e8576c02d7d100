"""The per-row logit scale of an attention case: the unit of the softmax statistics' logit term;
and (:func:`pv_allowance`) the per-element bf16-P rounding term of ``out``.

``logit_scale(q, segments, scale) -> [T, H]`` float64 (on the CPU):
``F[t, h] = scale * ||q[t, h]||_2 * max_k ||K_k||_2`` over the row's valid slots ``k`` (all ``D``
dims of the gathered rows; 0 on a row without a valid slot; non-finite values count as 0, a row
reading them is judged by its anomaly positions). By Cauchy-Schwarz ``F >= scale * sum_d |q_d
k_d|`` for every attended ``k``: it bounds every logit's magnitude and the magnitude of the partial
sums an accumulation chain over ``d`` holds.

Why the statistics need it: a kernel accumulates each logit in fp32, so each logit is
off by up to a few fp32 units of ``F`` (the chain's partial sums reach ``F``, not the logit, under
cancellation), and ``lse`` / ``max_logits`` are 1-Lipschitz in the logits (max norm): their error
has a term ``c * 2**-23 * F`` that grows with the row's logit magnitude and has nothing to do with
the statistic's own value (``lse = max + ln L`` can be small while ``F`` is large). An fp32-ulp
tolerance on the lse value (``rtol``) is the wrong unit for that term; the tolerance records carry
``logit_ulps`` (``c``, derived in ``derive.py`` from the fp32 logit chains of the kernel models)
and the judge allows ``logit_allowance = logit_ulps * 2**-23 * F`` per row on top of the record's
``atol`` / ``rtol`` (``numeric.compare``'s ``allow``).

Fixed order: the squares are summed with ``detmath.fixed_sum``'s pairwise order per row, so ``F``
has the same bits on every host (``derive.py`` records depend on it).
"""
from __future__ import annotations

import math

import torch

from dsv4_numerics.reference.attention.ordered import segment_validity
from dsv4_numerics.reference.errors import check_tensor, fail

__all__ = ["BF16_U", "FP32_ULP", "logit_allowance", "logit_scale", "pv_allowance", "row_norms"]

FP32_ULP = 2.0**-23  # one fp32 ulp at 1 (the unit of ``logit_ulps``)
BF16_U = 2.0**-8  # bf16's unit roundoff (8 significant bits, round to nearest): |bf16(p) - p| <= BF16_U * |p|


def row_norms(x: torch.Tensor) -> torch.Tensor:
    """``||x_i||_2`` of each row of a float ``[..., D]`` tensor, float64, computed where ``x`` is (a
    GPU table is not copied to the host) and returned on the CPU; the squares summed in a fixed
    pairwise order (zero-padded to a power of two, halved: elementwise IEEE operations only, so the
    same bits on every host and device); non-finite values count as 0."""
    v = torch.nan_to_num(x.detach().to(torch.float64), nan=0.0, posinf=0.0, neginf=0.0)
    v = v * v
    D = v.shape[-1]
    size = 1 << max(0, (D - 1).bit_length())
    if size != D:
        v = torch.cat([v, v.new_zeros(*v.shape[:-1], size - D)], dim=-1)
    while v.shape[-1] > 1:
        h = v.shape[-1] // 2
        v = v[..., :h] + v[..., h:]
    return torch.sqrt(v[..., 0]).cpu()


def logit_scale(q: torch.Tensor, segments: list, scale: float) -> torch.Tensor:
    """``F`` ``[T, H]`` float64 on the CPU (module docstring): ``q`` ``[T, H, D]``, ``segments``
    the oracle's (``reference.attention.ordered.Segment``), ``scale`` the softmax scale."""
    fn = "logit_scale"
    check_tensor(fn, "q", q)
    if q.dim() != 3:
        fail(fn, "q", "must be [T, H, D]", tuple(q.shape))
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        fail(fn, "scale", "must be a finite number", scale)
    T = q.shape[0]
    valid = segment_validity(segments, T).cpu()  # [T, K] booleans: small
    kmax = torch.zeros(T, dtype=torch.float64)
    col = 0
    for s in segments:
        K = s.idx.shape[1]
        n = row_norms(s.rows)
        idx = s.idx.detach().cpu().to(torch.int64).clamp(0, max(0, n.numel() - 1))
        g = n[idx] if n.numel() else torch.zeros(idx.shape, dtype=torch.float64)
        g = torch.where(valid[:, col:col + K], g, torch.zeros((), dtype=torch.float64))
        if K:
            kmax = torch.maximum(kmax, g.amax(dim=1))
        col += K
    return abs(float(scale)) * row_norms(q) * kmax.view(T, 1)


def logit_allowance(logit_ulps: float, f: torch.Tensor) -> torch.Tensor:
    """The per-row error budget of a softmax statistic: ``logit_ulps * 2**-23 * F`` (float64)."""
    return f.to(torch.float64) * (float(logit_ulps) * FP32_ULP)


def pv_allowance(s: torch.Tensor) -> torch.Tensor:
    """The per-element error budget of a bf16-P kernel's ``out`` from the rounding of ``P``:
    ``BF16_U * S`` with ``S[t, h, d] = f sum_k (p_k / L) |V[k, d]|``, the attention of the case with
    ``|V|`` in place of ``V`` and the same weights (the sink in the denominator):
    ``reference.attention.fast``'s ``pv_abs`` (``want_abs=True``), which the attention judge asks of
    the oracle. A bound of that one term (``|bf16(p) - p| <= BF16_U p``; ``S`` itself in float64,
    within the ``out`` bound); the record's ``atol`` / ``rtol`` still cover the rest (fp32 sums,
    ``L``, the output's rounding).

    Why (the tier-A ``out`` judgement): where a few keys dominate a row and their values cancel,
    that term exceeds an ``atol`` in units of the case's V RMS (README, "Divergences": headroom 0.94
    of the reference's own bf16-P emulation on a drawn prefill case with q x 32)."""
    return s.to(torch.float64) * BF16_U
