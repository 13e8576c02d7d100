"""Bit-exact FP8 (OCP E4M3FN, E4M3FNUZ) and UE8M0 codecs (spec README 3; datapath 1.1, 2.0, 2.8, 3,
hazards H3, H4, H8, H17).

Conventions
- Codes are ``torch.uint8`` tensors (one byte per element, same shape as the values).
- Decoded values are ``torch.float32``; every FP8 value and every UE8M0 multiplier is exactly
  representable in fp32 (UE8M0 byte 0 = 2**-127 as an fp32 subnormal), so decoding is exact.
- Encoding rounds the *exact* input value (float32, float64, float16 or bfloat16) to nearest,
  ties to even (RNE). The arithmetic is float64 scaling by exact powers of two (built from bits,
  not ``pow``) followed by ``torch.round`` (half-to-even) on a value in [0, 16], plus integer code
  assembly: no step rounds except the one RNE, so CPU and GPU give identical bits.

Formats (datapath "Notation")
- E4M3FN: sign | 4 exponent bits (bias 7) | 3 mantissa bits. Normal ``(8+m) * 2**(E-10)``,
  subnormal (E = 0) ``m * 2**-9``; max finite 448 = 0x7E; 0x7F / 0xFF are NaN; no Inf; -0 = 0x80.
- E4M3FNUZ: bias 8. Normal ``(8+m) * 2**(E-11)``, subnormal ``m * 2**-10``; max 240 = 0x7F;
  0x80 is the only NaN; there is no -0 (zero and every negative value that rounds to zero
  encode as 0x00; attention.md 6 / sglang#28455, hazards H8, H17).

Non-finite behaviours (``reference.policies.NonFinite``), element level. The production writers
clamp ``v`` to ``[-M, M]`` *before* the FP8 conversion; the element encoders model that clamp plus
the conversion, nothing else (the tile arithmetic that turns an Inf element into NaN lives in
``quant.quantize_tiles``):

=================  ===========================  ============  ==============  ===============
policy             finite |v| rounding > max    NaN           +Inf / -Inf     models
=================  ===========================  ============  ==============  ===============
FINITE             saturate to +-max            InputError    InputError      neutral contract
CUDA_SATFINITE     saturate (clamp to +-M)      -M (0xFE)     +M / -M         vLLM CUDA/HIP SWA writer
TRITON             saturate (clamp to +-M)      +-M (0x7E)    +M / -M         vLLM Triton writers
SGLANG_JIT         saturate (clamp to +-M)      +M (0x7E)     +M / -M         SGLang JIT-CUDA V4 store
TORCH              0x7F|sign (NaN)              0x7F|sign     0x7F / 0xFF     torch <= 2.11 cast
TORCH_SATURATING   0x7E|sign                    0x7F|sign     0x7E / 0xFE     torch 2.13 cast
=================  ===========================  ============  ==============  ===============

- CUDA_SATFINITE: ``fminf(fmaxf(v, -M), M)`` then ``cvt.rn.satfinite.e4m3`` (datapath 2.1 step 5).
  ``fmaxf(NaN, -M) = -M``, so a NaN element becomes -M = 0xFE (0xFE is also -224 in FNUZ with
  M = 224). Inside the tile quantiser an Inf element is multiplied by ``exp2f(-inf) = 0`` first,
  giving NaN and therefore 0xFE too, which is what datapath 2.8 measured for Inf elements.
- TRITON: ``tl.clamp(v, -M, M)`` then ``.to(float8e4nv)`` (``V:models/deepseek_v4/common/ops/
  cache_utils.py:151-159``). Measured on an H200 (Triton 3.6, ``tests/reference/test_codecs_gpu.py``):
  ``tl.clamp`` maps a NaN to +M if its sign bit is clear and to -M if set. GPU arithmetic returns
  the canonical *positive* NaN, so the NaN elements of a quantised tile (``x / scale``) come out as
  +M = 0x7E, as datapath 2.8 measured; ``quant.quantize_tiles`` canonicalises accordingly.
- TORCH: the ``float8_e4m3fn`` cast of torch 2.11 (``c10`` ``fp8e4m3fn_from_fp32_value``): RNE on
  an extended grid where 480 would be code 0x7F; ``|v| >= 480`` (incl. Inf, NaN) and values in
  (464, 480) that round up to 480 give 0x7F with the input's sign bit (0xFF for negative). 464
  ties to even, to 448 = 0x7E (datapath 2.8). torch first rounds float64 input to float32 (double
  rounding), modelled here for float64 input under both TORCH policies.
- TORCH_SATURATING: the torch 2.13 cast: as TORCH but finite overflow and +-Inf saturate to
  0x7E|sign; NaN -> 0x7F|sign.
- For E4M3FNUZ both TORCH policies model ``torch.float8_e4m3fnuz``: NaN, +-Inf and finite values
  that round above 240 all give 0x80 (measured on torch 2.13 CPU).

``clamp`` (``M``): ``None`` means the format maximum (448 / 240) for FINITE, CUDA_SATFINITE and
TRITON, and no clamp for the TORCH policies (torch's cast has none). ``FNUZ_GFX942_CLAMP`` (224)
models the gfx942 SWA writer (datapath 2.1, H8). A clamp under a TORCH policy follows
``torch.clamp``: NaN stays NaN, +-Inf becomes +-M.

UE8M0: byte ``b`` means ``2**(b - 127)``; 255 is NaN. ``decode_ue8m0`` models the consumers that
disagree on bytes 0 and 255 (``reference.policies.Ue8m0Consumer``, datapath 3, H4).
"""

