"""E2M1 (FP4) codes, their nibble packing, and the E4M3 group scales of the V4.1 NVFP4 record
(datapath 1.6; ``reference.policies.Nvfp4ScaleRule``).

E2M1 code ``s eem`` (4 bits): magnitudes by ``eem`` = 0, 0.5, 1, 1.5, 2, 3, 4, 6 (bias 1, one
mantissa bit, subnormal 0.5, no Inf/NaN); ``s`` is the sign, so code 0x8 is -0.0.
Packing: two codes per byte, element ``2j`` in the LOW nibble and ``2j + 1`` in the high nibble.

Encoding (``cvt.rn.satfinite.e2m1x2.f32``, the instruction of both V4.1 NVFP4 writers): round to
nearest, ties to the even code (mantissa bit 0), magnitudes above 6 saturate to 6, the sign is
kept (a negative value that rounds to zero gives 0x8).
"""

from __future__ import annotations

import torch

from ..constants import E2M1_MAX, NVFP4_SCALE_MAX, NVFP4_SCALE_MIN
from ..errors import check_dtype, check_enum, check_tensor, fail
from .fp8 import encode_fp8_trusted, decode_e4m3fn
from ..policies import Fp8Flavour, NonFinite, Nvfp4ScaleRule
from .quant import fl32_div

__all__ = [
    "E2M1_MAGNITUDES",
    "encode_e2m1",
    "decode_e2m1",
    "e2m1_table",
    "pack_e2m1",
    "unpack_e2m1",
    "nvfp4_scale_bytes",
    "div_rn_f32",
]

# Magnitude of the 3-bit field ``eem`` (index = code & 7).
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, E2M1_MAX)
_MAG = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float64)
_TABLE = torch.tensor([(-1.0 if c & 8 else 1.0) * E2M1_MAGNITUDES[c & 7] for c in range(16)], dtype=torch.float32)


def e2m1_table() -> torch.Tensor:
    """The 16 decoded E2M1 values (float32, CPU), indexed by code (0x8 is -0.0)."""
    return _TABLE.clone()


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Exact float32 values of E2M1 ``codes`` (uint8 in [0, 15], any shape)."""
    fn = "decode_e2m1"
    check_dtype(fn, "codes", codes, (torch.uint8,))
    if codes.numel() and bool((codes > 15).any()):
        fail(fn, "codes", "must hold 4-bit E2M1 codes in [0, 15] (unpack bytes with unpack_e2m1)")
    return _TABLE.to(codes.device)[codes.to(torch.int64)]


def encode_e2m1(y: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8 in [0, 15]) of finite float32/float64 ``y`` (any shape), as
    ``cvt.rn.satfinite.e2m1x2.f32``: RNE onto the grid, ties to the even code, ``|y| > 6`` -> 6,
    sign kept (-0.0 and negative values rounding to 0 give 0x8). Non-finite ``y`` raises."""
    fn = "encode_e2m1"
    check_tensor(fn, "y", y)
    check_dtype(fn, "y", y, (torch.float32, torch.float64))
    if not bool(torch.isfinite(y).all()):
        fail(fn, "y", "must be finite (the V4.1 writers handle NaN/Inf per Nvfp4NonFinite before encoding)",
             f"{int((~torch.isfinite(y)).sum())} non-finite elements")
    return encode_e2m1_trusted(y)


def encode_e2m1_trusted(y: torch.Tensor) -> torch.Tensor:
    """``encode_e2m1`` of finite ``y`` (no check). Every grid point and midpoint is a short dyadic,
    so the comparisons in float64 are exact."""
    v = y.to(torch.float64)
    a = v.abs().clamp(max=E2M1_MAX)
    mag = _MAG.to(v.device)
    lo = (torch.searchsorted(mag, a, right=True) - 1).clamp(0, 7)  # largest k with mag[k] <= a
    hi = (lo + 1).clamp(max=7)
    d_lo, d_hi = a - mag[lo], mag[hi] - a
    up = (hi != lo) & ((d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0)))
    code = torch.where(up, hi, lo)
    sign = (v.view(torch.int64) < 0).to(torch.int64) << 3
    return (code | sign).to(torch.uint8)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Bytes ``[..., n/2]`` from E2M1 ``codes [..., n]`` (n even): ``codes[2j] | codes[2j+1] << 4``."""
    fn = "pack_e2m1"
    check_dtype(fn, "codes", codes, (torch.uint8,))
    if codes.dim() == 0 or codes.shape[-1] % 2:
        fail(fn, "codes", "must have an even last dimension", f"shape {tuple(codes.shape)}")
    if codes.numel() and bool((codes > 15).any()):
        fail(fn, "codes", "must hold 4-bit codes in [0, 15]")
    pairs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """E2M1 codes ``[..., 2n]`` from bytes ``[..., n]``: low nibble first (the even element)."""
    check_dtype("unpack_e2m1", "packed", packed, (torch.uint8,))
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def div_rn_f32(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Correctly rounded fp32 quotient ``fl32(x / s)`` of fp32 tensors (``div_rn`` / ``__fdiv_rn``):
    the float64 quotient rounded to fp32 (double rounding is innocuous for division, q = 53 >= 2*24 + 2;
    see ``quant.fl32_div``)."""
    return (x.to(torch.float64) / s.to(torch.float64)).to(torch.float32)


def nvfp4_scale_bytes(amax: torch.Tensor, rule: Nvfp4ScaleRule | str) -> torch.Tensor:
    """E4M3FN scale bytes (uint8, same shape) of finite fp32 group maxima ``amax >= 0``.

    ``r = fl32(amax * fl32(1/6))`` (RECIP_MUL) or ``fl32(amax / 6)`` (DIV_RN), then
    ``clamp(r, 2**-9, 448)`` and E4M3 RNE (subnormal scales ``m * 2**-9`` included). An all-zero
    group gets 0x01 (``2**-9``): the scale is never zero.
    """
    fn = "nvfp4_scale_bytes"
    check_dtype(fn, "amax", amax, (torch.float32,))
    rule = check_enum(fn, "rule", Nvfp4ScaleRule, rule)
    if not bool((torch.isfinite(amax) & (amax >= 0)).all()):
        fail(fn, "amax", "must be finite and >= 0")
    return nvfp4_scale_bytes_trusted(amax, rule)


_INV6_F32 = torch.tensor(1.0 / E2M1_MAX, dtype=torch.float32)  # fl32(1/6) = 0x3E2AAAAB


def nvfp4_scale_bytes_trusted(amax: torch.Tensor, rule: Nvfp4ScaleRule) -> torch.Tensor:
    """``nvfp4_scale_bytes`` without validation. The float64 product of two fp32 is exact, so its
    one rounding to fp32 is the correctly rounded fp32 product."""
    if rule is Nvfp4ScaleRule.RECIP_MUL:
        r = (amax.to(torch.float64) * _INV6_F32.to(torch.float64).to(amax.device)).to(torch.float32)
    else:
        r = fl32_div(amax, E2M1_MAX)
    r = r.clamp(NVFP4_SCALE_MIN, NVFP4_SCALE_MAX).to(torch.float64)
    return encode_fp8_trusted(r, Fp8Flavour.E4M3FN, NonFinite.FINITE, None)


def decode_nvfp4_scales(scale_bytes: torch.Tensor) -> torch.Tensor:
    """float32 values of E4M3FN scale bytes (0x7F / 0xFF -> NaN)."""
    return decode_e4m3fn(scale_bytes)
