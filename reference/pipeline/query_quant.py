"""The DeepSeek-V4.1 query quantiser: RMS-normalised q rows as MXFP8 activations (E4M3 codes, one
UE8M0 byte per 32 values, the bytes in FlashInfer's swizzled F8_128x4 layout), and the normalised
kv rows, as vLLM 0.33.0's ``fused_q_kv_rmsnorm_quant`` produces them
(``V:models/deepseek_v41/common/ops/query_quant.py:37-123``; its consumers are the MXFP8 GEMMs of
``wq_b``, ``can_fuse_query_quant``).

Per token row ``t`` (q: ``Q`` values, ``Q % 32 == 0``; kv: ``KV`` values):

    rrms  = rsqrt(sum_i x_i**2 / SIZE + eps)          (fp32)
    y_i   = fl32(fl32(x_i * rrms) * w_i)              (two fp32 roundings, this order)
    q:  y rounded to bf16 (the kernel keeps "the materialized normalization output's rounding
        boundary"), then per 32-group ``g``:
          r     = fl32(amax_g * fl32(1/448))           (a multiply by the fp32 constant)
          sf_g  = clamp(ceil(log2 r) + 127, 0, 254)    (0 when amax_g == 0)       [UE8M0_CEIL]
          inv_g = 2**(127 - sf_g) for 1 <= sf_g <= 253, else 0                    [ZERO_INVERSE]
          code  = e4m3fn RNE, saturating (cvt.rn.satfinite) of y * inv_g  (exact power-of-two scaling)
    kv: y rounded to the kv dtype (bf16).

The named rule, ``ue8m0_ceil_zero_inverse``: the UE8M0 byte is the exact ceiling of ``log2 r``
(FlashInfer's conversion, subnormal ``r`` included: ``r <= 2**-127`` gives byte 0), and a group
whose byte is 0 (``amax <= 448 * 2**-127``, about ``2**-118.2``) is quantised with inverse scale 0:
all its codes are (signed) zeros although its byte claims ``2**-127``. Unlike the cache writers'
rules (``ScaleRule``) there is no floor on ``amax``. ``inv = 2**(127 - sf)`` and ``y`` bf16 make the
scaling exact, so the only rounding is the E4M3 one.

Scale bytes, F8_128x4 (``constants.F8_128X4_*``): ``T`` padded to a multiple of 128 rows and the
group count ``G = Q / 32`` to a multiple of 4; byte of (row ``r``, group ``g``) at
``(r // 128 * ceil(G / 4) + g // 4) * 512 + (r % 32) * 16 + (r % 128 // 32) * 4 + g % 4``. Rows
``>= T`` and groups ``>= G`` (padding) hold byte 0; the kernel writes every byte of the buffer.

Bit-exactness of the normalisation. The kernel sums the squares with ``tl.sum`` (a tree order) and
takes ``rsqrt`` with the approximate instruction, so ``y`` is reproducible bit for bit only where
both are exact. ``rms_norm_rows`` is the correctly rounded model (float64 sum, one rounding to fp32
per step, a correctly rounded ``rsqrt``); it equals the kernel on *exact-norm rows*: every
``x_i**2`` a power of 4 (or 0) with ``sum x_i**2 = SIZE`` and ``eps = 0``, so the sum and the mean
are exact in any order and ``rsqrt(1) = 1`` (``cases_v41_attention`` builds its query-quantiser
cases that way; ``is_exact_norm_row`` checks it). Elsewhere it is a model within a few fp32 ulps.
"""

from __future__ import annotations

import torch

from ..constants import (
    E4M3_MAX,
    F8_128X4_GROUPS,
    F8_128X4_ROWS,
    F8_128X4_SUBROWS,
    F8_128X4_TILE_BYTES,
    UE8M0_BIAS,
    V41_MXFP8_GROUP,
)
from ..errors import check_dtype, check_rank, check_tensor, fail
from ..formats.fp8 import encode_fp8_trusted, pow2_f64
from ..policies import Fp8Flavour, NonFinite