from __future__ import annotations

import torch

from ..constants import (
    E4M3_BIAS,
    E4M3_MAX,
    E4M3FNUZ_BIAS,
    E4M3FNUZ_MAX,
    UE8M0_BIAS,
    UE8M0_NAN,
)
from ..errors import check_dtype, check_enum, check_tensor, fail
from ..policies import Fp8Decode, Fp8Flavour, NonFinite, Ue8m0Consumer

__all__ = [
    "encode_e4m3fn",
    "decode_e4m3fn",
    "encode_e4m3fnuz",
    "decode_e4m3fnuz",
    "encode_fp8",
    "decode_fp8",
    "fp8_max",
    "fp8_table",
    "ue8m0_from_exponent",
    "decode_ue8m0",
    "exact_ceil_log2",
    "pow2_f64",
    "E4M3FN_NAN",
    "E4M3FNUZ_NAN",
]

FLOAT_INPUT_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)

E4M3FN_NAN = 0x7F  # canonical positive NaN code of E4M3FN (0xFF is the negative one)
E4M3FNUZ_NAN = 0x80  # the only NaN code of E4M3FNUZ

# Format geometry derived from the biases in constants.py: a normal code with exponent field E
# and mantissa m has value (8 + m) * 2**(E - bias - 3); the subnormal quantum is 2**(1 - bias - 3).
_FN_EMIN = 1 - E4M3_BIAS  # -6: exponent of the smallest normal, 2**-6
_FNUZ_EMIN = 1 - E4M3FNUZ_BIAS  # -7
_FN_MAX_CODE = 0x7E  # 448
_FNUZ_MAX_CODE = 0x7F  # 240


# --------------------------------------------------------------------------- exact helpers


def pow2_f64(n: torch.Tensor) -> torch.Tensor:
    """Exact ``2.0**n`` as float64 for an integer tensor ``n`` in [-1022, 1023] (normal float64).

    Built from the IEEE bit pattern ``(n + 1023) << 52``, so no ``pow``/``exp2`` implementation
    (whose accuracy differs across CPU/GPU libraries) is involved.
    """
    n = n.to(torch.int64)
    if n.numel() and bool(((n < -1022) | (n > 1023)).any()):
        fail("pow2_f64", "n", "must lie in [-1022, 1023] (normal float64 powers of two)")
    return pow2(n)


def pow2(n: torch.Tensor) -> torch.Tensor:
    """``pow2_f64`` without the range check (no device sync): callers guarantee ``n`` in [-1022, 1023]."""
    return ((n.to(torch.int64) + 1023) << 52).view(torch.float64)


def _floor_log2_f64(a: torch.Tensor) -> torch.Tensor:
    """``floor(log2(a))`` (int64) for positive finite float64 ``a``, via the exact ``frexp``.

    ``frexp`` returns ``a = f * 2**k`` with ``f`` in [0.5, 1): it only reads the exponent bits, so
    it is exact, and ``floor(log2 a) = k - 1``. Result for ``a == 0`` is meaningless (-1).
    """
    _, k = torch.frexp(a)
    return k.to(torch.int64) - 1


def _encode_magnitude(a: torch.Tensor, emin: int) -> torch.Tensor:
    """RNE code magnitude (int64, unsaturated, may exceed 0x7F) of finite float64 ``a >= 0``.

    With ``E = max(floor(log2 a), emin)`` the representable grid around ``a`` has quantum
    ``2**(E - 3)``; ``m = RNE(a / 2**(E - 3))`` lies in [0, 16] (the division is an exact power-of-two
    scaling). The code of ``m * 2**(E - 3)`` is ``(E - emin) * 8 + m``: for ``E > emin`` that is
    exponent field ``E - emin + 1`` and mantissa ``m - 8`` (``m = 16`` carries into the exponent
    field, which is the correct next binade); for ``E = emin`` it covers the subnormals
    (``m < 8``) and the smallest binade. ``a = 0`` gives 0.
    """
    floor_e = torch.where(a > 0, _floor_log2_f64(torch.where(a > 0, a, torch.ones_like(a))),
                          torch.full_like(a, emin, dtype=torch.int64))
    e = torch.clamp(floor_e, min=emin)
    m = torch.round(a * pow2(3 - e))  # RNE (half to even); exact product; 3 - e in [-1020, 13]
    return (e - emin) * 8 + m.to(torch.int64)


def _sign_bit(v: torch.Tensor) -> torch.Tensor:
    """Sign bit (bool) of float64 ``v`` read from the bits: -0.0 and negative NaNs included."""
    return v.view(torch.int64) < 0


def validate_nonfinite(fn: str, nonfinite: object) -> NonFinite:
    return check_enum(fn, "nonfinite", NonFinite, nonfinite)


def _validate_clamp(fn: str, clamp: object, fmt_max: float) -> float | None:
    if clamp is None:
        return None
    if isinstance(clamp, bool) or not isinstance(clamp, (int, float)):
        fail(fn, "clamp", "must be a float or None", type(clamp).__name__)
    c = float(clamp)
    if not (0.0 < c <= fmt_max):
        fail(fn, "clamp", f"must be a finite value in (0, {fmt_max}] (the format maximum)", clamp)
    return c


def _to_f64(fn: str, x: torch.Tensor, nonfinite: NonFinite) -> torch.Tensor:
    check_dtype(fn, "x", x, FLOAT_INPUT_DTYPES)
    if nonfinite in (NonFinite.TORCH, NonFinite.TORCH_SATURATING) and x.dtype == torch.float64:
        # torch's cast converts double -> float first (c10 Float8 constructors take a float).
        x = x.to(torch.float32)
    v = x.to(torch.float64)  # exact for float32 / bfloat16 / float16
    if nonfinite is NonFinite.FINITE:
        bad = ~torch.isfinite(v)
        if bool(bad.any()):
            fail(fn, "x", "must be finite under nonfinite=FINITE (choose a producer behaviour "
                 "CUDA_SATFINITE / TRITON / TORCH / TORCH_SATURATING to model NaN/Inf)",
                 f"{int(bad.sum())} non-finite elements")
    return v


def _writer_clamp(v: torch.Tensor, m: float, nonfinite: NonFinite) -> torch.Tensor:
    """The writers' clamp of ``v`` to ``[-m, m]`` with each producer's NaN behaviour (float64)."""
    c = torch.clamp(v, -m, m)  # finite and +-Inf; torch.clamp keeps NaN
    nan = torch.isnan(v)
    if nonfinite is NonFinite.CUDA_SATFINITE:  # fminf(fmaxf(NaN, -m), m) = -m
        c = torch.where(nan, torch.full_like(c, -m), c)
    elif nonfinite in (NonFinite.TRITON, NonFinite.VLLM_CPU):  # tl.clamp on sm_90: NaN -> +-m by the NaN's sign bit
        c = torch.where(nan, torch.where(_sign_bit(v), -m, m).to(c.dtype), c)
    elif nonfinite is NonFinite.SGLANG_JIT:  # fmaxf(fminf(NaN, m), -m) = +m, whatever the sign
        c = torch.where(nan, torch.full_like(c, m), c)
    return c