__all__ = [
    "QUERY_SCALE_RULE",
    "UE8M0_MAX_BYTE",
    "ue8m0_ceil_bytes",
    "inverse_scales",
    "quantize_query_groups",
    "f8_128x4_offsets",
    "f8_128x4_bytes",
    "swizzle_f8_128x4",
    "unswizzle_f8_128x4",
    "rms_norm_rows",
    "is_exact_norm_row",
    "fused_q_kv_rmsnorm_quant",
]

QUERY_SCALE_RULE = "ue8m0_ceil_zero_inverse"
UE8M0_MAX_BYTE = 254  # the largest byte the kernel writes (255 is the UE8M0 NaN)
_INV448_F32 = torch.tensor(1.0 / E4M3_MAX, dtype=torch.float32)  # fl32(1/448) = 0x3B124925


def ue8m0_ceil_bytes(amax: torch.Tensor) -> torch.Tensor:
    """UE8M0 bytes (uint8, same shape) of finite fp32 group maxima ``amax >= 0`` under
    ``ue8m0_ceil_zero_inverse``: ``clamp(ceil(log2 fl32(amax * fl32(1/448))) + 127, 0, 254)``,
    0 for ``amax == 0``. The float64 product of two fp32 values is exact, so its one rounding to
    fp32 is the kernel's product; ``frexp`` gives the exact ceiling (``r = m * 2**e``,
    ``m in [0.5, 1)``: ``ceil(log2 r) = e - 1`` iff ``m == 0.5``)."""
    fn = "ue8m0_ceil_bytes"
    check_tensor(fn, "amax", amax)
    check_dtype(fn, "amax", amax, (torch.float32,))
    if not bool((torch.isfinite(amax) & (amax >= 0)).all()):
        fail(fn, "amax", "must be finite and >= 0 (non-finite q rows are out of the kernel's contract)")
    return _ue8m0_ceil_bytes(amax)


def _ue8m0_ceil_bytes(amax: torch.Tensor) -> torch.Tensor:
    r = (amax.to(torch.float64) * _INV448_F32.to(torch.float64).to(amax.device)).to(torch.float32).to(torch.float64)
    m, e = torch.frexp(r)
    ceil_log2 = e.to(torch.int64) - (m == 0.5).to(torch.int64)
    sf = (ceil_log2 + UE8M0_BIAS).clamp(0, UE8M0_MAX_BYTE)
    return torch.where(r > 0, sf, torch.zeros_like(sf)).to(torch.uint8)


def inverse_scales(sf: torch.Tensor) -> torch.Tensor:
    """float64 inverse scales of UE8M0 bytes ``sf``: ``2**(127 - sf)`` for ``1 <= sf <= 253``,
    0 for bytes 0 and 254 (the kernel builds the fp32 bit pattern ``(254 - sf) << 23``, which is
    the zero pattern at both ends)."""
    s = sf.to(torch.int64)
    inv = pow2_f64(UE8M0_BIAS - s)
    return torch.where((s >= 1) & (s <= UE8M0_MAX_BYTE - 1), inv, torch.zeros_like(inv))