# --------------------------------------------------------------------------- E4M3FN


def _encoder_input(fn: str, x, nonfinite, clamp, fmt_max: float):
    """Validated float64 input of an FP8 encoder, already clamped as the producer clamps it.

    Writer policies apply the writer's ``fminf(fmaxf(v, -M), M)`` with ``M = clamp`` or the
    format maximum ``fmt_max``; the TORCH policies model a bare cast, clamped only if ``clamp``
    is given. Returns ``(v, nonfinite, torch_mode)``.
    """
    check_tensor(fn, "x", x)
    nonfinite = validate_nonfinite(fn, nonfinite)
    clamp = _validate_clamp(fn, clamp, fmt_max)
    v = _to_f64(fn, x, nonfinite)
    torch_mode = nonfinite in (NonFinite.TORCH, NonFinite.TORCH_SATURATING)
    if not torch_mode:
        v = _writer_clamp(v, fmt_max if clamp is None else clamp, nonfinite)
    elif clamp is not None:
        v = torch.clamp(v, -clamp, clamp)
    return v, nonfinite, torch_mode


def encode_e4m3fn(x: torch.Tensor, nonfinite: NonFinite | str = NonFinite.FINITE,
                  clamp: float | None = None) -> torch.Tensor:
    """Encode ``x`` (any shape; float32/float64/float16/bfloat16) as OCP E4M3FN codes (uint8).

    RNE from the exact value, signed zero kept (-0.0 -> 0x80, negative underflow -> 0x80),
    subnormals ``m * 2**-9``; the module docstring tables the saturation and non-finite
    behaviour of each ``nonfinite`` policy and the meaning of ``clamp``. Bit-exact on CPU and GPU.
    """
    v, nonfinite, torch_mode = _encoder_input("encode_e4m3fn", x, nonfinite, clamp, E4M3_MAX)
    return _e4m3fn_codes(v, nonfinite)


def _e4m3fn_codes(v: torch.Tensor, nonfinite: NonFinite) -> torch.Tensor:
    """E4M3FN codes of float64 ``v`` that ``_encoder_input`` has already validated and clamped."""
    sign = _sign_bit(v).to(torch.int64) << 7
    a = v.abs()
    finite = torch.isfinite(a)
    mag = _encode_magnitude(torch.where(finite, a, torch.zeros_like(a)), _FN_EMIN)
    if nonfinite is NonFinite.TORCH:
        mag = torch.where(mag > _FN_MAX_CODE, torch.full_like(mag, E4M3FN_NAN), mag)
        mag = torch.where(finite, mag, torch.full_like(mag, E4M3FN_NAN))
    elif nonfinite is NonFinite.TORCH_SATURATING:
        mag = torch.clamp(mag, max=_FN_MAX_CODE)
        mag = torch.where(torch.isinf(a), torch.full_like(mag, _FN_MAX_CODE), mag)
        mag = torch.where(torch.isnan(a), torch.full_like(mag, E4M3FN_NAN), mag)
    else:  # FINITE / CUDA_SATFINITE / TRITON: everything is finite after the clamp; satfinite
        mag = torch.clamp(mag, max=_FN_MAX_CODE)
    return (mag | sign).to(torch.uint8)


def _fn_value(code: int) -> float:
    e, m = (code >> 3) & 0xF, code & 0x7
    if (code & 0x7F) == 0x7F:
        return float("nan")
    mag = m * 2.0**_FN_EMIN * 2.0**-3 if e == 0 else (8 + m) * 2.0 ** (e - E4M3_BIAS - 3)
    return -mag if code & 0x80 else mag


def _fnuz_value(code: int) -> float:
    if code == E4M3FNUZ_NAN:
        return float("nan")
    e, m = (code >> 3) & 0xF, code & 0x7
    mag = m * 2.0**_FNUZ_EMIN * 2.0**-3 if e == 0 else (8 + m) * 2.0 ** (e - E4M3FNUZ_BIAS - 3)
    return -mag if code & 0x80 else mag


_TABLES: dict[Fp8Flavour, torch.Tensor] = {
    Fp8Flavour.E4M3FN: torch.tensor([_fn_value(c) for c in range(256)], dtype=torch.float32),
    Fp8Flavour.E4M3FNUZ: torch.tensor([_fnuz_value(c) for c in range(256)], dtype=torch.float32),
}


def fp8_table(flavour: Fp8Flavour | str) -> torch.Tensor:
    """The 256 decoded values (float32, CPU) of ``flavour``, indexed by code."""
    return _TABLES[validate_flavour("fp8_table", flavour)].clone()


def _decode(fn: str, codes: torch.Tensor, flavour: Fp8Flavour) -> torch.Tensor:
    check_dtype(fn, "codes", codes, (torch.uint8,))
    table = _TABLES[flavour].to(codes.device)
    return table[codes.to(torch.int64)]


def decode_e4m3fn(codes: torch.Tensor) -> torch.Tensor:
    """Exact float32 values of E4M3FN ``codes`` (uint8, any shape); 0x7F/0xFF -> NaN, 0x80 -> -0.0."""
    return _decode("decode_e4m3fn", codes, Fp8Flavour.E4M3FN)


# --------------------------------------------------------------------------- E4M3FNUZ


def encode_e4m3fnuz(x: torch.Tensor, clamp: float | None = None,
                    nonfinite: NonFinite | str = NonFinite.FINITE) -> torch.Tensor:
    """Encode ``x`` as E4M3FNUZ codes (uint8): bias 8, max 240, 0x80 = NaN, no -0.

    RNE from the exact value; -0.0 and negative values that round to zero give 0x00 (H8/H17);
    subnormals ``m * 2**-10``. ``clamp=FNUZ_GFX942_CLAMP`` (224) models the gfx942 SWA writer's
    ``fminf(fmaxf(v, -224), 224)``. Non-finite policies as in the module docstring (both TORCH
    policies: NaN, +-Inf and overflow -> 0x80).
    """
    v, nonfinite, torch_mode = _encoder_input("encode_e4m3fnuz", x, nonfinite, clamp, E4M3FNUZ_MAX)
    return _e4m3fnuz_codes(v, torch_mode)


def _e4m3fnuz_codes(v: torch.Tensor, torch_mode: bool) -> torch.Tensor:
    """E4M3FNUZ codes of float64 ``v`` that ``_encoder_input`` has already validated and clamped."""
    neg = _sign_bit(v)
    a = v.abs()
    finite = torch.isfinite(a)
    mag = _encode_magnitude(torch.where(finite, a, torch.zeros_like(a)), _FNUZ_EMIN)
    if torch_mode:
        nan = (~finite) | (mag > _FNUZ_MAX_CODE)
    else:
        mag = torch.clamp(mag, max=_FNUZ_MAX_CODE)
        nan = torch.zeros_like(finite)
    code = torch.where(neg & (mag != 0), mag | 0x80, mag)  # no -0: a zero magnitude stays 0x00
    code = torch.where(nan, torch.full_like(code, E4M3FNUZ_NAN), code)
    return code.to(torch.uint8)


def decode_e4m3fnuz(codes: torch.Tensor) -> torch.Tensor:
    """Exact float32 values of E4M3FNUZ ``codes`` (uint8); 0x80 -> NaN; there is no -0."""
    return _decode("decode_e4m3fnuz", codes, Fp8Flavour.E4M3FNUZ)


# --------------------------------------------------------------------------- dispatch


def validate_flavour(fn: str, flavour: object) -> Fp8Flavour:
    return check_enum(fn, "flavour", Fp8Flavour, flavour)


def fp8_max(flavour: Fp8Flavour | str) -> float:
    """Largest finite value of ``flavour``: 448.0 (E4M3FN) or 240.0 (E4M3FNUZ)."""
    f = validate_flavour("fp8_max", flavour)
    return E4M3_MAX if f is Fp8Flavour.E4M3FN else E4M3FNUZ_MAX