def quantize_query_groups(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes uint8 [T, Q], sf uint8 [T, Q/32])`` of bf16 rows ``y [T, Q]`` (finite, ``Q % 32 == 0``)
    under ``ue8m0_ceil_zero_inverse`` (module docstring): codes are E4M3FN bytes."""
    fn = "quantize_query_groups"
    check_tensor(fn, "y", y)
    check_dtype(fn, "y", y, (torch.bfloat16,))
    check_rank(fn, "y", y, 2)
    if y.shape[1] == 0 or y.shape[1] % V41_MXFP8_GROUP:
        fail(fn, "y", f"must have a last dimension that is a positive multiple of {V41_MXFP8_GROUP}",
             f"shape {tuple(y.shape)}")
    if not bool(torch.isfinite(y).all()):
        fail(fn, "y", "must be finite (non-finite q rows are out of the kernel's contract)",
             f"{int((~torch.isfinite(y)).sum())} non-finite elements")
    t, q = y.shape
    groups = y.to(torch.float32).reshape(t, q // V41_MXFP8_GROUP, V41_MXFP8_GROUP)
    sf = _ue8m0_ceil_bytes(groups.abs().amax(dim=-1))
    scaled = groups.to(torch.float64) * inverse_scales(sf).unsqueeze(-1)  # exact: bf16 times a power of two
    codes = encode_fp8_trusted(scaled, Fp8Flavour.E4M3FN, NonFinite.FINITE, None)  # clamp to 448, RNE
    return codes.reshape(t, q), sf


def f8_128x4_bytes(tokens: int, groups: int) -> int:
    """Bytes of the F8_128x4 scale buffer for ``tokens`` rows of ``groups`` scale groups."""
    return -(-tokens // F8_128X4_ROWS) * F8_128X4_ROWS * -(-groups // F8_128X4_GROUPS) * F8_128X4_GROUPS


def f8_128x4_offsets(rows: torch.Tensor, groups: torch.Tensor, num_groups: int) -> torch.Tensor:
    """int64 byte offsets of (row, group) pairs (broadcast) in the F8_128x4 buffer of
    ``num_groups`` groups per row (module docstring)."""
    r, g = rows.to(torch.int64), groups.to(torch.int64)
    tiles_per_row_block = -(-num_groups // F8_128X4_GROUPS)
    sub = F8_128X4_ROWS // F8_128X4_SUBROWS  # 4 sub-blocks of 32 rows
    return ((r // F8_128X4_ROWS * tiles_per_row_block + g // F8_128X4_GROUPS) * F8_128X4_TILE_BYTES
            + (r % F8_128X4_SUBROWS) * (sub * F8_128X4_GROUPS)
            + (r % F8_128X4_ROWS // F8_128X4_SUBROWS) * F8_128X4_GROUPS + g % F8_128X4_GROUPS)


def swizzle_f8_128x4(sf: torch.Tensor) -> torch.Tensor:
    """The flat uint8 F8_128x4 buffer of scale bytes ``sf [T, G]`` (padding rows/groups = 0)."""
    fn = "swizzle_f8_128x4"
    check_dtype(fn, "sf", sf, (torch.uint8,))
    check_rank(fn, "sf", sf, 2)
    t, g = sf.shape
    out = torch.zeros(f8_128x4_bytes(t, g), dtype=torch.uint8, device=sf.device)
    if t and g:
        off = f8_128x4_offsets(torch.arange(t, device=sf.device)[:, None], torch.arange(g, device=sf.device)[None, :], g)
        out[off.reshape(-1)] = sf.reshape(-1)
    return out


def unswizzle_f8_128x4(buf: torch.Tensor, tokens: int, groups: int) -> torch.Tensor:
    """``sf [tokens, groups]`` read back from an F8_128x4 buffer (the inverse of ``swizzle_f8_128x4``)."""
    fn = "unswizzle_f8_128x4"
    check_dtype(fn, "buf", buf, (torch.uint8,))
    need = f8_128x4_bytes(tokens, groups)
    if buf.dim() != 1 or buf.numel() != need:
        fail(fn, "buf", f"must be a flat buffer of f8_128x4_bytes({tokens}, {groups}) = {need} bytes",
             f"shape {tuple(buf.shape)}")
    off = f8_128x4_offsets(torch.arange(tokens)[:, None], torch.arange(groups)[None, :], groups)
    return buf.cpu()[off]


def rms_norm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """fp32 ``[T, SIZE]``: ``fl32(fl32(x * rrms) * w)`` with ``rrms = fl32(1 / sqrt(fl32(fl32(sum x**2)
    / SIZE) + fl32(eps)))`` (float64 sum, correctly rounded fp32 steps; module docstring for where
    this equals the kernel bit for bit). x: bf16/fp32 ``[T, SIZE]``; weight: bf16/fp32 ``[SIZE]``."""
    fn = "rms_norm_rows"
    check_tensor(fn, "x", x)
    check_dtype(fn, "x", x, (torch.bfloat16, torch.float32))
    check_rank(fn, "x", x, 2)
    check_dtype(fn, "weight", weight, (torch.bfloat16, torch.float32))
    if tuple(weight.shape) != (x.shape[1],):
        fail(fn, "weight", f"must have shape [{x.shape[1]}] (one weight per column of x)", tuple(weight.shape))
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (0.0 <= float(eps) < 1.0):
        fail(fn, "eps", "must be a float in [0, 1)", eps)
    if not bool(torch.isfinite(x).all()):
        fail(fn, "x", "must be finite (non-finite rows are out of the kernel's contract)")
    v = x.to(torch.float32).to(torch.float64)
    size = x.shape[1]
    ss = (v * v).sum(dim=1).to(torch.float32).to(torch.float64)
    mean = (ss / size).to(torch.float32).to(torch.float64)
    eps32 = float(torch.tensor(float(eps), dtype=torch.float32))
    denom = (mean + eps32).to(torch.float32).to(torch.float64)
    if bool((denom <= 0).any()):
        fail(fn, "x", "has an all-zero row with eps = 0 (rsqrt(0) = inf: out of contract)")
    rrms = (1.0 / torch.sqrt(denom)).to(torch.float32).to(torch.float64)
    y = (v * rrms.unsqueeze(1)).to(torch.float32).to(torch.float64)
    return (y * weight.to(torch.float32).to(torch.float64)).to(torch.float32)


def is_exact_norm_row(x: torch.Tensor) -> torch.Tensor:
    """bool ``[T]``: rows whose every square is 0 or a power of 4 and whose squares sum to the row
    width exactly (then the kernel's fp32 sum, mean and ``rsqrt`` are exact in any order, eps = 0)."""
    v = x.to(torch.float64)
    sq = v * v
    m, e = torch.frexp(sq)
    pow4 = (sq == 0) | ((m == 0.5) & ((e - 1) % 2 == 0))
    return pow4.all(dim=1) & (sq.sum(dim=1) == x.shape[1])


def fused_q_kv_rmsnorm_quant(qr: torch.Tensor, kv: torch.Tensor, q_weight: torch.Tensor, kv_weight: torch.Tensor,
                             eps: float) -> dict[str, torch.Tensor]:
    """Reference of ``fused_q_kv_rmsnorm_quant`` (module docstring): ``{"q_codes": uint8 [T, Q]
    (E4M3FN bytes), "q_scales": uint8 [f8_128x4_bytes(T, Q/32)] (F8_128x4), "kv_normed": [T, KV]
    in kv's dtype, "q_sf": uint8 [T, Q/32] (the scale bytes unswizzled)}``."""
    fn = "fused_q_kv_rmsnorm_quant"
    for arg, t in (("qr", qr), ("kv", kv)):
        check_tensor(fn, arg, t)
        check_dtype(fn, arg, t, (torch.bfloat16,))
        check_rank(fn, arg, t, 2)
    if qr.shape[0] != kv.shape[0]:
        fail(fn, "kv", f"must have as many rows as qr ({qr.shape[0]})", tuple(kv.shape))
    if qr.shape[1] % V41_MXFP8_GROUP:
        fail(fn, "qr", f"must have a width that is a multiple of {V41_MXFP8_GROUP}", tuple(qr.shape))
    y = rms_norm_rows(qr, q_weight, eps).to(qr.dtype)
    codes, sf = quantize_query_groups(y)
    kvn = rms_norm_rows(kv, kv_weight, eps).to(kv.dtype)
    return {"q_codes": codes, "q_scales": swizzle_f8_128x4(sf), "kv_normed": kvn, "q_sf": sf}