def encode_fp8(x: torch.Tensor, flavour: Fp8Flavour | str = Fp8Flavour.E4M3FN,
               nonfinite: NonFinite | str = NonFinite.FINITE,
               clamp: float | None = None) -> torch.Tensor:
    """Encode ``x`` as ``flavour`` codes (uint8): ``encode_e4m3fn`` or ``encode_e4m3fnuz``."""
    f = validate_flavour("encode_fp8", flavour)
    if f is Fp8Flavour.E4M3FN:
        return encode_e4m3fn(x, nonfinite=nonfinite, clamp=clamp)
    return encode_e4m3fnuz(x, clamp=clamp, nonfinite=nonfinite)


def encode_fp8_trusted(v: torch.Tensor, flavour: Fp8Flavour, nonfinite: NonFinite, clamp: float | None) -> torch.Tensor:
    """``encode_fp8`` for internal callers whose float64 ``v`` is already known to satisfy the
    ``nonfinite`` contract (finite under FINITE) and whose ``clamp`` is valid: the same codes, no
    validation and therefore no device synchronisation."""
    fmt_max = E4M3_MAX if flavour is Fp8Flavour.E4M3FN else E4M3FNUZ_MAX
    torch_mode = nonfinite in (NonFinite.TORCH, NonFinite.TORCH_SATURATING)
    if torch_mode:
        if v.dtype == torch.float64:
            v = v.to(torch.float32).to(torch.float64)  # torch's cast goes through float (as _to_f64)
        if clamp is not None:
            v = torch.clamp(v, -clamp, clamp)
    else:
        v = _writer_clamp(v.to(torch.float64), fmt_max if clamp is None else clamp, nonfinite)
    if flavour is Fp8Flavour.E4M3FN:
        return _e4m3fn_codes(v, nonfinite)
    return _e4m3fnuz_codes(v, torch_mode)


def decode_fp8(codes: torch.Tensor, flavour: Fp8Flavour | str = Fp8Flavour.E4M3FN,
               read: Fp8Decode | str = Fp8Decode.EXACT) -> torch.Tensor:
    """Float32 values of ``flavour`` codes (uint8, any shape) as a reader with policy ``read``
    decodes them: exact (EXACT), or exponent-0 codes read as normals (EXP0_AS_NORMAL,
    ``reference.policies.Fp8Decode``)."""
    f = validate_flavour("decode_fp8", flavour)
    if check_enum("decode_fp8", "read", Fp8Decode, read) is Fp8Decode.EXACT:
        return _decode("decode_fp8", codes, f)
    check_dtype("decode_fp8", "codes", codes, (torch.uint8,))
    return _EXP0_AS_NORMAL_TABLES[f].to(codes.device)[codes.to(torch.int64)]


def _exp0_as_normal_table(flavour: Fp8Flavour) -> torch.Tensor:
    """``Fp8Decode.EXP0_AS_NORMAL``: the exact table with every exponent-0 code ``s 0000 mmm``
    replaced by ``(-1)**s * (1 + m/8) * 2**(1 - bias - 1)`` (FNUZ's 0x80 stays NaN)."""
    bias = E4M3_BIAS if flavour is Fp8Flavour.E4M3FN else E4M3FNUZ_BIAS
    t = _TABLES[flavour].clone()
    for code in range(256):
        if (code & 0x78) == 0 and not (flavour is Fp8Flavour.E4M3FNUZ and code == 0x80):
            mag = (1 + (code & 7) / 8) * 2.0 ** (-bias)
            t[code] = -mag if code & 0x80 else mag
    return t


_EXP0_AS_NORMAL_TABLES = {f: _exp0_as_normal_table(f) for f in Fp8Flavour}


# --------------------------------------------------------------------------- UE8M0


def ue8m0_from_exponent(e: torch.Tensor) -> torch.Tensor:
    """UE8M0 byte (uint8) of integer exponents ``e``: ``clamp(e + 127, 0, 255)`` (datapath 2.0).

    This is the writers' ``(uint8) fmaxf(fminf(e + 127, 255), 0)``; 255 is the NaN byte.
    """
    fn = "ue8m0_from_exponent"
    check_dtype(fn, "e", e, (torch.int8, torch.int16, torch.int32, torch.int64))
    return torch.clamp(e.to(torch.int64) + UE8M0_BIAS, 0, 255).to(torch.uint8)


def _ue8m0_table(consumer: Ue8m0Consumer) -> torch.Tensor:
    vals = [2.0 ** (b - UE8M0_BIAS) for b in range(256)]  # exact: 2**-127 is an fp32 subnormal
    nan, inf = float("nan"), float("inf")
    if consumer in (Ue8m0Consumer.EXACT, Ue8m0Consumer.FLASHMLA, Ue8m0Consumer.SM120):
        vals[UE8M0_NAN] = nan
    elif consumer in (Ue8m0Consumer.TRITON, Ue8m0Consumer.ROCM_TRITON):
        vals[0], vals[UE8M0_NAN] = 0.0, inf  # ex2.approx.ftz flushes 2**-127 to 0
    elif consumer is Ue8m0Consumer.CUTE:
        vals[0], vals[UE8M0_NAN] = 0.0, inf  # bf16 bits 0x0000 / 0x7F80
    elif consumer is Ue8m0Consumer.ROCM_GFX950:
        vals[UE8M0_NAN] = inf  # fp32 bits 0x7F800000; byte 0 special-cased to 1 << 22 = 2**-127
    return torch.tensor(vals, dtype=torch.float32)


_UE8M0_TABLES = {c: _ue8m0_table(c) for c in Ue8m0Consumer}


def decode_ue8m0(b: torch.Tensor, consumer: Ue8m0Consumer | str = Ue8m0Consumer.EXACT) -> torch.Tensor:
    """Float32 multiplier of UE8M0 bytes ``b`` (uint8) as ``consumer`` decodes them.

    Bytes 1..254: ``2**(b - 127)`` exactly for every consumer. Bytes 0 and 255 per
    ``Ue8m0Consumer`` (datapath 3 table, H4): EXACT/FLASHMLA/SM120 0 -> 2**-127, 255 -> NaN;
    TRITON/ROCM_TRITON/CUTE 0 -> 0.0, 255 -> +Inf; ROCM_GFX950 0 -> 2**-127, 255 -> +Inf.
    """
    fn = "decode_ue8m0"
    check_dtype(fn, "b", b, (torch.uint8,))
    c = check_enum(fn, "consumer", Ue8m0Consumer, consumer)
    return _UE8M0_TABLES[c].to(b.device)[b.to(torch.int64)]


def exact_ceil_log2(r: torch.Tensor) -> torch.Tensor:
    """Smallest integer ``e`` with ``2**e >= r`` (int32) for positive finite float32 ``r``.

    Exact, from the fp32 bits: a normal ``r`` with biased exponent ``E`` and mantissa field ``M``
    is ``2**(E-127) * (1 + M/2**23)``, so ``e = E - 127 + (M != 0)`` (a power of two ``2**k``
    gives ``k``). A subnormal ``r = M * 2**-149`` gives ``-149 + ceil(log2 M)``, with
    ``ceil(log2 M)`` read from the exact ``frexp`` of the integer ``M``. This is the CuTe
    compressor's bit trick ``((bits + 0x7FFFFF) >> 23) - 127`` extended to subnormals (datapath 2.4).
    """
    fn = "exact_ceil_log2"
    check_dtype(fn, "r", r, (torch.float32,))
    bad = ~(torch.isfinite(r) & (r > 0))
    if bool(bad.any()):
        fail(fn, "r", "must be positive and finite", f"{int(bad.sum())} offending elements")
    return ceil_log2(r)


def ceil_log2(r: torch.Tensor) -> torch.Tensor:
    """``exact_ceil_log2`` without the check (no device sync): callers guarantee positive finite fp32 ``r``."""
    bits = r.contiguous().view(torch.int32).to(torch.int64)
    efield = (bits >> 23) & 0xFF
    mant = bits & 0x7FFFFF
    normal = efield - 127 + (mant != 0).to(torch.int64)
    f, k = torch.frexp(torch.where(mant > 0, mant, torch.ones_like(mant)).to(torch.float64))
    ceil_log2_mant = k.to(torch.int64) - (f == 0.5).to(torch.int64)
    sub = -149 + ceil_log2_mant
    return torch.where(efield > 0, normal, sub).to(torch.int32)
