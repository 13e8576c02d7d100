"""The byte-level reference as it was before vectorisation (fp8 + quant + cache_model1 of commit
448e2b5, concatenated), plus a per-token insert built on it: the slow, obviously-correct twin that
``test_vectorised_bytes.py`` compares the product against. Test helper only; never imported by the product."""
# ruff: noqa
from __future__ import annotations

import torch

from dsv4_numerics.reference.constants import *  # noqa: F401,F403
from dsv4_numerics.reference.constants import production_page_stride
from dsv4_numerics.reference.errors import INDEX_DTYPES, check_dtype, check_int, check_rank, check_tensor, fail
from dsv4_numerics.reference.storage import clone_storage
from dsv4_numerics.reference.policies import Fp8Flavour, NonFinite, ScaleRule, SlotSkip, Ue8m0Consumer


# ====================================================================== reference/formats/fp8.py (before)





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
    if n.numel() and (int(n.min()) < -1022 or int(n.max()) > 1023):
        fail("pow2_f64", "n", "must lie in [-1022, 1023] (normal float64 powers of two)")
    return ((n + 1023) << 52).view(torch.float64)


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
    m = torch.round(a * pow2_f64(3 - e))  # torch.round = round half to even; exact product
    return (e - emin) * 8 + m.to(torch.int64)


def _sign_bit(v: torch.Tensor) -> torch.Tensor:
    """Sign bit (bool) of float64 ``v`` read from the bits: -0.0 and negative NaNs included."""
    return v.view(torch.int64) < 0


def _validate_nonfinite(fn: str, nonfinite: object) -> NonFinite:
    try:
        return NonFinite(nonfinite)
    except ValueError:
        fail(fn, "nonfinite", f"must be one of {[p.value for p in NonFinite]}", nonfinite)


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
    elif nonfinite is NonFinite.TRITON:  # tl.clamp on sm_90: NaN -> +-m by the NaN's sign bit
        c = torch.where(nan, torch.where(_sign_bit(v), -m, m).to(c.dtype), c)
    return c


# --------------------------------------------------------------------------- E4M3FN


def _encoder_input(fn: str, x, nonfinite, clamp, fmt_max: float):
    """Validated float64 input of an FP8 encoder, already clamped as the producer clamps it.

    Writer policies apply the writer's ``fminf(fmaxf(v, -M), M)`` with ``M = clamp`` or the
    format maximum ``fmt_max``; the TORCH policies model a bare cast, clamped only if ``clamp``
    is given. Returns ``(v, nonfinite, torch_mode)``.
    """
    check_tensor(fn, "x", x)
    nonfinite = _validate_nonfinite(fn, nonfinite)
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
    fn = "encode_e4m3fn"
    v, nonfinite, torch_mode = _encoder_input(fn, x, nonfinite, clamp, E4M3_MAX)
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
    return _TABLES[_validate_flavour("fp8_table", flavour)].clone()


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
    fn = "encode_e4m3fnuz"
    v, nonfinite, torch_mode = _encoder_input(fn, x, nonfinite, clamp, E4M3FNUZ_MAX)
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


def _validate_flavour(fn: str, flavour: object) -> Fp8Flavour:
    try:
        return Fp8Flavour(flavour)
    except ValueError:
        fail(fn, "flavour", f"must be one of {[f.value for f in Fp8Flavour]}", flavour)


def fp8_max(flavour: Fp8Flavour | str) -> float:
    """Largest finite value of ``flavour``: 448.0 (E4M3FN) or 240.0 (E4M3FNUZ)."""
    f = _validate_flavour("fp8_max", flavour)
    return E4M3_MAX if f is Fp8Flavour.E4M3FN else E4M3FNUZ_MAX


def encode_fp8(x: torch.Tensor, flavour: Fp8Flavour | str = Fp8Flavour.E4M3FN,
               nonfinite: NonFinite | str = NonFinite.FINITE,
               clamp: float | None = None) -> torch.Tensor:
    """Encode ``x`` as ``flavour`` codes (uint8): ``encode_e4m3fn`` or ``encode_e4m3fnuz``."""
    f = _validate_flavour("encode_fp8", flavour)
    if f is Fp8Flavour.E4M3FN:
        return encode_e4m3fn(x, nonfinite=nonfinite, clamp=clamp)
    return encode_e4m3fnuz(x, clamp=clamp, nonfinite=nonfinite)


def decode_fp8(codes: torch.Tensor, flavour: Fp8Flavour | str = Fp8Flavour.E4M3FN) -> torch.Tensor:
    """Exact float32 values of ``flavour`` codes (uint8, any shape)."""
    f = _validate_flavour("decode_fp8", flavour)
    return _decode("decode_fp8", codes, f)


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
    try:
        c = Ue8m0Consumer(consumer)
    except ValueError:
        fail(fn, "consumer", f"must be one of {[x.value for x in Ue8m0Consumer]}", consumer)
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
    bits = r.contiguous().view(torch.int32).to(torch.int64)
    efield = (bits >> 23) & 0xFF
    mant = bits & 0x7FFFFF
    normal = efield - 127 + (mant != 0).to(torch.int64)
    f, k = torch.frexp(torch.where(mant > 0, mant, torch.ones_like(mant)).to(torch.float64))
    ceil_log2_mant = k.to(torch.int64) - (f == 0.5).to(torch.int64)
    sub = -149 + ceil_log2_mant
    return torch.where(efield > 0, normal, sub).to(torch.int32)

# ====================================================================== reference/formats/quant.py (before)





_TORCH_POLICIES = (NonFinite.TORCH, NonFinite.TORCH_SATURATING)
_CHUNK_ELEMENTS = 1 << 16  # rows per internal chunk of quantize_tiles = this // D (results unchanged)


def _fl32_div(a: torch.Tensor, m: float) -> torch.Tensor:
    """Correctly rounded fp32 quotient ``fl32(a / m)`` of fp32 ``a`` by an fp32 constant ``m``.

    Computed as the float64 quotient (itself correctly rounded) rounded once more to fp32. The
    double rounding is innocuous: for IEEE division of p-bit operands, rounding a q-bit
    correctly rounded quotient to p bits equals the direct p-bit rounding whenever q >= 2p + 2
    (S. A. Figueroa, "When is double rounding innocuous?", SIGNUM Newsletter 30(3), 1995);
    here p = 24, q = 53 >= 50. Concretely for m = 448 = 7 * 2**6: ``a / m = (A / 7) * 2**k`` with
    an integer ``A < 2**24``; unless 7 divides ``A`` (then the quotient is exact in float64),
    ``A / 7`` has a periodic binary expansion whose distance to any fp32 rounding midpoint is at
    least 1/14 of an fp32 ulp, far more than the float64 rounding error (at most ``2**-29`` of an
    fp32 ulp), so the float64 result cannot land on or cross a midpoint.
    Results that are fp32 subnormals only occur below the 1e-4 floor of the rules, where the
    value is discarded by ``max``.
    """
    return (a.to(torch.float64) / m).to(torch.float32)


def _validate_rule(fn: str, rule: object) -> ScaleRule:
    try:
        return ScaleRule(rule)
    except ValueError:
        fail(fn, "rule", f"must be one of {[r.value for r in ScaleRule]}", rule)


def tile_exponent(amax: torch.Tensor, rule: ScaleRule | str, fp8_max_value: float = E4M3_MAX) -> torch.Tensor:
    """Exact tile exponent ``e`` (int32, same shape as ``amax``) of datapath 2.0.

    amax: float32, non-negative, finite: the exact max ``|x|`` of each tile.
    AMAX_CLAMP (Q_A):  ``r = fl32(max(a, 1e-4f) / M)``
    SCALE_CLAMP (Q_S): ``r = max(fl32(a / M), 1e-4f)``
    ``e = ceil(log2 r)`` exactly (smallest integer with ``2**e >= r``, ``fp8.exact_ceil_log2``).
    ``M = fp8_max_value``: 448 for E4M3FN; the gfx942 FNUZ writers divide by their clamp, 224
    (``V:models/deepseek_v4/common/ops/cache_utils.py:143,204-209``, datapath 2.1/2.2).
    Ties ``a = 1.75 * 2**m`` give ``a / 448 = 2**(m-8)`` exactly, so ``e = m - 8`` (H16).
    """
    fn = "tile_exponent"
    check_dtype(fn, "amax", amax, (torch.float32,))
    rule = _validate_rule(fn, rule)
    if isinstance(fp8_max_value, bool) or not isinstance(fp8_max_value, (int, float)) or not (
        0.0 < float(fp8_max_value) <= E4M3_MAX
    ):
        fail(fn, "fp8_max_value", f"must be a float in (0, {E4M3_MAX}]", fp8_max_value)
    bad = ~(torch.isfinite(amax) & (amax >= 0))
    if bool(bad.any()):
        fail(fn, "amax", "must be finite and >= 0 (non-finite tiles are handled by quantize_tiles "
             "under a producer NonFinite policy)", f"{int(bad.sum())} offending elements")
    floor = torch.tensor(SCALE_FLOOR_F32, dtype=torch.float32, device=amax.device)
    m = float(fp8_max_value)
    if rule is ScaleRule.AMAX_CLAMP:
        r = _fl32_div(torch.maximum(amax, floor), m)
    else:
        r = torch.maximum(_fl32_div(amax, m), floor)
    return exact_ceil_log2(r)


def check_bf16_values(fn: str, arg: str, x: torch.Tensor) -> None:
    """Require ``x`` to be bfloat16, or float32 whose every element is a bfloat16 value."""
    check_dtype(fn, arg, x, (torch.bfloat16, torch.float32))
    if x.dtype == torch.float32:
        low = x.contiguous().view(torch.int32) & 0xFFFF
        if bool((low != 0).any()):
            fail(fn, arg, "float32 input must hold bfloat16 values (low 16 bits zero)",
                 f"{int((low != 0).sum())} elements are not bfloat16")


def quantize_tiles(
    x: torch.Tensor,
    rule: ScaleRule | str,
    flavour: Fp8Flavour | str = Fp8Flavour.E4M3FN,
    nonfinite: NonFinite | str = NonFinite.FINITE,
    clamp: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``x[..., D]`` in 64-wide tiles with power-of-two scales (datapath 2.0).

    x: bfloat16, or float32 holding bfloat16 values; ``D`` a positive multiple of ``TILE`` (64).
    Returns ``(codes uint8 [..., D], scale_bytes uint8 [..., D // 64])`` with, per tile,
    ``e = tile_exponent(amax, rule, M)``, ``codes = fp8(clamp(x * 2**-e, -M, M))`` (RNE,
    satfinite), ``scale byte = clamp(e + 127, 0, 255)``. ``M = clamp`` if given, else the
    flavour's maximum (448 / 240); ``clamp=FNUZ_GFX942_CLAMP`` with E4M3FNUZ models the gfx942
    SWA writer (M = 224 is both the divisor of the scale rule and the clamp, H8).
    ``x * 2**-e`` is exact (float64); for finite bf16 input ``|x| * 2**-e <= M`` so the clamp never
    bites and the codes are exact RNE of the scaled values; -0.0 -> 0x80 (E4M3FN) / 0x00 (FNUZ).

    ``nonfinite`` (H3, datapath 2.8):
      FINITE          NaN/Inf input raises InputError.
      CUDA_SATFINITE  amax ignores NaN; an Inf tile gets scale byte 255 and ``x * exp2f(-inf) =
                      x * 0``: finite elements -> +-0 (0x00/0x80), Inf elements -> NaN; every
                      NaN after scaling -> -M (0xFE).
      TRITON          as CUDA_SATFINITE but ``x / inf``, and NaN after scaling (canonical,
                      positive) -> +M (0x7E).
      TORCH, TORCH_SATURATING  the torch reference quantisers (FlashMLA ``tests/quant.py``):
                      NaN-propagating ``amax``; a NaN tile gets scale byte 255 (torch's
                      ``float8_e8m0fnu`` cast of NaN) and all codes NaN (0x7F; 0x80 for FNUZ);
                      an Inf tile gets 255, finite elements +-0, Inf elements NaN (0x7F).
                      NaN produced by arithmetic is taken as the canonical positive NaN (its sign
                      is platform dependent in torch and is not modelled).
    """
    fn = "quantize_tiles"
    check_tensor(fn, "x", x)
    rule = _validate_rule(fn, rule)
    flavour = _validate_flavour(fn, flavour)
    nonfinite = _validate_nonfinite(fn, nonfinite)
    check_bf16_values(fn, "x", x)
    if x.dim() == 0 or x.shape[-1] == 0 or x.shape[-1] % TILE != 0:
        fail(fn, "x", f"must have a last dimension that is a positive multiple of {TILE}",
             f"shape {tuple(x.shape)}")
    fmax = fp8_max(flavour)
    if clamp is not None:
        if isinstance(clamp, bool) or not isinstance(clamp, (int, float)) or not (0.0 < float(clamp) <= fmax):
            fail(fn, "clamp", f"must be None or a value in (0, {fmax}] for {flavour.value}", clamp)
    m = fmax if clamp is None else float(clamp)
    d = x.shape[-1]
    rows = x.reshape(-1, d)
    step = max(1, _CHUNK_ELEMENTS // d)
    if rows.shape[0] > step:  # bounded working set: float64 temporaries of big inputs thrash memory
        parts = [quantize_tiles(rows[i : i + step], rule, flavour, nonfinite, clamp)
                 for i in range(0, rows.shape[0], step)]
        codes = torch.cat([p[0] for p in parts]).reshape(x.shape)
        sbytes = torch.cat([p[1] for p in parts]).reshape(*x.shape[:-1], d // TILE)
        return codes, sbytes

    xf = x.to(torch.float32)
    if nonfinite is NonFinite.FINITE and not bool(torch.isfinite(xf).all()):
        fail(fn, "x", "must be finite under nonfinite=FINITE (pick a producer NonFinite policy to "
             "model NaN/Inf)", f"{int((~torch.isfinite(xf)).sum())} non-finite elements")
    tiles = xf.reshape(*x.shape[:-1], d // TILE, TILE)
    absx = tiles.abs()
    if nonfinite in _TORCH_POLICIES:
        amax = absx.amax(dim=-1)  # NaN-propagating like torch.amax
    else:
        amax = torch.where(torch.isnan(absx), torch.zeros_like(absx), absx).amax(dim=-1)  # fmaxf / tl.max
    nan_tile = torch.isnan(amax)
    inf_tile = torch.isinf(amax)
    ok = ~(nan_tile | inf_tile)

    e = tile_exponent(torch.where(ok, amax, torch.zeros_like(amax)), rule, m).to(torch.int64)
    sbytes = ue8m0_from_exponent(e)
    sbytes = torch.where(ok, sbytes, torch.full_like(sbytes, UE8M0_NAN))

    t64 = tiles.to(torch.float64)
    y = t64 * pow2_f64(-e).unsqueeze(-1)  # exact: power-of-two scaling in float64
    y_bad = t64 * 0.0  # Inf tiles: x * exp2f(-inf) (CUDA) == x / inf (Triton) == x / inf (torch)
    y = torch.where(ok.unsqueeze(-1), y, y_bad)
    if nonfinite in _TORCH_POLICIES:
        y = torch.where(nan_tile.unsqueeze(-1), torch.full_like(y, float("nan")), y)
    # NaN produced by the scaling arithmetic is the canonical positive NaN on the GPU (the sign of
    # a NaN element of x is not propagated; float64 CPU arithmetic would keep it): canonicalise.
    y = torch.where(torch.isnan(y), torch.full_like(y, float("nan")), y)
    if nonfinite in _TORCH_POLICIES:
        codes = encode_fp8(y, flavour, nonfinite=nonfinite, clamp=None)
    else:
        codes = encode_fp8(y, flavour, nonfinite=nonfinite, clamp=m)
    return codes.reshape(x.shape), sbytes


def dequantize_tiles(
    codes: torch.Tensor,
    scale_bytes: torch.Tensor,
    flavour: Fp8Flavour | str = Fp8Flavour.E4M3FN,
    consumer: Ue8m0Consumer | str = Ue8m0Consumer.EXACT,
) -> torch.Tensor:
    """``decode(code) * decode_ue8m0(scale byte)`` per 64-wide tile, float32 ``[..., D]``.

    codes: uint8 ``[..., D]``; scale_bytes: uint8 ``[..., D // 64]``. The product is formed in
    float64 (exact: a 4-bit significand times a power of two) and rounded once to float32, so it
    is exact whenever the value is representable in fp32 (always for scale bytes 1..247 except
    ``code >= 256`` with byte 247, which overflows to +-Inf like every consumer); scale bytes 0 and
    255 follow ``consumer`` (H4).
    """
    fn = "dequantize_tiles"
    check_dtype(fn, "codes", codes, (torch.uint8,))
    check_dtype(fn, "scale_bytes", scale_bytes, (torch.uint8,))
    flavour = _validate_flavour(fn, flavour)
    if codes.dim() == 0 or codes.shape[-1] % TILE != 0 or codes.shape[-1] == 0:
        fail(fn, "codes", f"must have a last dimension that is a positive multiple of {TILE}",
             f"shape {tuple(codes.shape)}")
    want = (*codes.shape[:-1], codes.shape[-1] // TILE)
    if tuple(scale_bytes.shape) != want:
        fail(fn, "scale_bytes", f"must have shape {list(want)} (one byte per 64-wide tile of codes)",
             f"shape {tuple(scale_bytes.shape)}")
    vals = decode_fp8(codes, flavour).to(torch.float64).reshape(*want, TILE)
    mult = decode_ue8m0(scale_bytes, consumer).to(torch.float64).unsqueeze(-1)
    return (vals * mult).reshape(codes.shape).to(torch.float32)


def quantize_groups_ue8m0(
    x: torch.Tensor, group: int = OUT_GROUP, eps: float = OUT_EPS
) -> tuple[torch.Tensor, torch.Tensor]:
    """The output epilogue quantiser of vLLM ``fused_inv_rope_fp8_quant`` (attention 3.3).

    x: float32 (or bfloat16) ``[..., G * group]``, finite: the (inverse-roped) fp32 attention output.
    Returns ``(codes uint8 [..., G * group] (E4M3FN), exponents int32 [..., G])``; the UE8M0 byte
    is ``exponent + 127`` and the fp32 scale ``2**exponent``.
    Order modelled (``V:models/deepseek_v4/common/ops/fused_inv_rope_fp8_quant.py:150-162``):
      ``a = max(max_i |x_i|, fl32(eps))``               (fp32 max, exact)
      ``r = fl32(a * fl32(1/448))``                      (a multiply, not a division: ``1.0 / fp8_max``
                                                          is folded to an fp32 constant)
      ``e = ceil(log2 r)``                               (exact here, see below)
      ``codes = e4m3(clamp(x / 2**e, -448, 448))``       (exact scaling, RNE satfinite)
    ``fl32(a * c)``: the float64 product of two fp32 values is exact (48 significant bits), so its
    one rounding to fp32 is the correctly rounded fp32 product. ``fl32(1/448)`` (0x3B124925) lies
    ``1.5 * 2**-25`` (relative) above 1/448 and the first fp32 value above ``448 * 2**k`` lies
    ``2**-23.8`` above it, so ``r`` never rounds onto ``2**k`` when ``a / 448 > 2**k``: the result
    equals ``ceil(log2(a / 448))`` for ``a > 448 * 2**-43``, ``|x| / 2**e <= 448`` and the clamp never
    bites for finite input (it is modelled anyway).
    Divergence not modelled: the kernel takes ``ceil(tl.log2(r))`` with libdevice ``log2f``, which
    is not correctly rounded; for ``r`` within about ``|e| * 2**-24`` (relative) above a power of
    two it can return the integer and give ``e - 1``. Such ``r`` need ``a`` with more than 8
    significant bits (an fp32 RoPE lane); bf16 ``a`` is always at least ``2**-8`` away.
    """
    fn = "quantize_groups_ue8m0"
    check_dtype(fn, "x", x, (torch.float32, torch.bfloat16))
    check_int(fn, "group", group, minimum=1)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (0.0 < float(eps) < 1.0):
        fail(fn, "eps", "must be a float in (0, 1)", eps)
    if x.dim() == 0 or x.shape[-1] == 0 or x.shape[-1] % group != 0:
        fail(fn, "x", f"must have a last dimension that is a positive multiple of group={group}",
             f"shape {tuple(x.shape)}")
    xf = x.to(torch.float32)
    if not bool(torch.isfinite(xf).all()):
        fail(fn, "x", "must be finite (non-finite attention outputs are out of contract)",
             f"{int((~torch.isfinite(xf)).sum())} non-finite elements")
    g = x.shape[-1] // group
    groups = xf.reshape(*x.shape[:-1], g, group)
    eps32 = torch.tensor(eps, dtype=torch.float32, device=x.device)
    a = torch.maximum(groups.abs().amax(dim=-1), eps32)
    inv = torch.tensor(1.0 / E4M3_MAX, dtype=torch.float32).to(torch.float64)  # fl32(1/448)
    r = (a.to(torch.float64) * inv.to(a.device)).to(torch.float32)
    e = exact_ceil_log2(r).to(torch.int64)
    y = groups.to(torch.float64) * pow2_f64(-e).unsqueeze(-1)
    codes = encode_fp8(y, Fp8Flavour.E4M3FN, nonfinite=NonFinite.CUDA_SATFINITE, clamp=E4M3_MAX)
    return codes.reshape(x.shape), e.to(torch.int32)


def dequantize_groups_ue8m0(codes: torch.Tensor, exponents: torch.Tensor, group: int = OUT_GROUP) -> torch.Tensor:
    """Exact float32 values ``decode_e4m3fn(code) * 2**exponent`` of ``quantize_groups_ue8m0`` output."""
    fn = "dequantize_groups_ue8m0"
    check_dtype(fn, "codes", codes, (torch.uint8,))
    check_dtype(fn, "exponents", exponents, (torch.int32, torch.int64))
    check_int(fn, "group", group, minimum=1)
    if codes.dim() == 0 or codes.shape[-1] % group != 0 or codes.shape[-1] == 0:
        fail(fn, "codes", f"must have a last dimension that is a positive multiple of group={group}",
             f"shape {tuple(codes.shape)}")
    want = (*codes.shape[:-1], codes.shape[-1] // group)
    if tuple(exponents.shape) != want:
        fail(fn, "exponents", f"must have shape {list(want)}", f"shape {tuple(exponents.shape)}")
    vals = decode_fp8(codes, Fp8Flavour.E4M3FN).to(torch.float64).reshape(*want, group)
    return (vals * pow2_f64(exponents.to(torch.int64)).unsqueeze(-1)).reshape(codes.shape).to(torch.float32)

# ====================================================================== reference/caches/model1.py (before)






# --------------------------------------------------------------------------- geometry


def empty_cache(num_blocks: int, block_size: int, page_stride: int | None = None, fill: int = 0,
                device: str | torch.device = "cpu") -> torch.Tensor:
    """A 2-D ``uint8`` cache ``[num_blocks, page_stride]`` filled with the byte ``fill``.

    ``page_stride`` defaults to vLLM's ``production_page_stride(block_size)``
    (``round_up(bs*584, 576)``: 37 440 for bs=64, 1 728 for bs=2; datapath 1.2).
    """
    fn = "empty_cache"
    check_int(fn, "num_blocks", num_blocks, minimum=1)
    check_int(fn, "block_size", block_size, minimum=1)
    if page_stride is None:
        page_stride = production_page_stride(block_size)
    check_int(fn, "page_stride", page_stride, minimum=block_size * RECORD_BYTES)
    check_int(fn, "fill", fill, minimum=0)
    if fill > 255:
        fail(fn, "fill", "must be a byte value in [0, 255]", fill)
    return torch.full((num_blocks, page_stride), fill, dtype=torch.uint8, device=device)


def kernel_view(cache: torch.Tensor, block_size: int) -> torch.Tensor:
    """The kernels' ``[num_blocks, bs, 584]`` view (strides ``(P, 584, 1)``) of any accepted cache.

    Its "584-byte rows" are not records (datapath 1.2); only the page-split reading is meaningful.
    """
    nb, bs, p = cache_geometry("kernel_view", cache, block_size)
    return torch.as_strided(cache, (nb, bs, RECORD_BYTES), (p, RECORD_BYTES, 1), cache.storage_offset())


def cache_geometry(fn: str, cache: torch.Tensor, block_size: int) -> tuple[int, int, int]:
    """Validate ``cache`` and return ``(num_blocks, block_size, page_stride)`` (page stride = stride(0))."""
    check_dtype(fn, "cache", cache, (torch.uint8,))
    check_int(fn, "block_size", block_size, minimum=1)
    check_rank(fn, "cache", cache, (2, 3, 4))
    nb, p = cache.shape[0], cache.stride(0)
    need = block_size * RECORD_BYTES
    if nb < 1:
        fail(fn, "cache", "must have at least one page", f"shape {tuple(cache.shape)}")
    if cache.dim() == 2:
        if cache.stride(1) != 1 or cache.shape[1] < need:
            fail(fn, "cache", f"2-D form must be [num_blocks, >= block_size*584 = {need}] with unit "
                 "byte stride", f"shape {tuple(cache.shape)} strides {cache.stride()}")
    else:
        rows = cache.shape[1]
        ok = rows == block_size and cache.shape[-1] == RECORD_BYTES and cache.stride(-1) == 1
        ok = ok and (rows == 1 or cache.stride(1) == RECORD_BYTES)
        if cache.dim() == 4:
            ok = ok and cache.shape[2] == 1
        if not ok:
            fail(fn, "cache", f"kernel view must be [num_blocks, block_size={block_size}, (1,) 584] with "
                 "strides (page_stride, 584, (.,) 1)", f"shape {tuple(cache.shape)} strides {cache.stride()}")
    if nb > 1 and p < need:
        fail(fn, "cache", f"page stride cache.stride(0) must be >= block_size*584 = {need}", p)
    if nb > 1 and cache.dim() == 2 and p < cache.shape[1]:
        fail(fn, "cache", "2-D form must not overlap pages (stride(0) >= shape[1])",
             f"shape {tuple(cache.shape)} strides {cache.stride()}")
    if nb == 1:
        p = max(p, need) if cache.dim() > 2 else max(p, cache.shape[1])
    avail = cache.untyped_storage().nbytes() - cache.storage_offset()
    if avail < nb * p:
        fail(fn, "cache", f"storage must hold num_blocks*page_stride = {nb * p} bytes from the view's "
             "offset (vLLM allocates whole pages)", f"{avail} bytes")
    return nb, block_size, p


def flat_bytes(cache: torch.Tensor, nb: int, p: int) -> torch.Tensor:
    """1-D uint8 view of the ``nb * p`` page bytes backing ``cache`` (writes go to ``cache``)."""
    return torch.as_strided(cache, (nb * p,), (1,), cache.storage_offset())


def page_bytes(cache: torch.Tensor, block_size: int) -> torch.Tensor:
    """A ``[num_blocks, page_stride]`` uint8 view of every byte of every page (tails included)."""
    nb, _, p = cache_geometry("page_bytes", cache, block_size)
    return torch.as_strided(cache, (nb, p), (p, 1), cache.storage_offset())


def slot_addresses(slots: torch.Tensor, block_size: int, page_stride: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Byte addresses (int64) of the data row and the scale row of global ``slots`` (datapath 1.3).

    ``data = page*P + e*576`` (code of dim i at ``data + i``, bf16 of dim 448+j at ``data + 448 + 2j``);
    ``scale = page*P + bs*576 + e*8`` (tile b at ``scale + b``, pad at ``scale + 7``);
    ``page = s // bs``, ``e = s % bs``. Slots must be >= 0.
    """
    fn = "slot_addresses"
    check_dtype(fn, "slots", slots, INDEX_DTYPES)
    check_int(fn, "block_size", block_size, minimum=1)
    check_int(fn, "page_stride", page_stride, minimum=block_size * RECORD_BYTES)
    s = slots.to(torch.int64)
    if bool((s < 0).any()):
        fail(fn, "slots", "must be >= 0 (filter the -1 sentinels first)")
    page, e = s // block_size, s % block_size
    return page * page_stride + e * DATA_ROW_BYTES, page * page_stride + block_size * DATA_ROW_BYTES + e * SCALE_ROW_BYTES


# --------------------------------------------------------------------------- records


def _check_k(fn: str, k: torch.Tensor) -> None:
    check_dtype(fn, "k", k, (torch.bfloat16,))
    check_rank(fn, "k", k, 2)
    if k.shape[1] != HEAD_DIM:
        fail(fn, "k", f"must have last dimension {HEAD_DIM} (448 NoPE + 64 RoPE dims)", f"shape {tuple(k.shape)}")


def encode_records(
    k: torch.Tensor,
    rule: ScaleRule | str,
    flavour: Fp8Flavour | str = Fp8Flavour.E4M3FN,
    nonfinite: NonFinite | str = NonFinite.FINITE,
    clamp: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode bf16 rows ``k [N, 512]`` (already roped) into MODEL1 record parts.

    Returns ``(data uint8 [N, 576], scales uint8 [N, 8])``: ``data[:, :448]`` = FP8 codes of the
    7 tiles (``quant.quantize_tiles`` under ``rule``/``flavour``/``nonfinite``/``clamp``),
    ``data[:, 448:]`` = the little-endian bytes of ``k[:, 448:]`` verbatim, ``scales[:, :7]`` = UE8M0
    bytes, ``scales[:, 7]`` = 0 (the vLLM writers' pad byte). Under ``nonfinite=FINITE`` any
    non-finite element of ``k`` (RoPE dims included) raises; otherwise RoPE NaN/Inf are copied.
    """
    fn = "encode_records"
    check_tensor(fn, "k", k)
    _check_k(fn, k)
    nonfinite = _validate_nonfinite(fn, nonfinite)
    if nonfinite is NonFinite.FINITE and not bool(torch.isfinite(k).all()):
        fail(fn, "k", "must be finite under nonfinite=FINITE (RoPE dims included)",
             f"{int((~torch.isfinite(k)).sum())} non-finite elements")
    codes, sbytes = quantize_tiles(k[:, :NOPE_DIM], rule, flavour, nonfinite, clamp)
    n = k.shape[0]
    data = torch.empty((n, DATA_ROW_BYTES), dtype=torch.uint8, device=k.device)
    data[:, :NOPE_DIM] = codes
    data[:, NOPE_DIM:] = _bf16_to_le_bytes(k[:, NOPE_DIM:])
    scales = torch.zeros((n, SCALE_ROW_BYTES), dtype=torch.uint8, device=k.device)
    scales[:, :N_TILES] = sbytes
    return data, scales


def _bf16_to_le_bytes(x: torch.Tensor) -> torch.Tensor:
    """Little-endian bytes ``[..., 2*n]`` of bf16 ``x [..., n]`` (explicit, host-endianness free)."""
    bits = x.contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
    out = torch.stack(((bits & 0xFF), (bits >> 8)), dim=-1)
    return out.reshape(*x.shape[:-1], 2 * x.shape[-1]).to(torch.uint8)


def _le_bytes_to_bf16(b: torch.Tensor) -> torch.Tensor:
    """bf16 ``[..., n]`` from little-endian bytes ``[..., 2*n]``."""
    pairs = b.reshape(*b.shape[:-1], b.shape[-1] // 2, 2).to(torch.int32)
    bits = pairs[..., 0] | (pairs[..., 1] << 8)
    bits = torch.where(bits >= 0x8000, bits - 0x10000, bits).to(torch.int16)
    return bits.view(torch.bfloat16)


def decode_records(
    data: torch.Tensor,
    scales: torch.Tensor,
    flavour: Fp8Flavour | str = Fp8Flavour.E4M3FN,
    consumer: Ue8m0Consumer | str = Ue8m0Consumer.EXACT,
) -> torch.Tensor:
    """bf16 rows ``[N, 512]`` from record parts ``data [N, 576]``, ``scales [N, 8]``.

    NoPE: ``code * 2**(s - 127)`` formed exactly (float64) and rounded once to bf16 (RNE), which is
    what every consumer computes (datapath 3: fp32 or bf16 multiply of exact operands). It is
    exact for scale bytes 1..254 unless the product leaves bf16's range (overflow to +-Inf for
    bytes >= 247 with large codes; values below 2**-133 for bytes <= 13, never produced by finite
    writers whose bytes lie in [105, 247]). Bytes 0 and 255 follow ``consumer`` (H4).
    RoPE: the stored bf16 verbatim.
    """
    fn = "decode_records"
    check_dtype(fn, "data", data, (torch.uint8,))
    check_dtype(fn, "scales", scales, (torch.uint8,))
    check_rank(fn, "data", data, 2)
    if data.shape[1] != DATA_ROW_BYTES:
        fail(fn, "data", f"must have shape [N, {DATA_ROW_BYTES}]", f"shape {tuple(data.shape)}")
    if tuple(scales.shape) != (data.shape[0], SCALE_ROW_BYTES):
        fail(fn, "scales", f"must have shape [{data.shape[0]}, {SCALE_ROW_BYTES}]", f"shape {tuple(scales.shape)}")
    flavour = _validate_flavour(fn, flavour)
    nope = dequantize_tiles(data[:, :NOPE_DIM], scales[:, :N_TILES], flavour, consumer)
    rope = _le_bytes_to_bf16(data[:, NOPE_DIM:])
    return torch.cat((nope.to(torch.bfloat16), rope), dim=1)


# --------------------------------------------------------------------------- insert / read


def _check_slots(fn: str, arg: str, slots: torch.Tensor) -> torch.Tensor:
    check_dtype(fn, arg, slots, INDEX_DTYPES)
    check_rank(fn, arg, slots, 1)
    return slots.to(torch.int64)


def insert(
    cache: torch.Tensor,
    k: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_size: int,
    rule: ScaleRule | str,
    flavour: Fp8Flavour | str = Fp8Flavour.E4M3FN,
    nonfinite: NonFinite | str = NonFinite.FINITE,
    slot_skip: SlotSkip | str = SlotSkip.ALL_NEGATIVE,
    clamp: float | None = None,
) -> torch.Tensor:
    """Quantise ``k`` and write token ``t`` to global slot ``slot_mapping[t]``; returns a NEW cache.

    cache: uint8 cache in an accepted form (module docstring); it is not modified. The result has
    the same sizes, strides and storage offset; bytes outside the written slots' 584 bytes
    (page tails, other slots) are copied unchanged.
    k: bfloat16 ``[N, 512]``, already roped. slot_mapping: int32/int64 ``[L]``, ``L <= N``; only
    tokens ``t < L`` are considered (DP padding rows of ``k`` are ignored, datapath 2.1 step 1).
    slot_skip: ALL_NEGATIVE (CUDA writer) skips every negative slot; MINUS1_ONLY (Triton writer)
    skips ``-1`` and raises for any other negative slot, which that writer would write out of
    bounds (``V:.../cache_utils.py:81-84``). Slots ``>= num_blocks * block_size`` and a slot
    written twice (a race between producer threads) raise InputError.
    rule/flavour/nonfinite/clamp: as ``encode_records``.
    """
    fn = "insert"
    nb, bs, p = cache_geometry(fn, cache, block_size)
    check_tensor(fn, "k", k)
    _check_k(fn, k)
    slots = _check_slots(fn, "slot_mapping", slot_mapping)
    try:
        slot_skip = SlotSkip(slot_skip)
    except ValueError:
        fail(fn, "slot_skip", f"must be one of {[s.value for s in SlotSkip]}", slot_skip)
    if slots.shape[0] > k.shape[0]:
        fail(fn, "slot_mapping", f"must not be longer than k (N = {k.shape[0]})", f"length {slots.shape[0]}")
    slots = slots.to("cpu")
    if slot_skip is SlotSkip.MINUS1_ONLY:
        bad = (slots < 0) & (slots != -1)
        if bool(bad.any()):
            fail(fn, "slot_mapping", "may hold no negative value other than -1 under slot_skip="
                 "MINUS1_ONLY: the Triton writer skips only -1 and would write other negative slots "
                 "out of bounds", f"{slots[bad][:4].tolist()}")
    keep = slots >= 0
    if bool((slots >= nb * bs).any()):
        fail(fn, "slot_mapping", f"must be < num_blocks*block_size = {nb * bs} (out of range)",
             f"max {int(slots.max())}")
    tokens = torch.nonzero(keep).flatten()
    written = slots[tokens]
    if written.numel() != torch.unique(written).numel():
        fail(fn, "slot_mapping", "must not write one slot twice (producer threads would race)")
    data, scales = encode_records(k[: slots.shape[0]][tokens.to(k.device)], rule, flavour, nonfinite, clamp)
    out = clone_storage(cache)
    flat = flat_bytes(out, nb, p)
    d_addr, s_addr = slot_addresses(written, bs, p)
    dev = cache.device
    d_idx = (d_addr.unsqueeze(1) + torch.arange(DATA_ROW_BYTES)).to(dev)
    s_idx = (s_addr.unsqueeze(1) + torch.arange(SCALE_ROW_BYTES)).to(dev)
    flat[d_idx.flatten()] = data.to(dev).flatten()
    flat[s_idx.flatten()] = scales.to(dev).flatten()
    return out


def read_records(cache: torch.Tensor, slots: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw record parts ``(data uint8 [S, 576], scales uint8 [S, 8])`` of global ``slots`` (>= 0, in range)."""
    fn = "read_records"
    nb, bs, p = cache_geometry(fn, cache, block_size)
    s = _check_slots(fn, "slots", slots).to("cpu")
    if bool(((s < 0) | (s >= nb * bs)).any()):
        fail(fn, "slots", f"must lie in [0, num_blocks*block_size = {nb * bs})")
    flat = flat_bytes(cache, nb, p)
    d_addr, s_addr = slot_addresses(s, bs, p)
    d_idx = (d_addr.unsqueeze(1) + torch.arange(DATA_ROW_BYTES)).to(cache.device)
    s_idx = (s_addr.unsqueeze(1) + torch.arange(SCALE_ROW_BYTES)).to(cache.device)
    return flat[d_idx], flat[s_idx]


def dequantize_slots(
    cache: torch.Tensor,
    slots: torch.Tensor,
    block_size: int,
    flavour: Fp8Flavour | str = Fp8Flavour.E4M3FN,
    consumer: Ue8m0Consumer | str = Ue8m0Consumer.EXACT,
) -> torch.Tensor:
    """bf16 rows ``[S, 512]`` of global ``slots`` (``decode_records`` of ``read_records``)."""
    data, scales = read_records(cache, slots, block_size)
    return decode_records(data, scales, flavour, consumer)


def dequantize_all(
    cache: torch.Tensor,
    block_size: int,
    flavour: Fp8Flavour | str = Fp8Flavour.E4M3FN,
    consumer: Ue8m0Consumer | str = Ue8m0Consumer.EXACT,
) -> torch.Tensor:
    """bf16 ``[num_blocks * bs, 512]``: row ``s`` = dequantised slot ``s`` (what an attention
    oracle indexes by global slot). Unwritten slots decode whatever stale bytes they hold."""
    nb, bs, _ = cache_geometry("dequantize_all", cache, block_size)
    return dequantize_slots(cache, torch.arange(nb * bs, device=cache.device), bs, flavour, consumer)


def gather(
    cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    gather_lens: torch.Tensor | None = None,
    flavour: Fp8Flavour | str = Fp8Flavour.E4M3FN,
    consumer: Ue8m0Consumer | str = Ue8m0Consumer.EXACT,
    offset: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Model of vLLM ``dequantize_and_gather_k_cache`` (``V:.../cache_utils.py:249-365,474-525``;
    CuTe twin ``nvidia/ops/dequant_gather_k_cutedsl.py``; datapath 4.5).

    For request ``b`` with ``L = seq_lens[b]`` and ``g = gather_lens[b]`` (``L`` when None), output
    row ``offset + i`` (``0 <= i < g``) is the dequantised record at request position
    ``pos = L - g + i``, slot ``block_table[b, pos // bs] * bs + pos % bs``.
    Returns ``(out bf16 [R, offset + max(g), 512], valid bool [R, offset + max(g)])``; rows the
    kernel does not write (``valid`` False) are zero here and stale in the kernel's ``out``.
    Inputs: block_table int32/int64 ``[R, max_blocks]``; seq_lens, gather_lens int ``[R]`` with
    ``0 <= g <= L``; the table must cover every gathered position and its entries there must be
    valid pages ``[0, num_blocks)``. Scale bytes 0/255 decode per ``consumer`` (Triton and CuTe
    gathers: ``Ue8m0Consumer.TRITON`` / ``CUTE``).
    """
    fn = "gather"
    nb, bs, p = cache_geometry(fn, cache, block_size)
    check_dtype(fn, "block_table", block_table, INDEX_DTYPES)
    check_rank(fn, "block_table", block_table, 2)
    seq = _check_slots(fn, "seq_lens", seq_lens).cpu()
    r = block_table.shape[0]
    if seq.shape[0] != r:
        fail(fn, "seq_lens", f"must have one entry per block_table row ({r})", f"length {seq.shape[0]}")
    if bool((seq < 0).any()):
        fail(fn, "seq_lens", "must be >= 0")
    if gather_lens is None:
        g = seq.clone()
    else:
        g = _check_slots(fn, "gather_lens", gather_lens).cpu()
        if g.shape[0] != r:
            fail(fn, "gather_lens", f"must have one entry per request ({r})", f"length {g.shape[0]}")
        if bool(((g < 0) | (g > seq)).any()):
            fail(fn, "gather_lens", "must satisfy 0 <= gather_lens[b] <= seq_lens[b]")
    check_int(fn, "offset", offset, minimum=0)
    bt = block_table.to(torch.int64).cpu()
    width = offset + (int(g.max()) if r else 0)
    out = torch.zeros((r, width, HEAD_DIM), dtype=torch.bfloat16, device=cache.device)
    valid = torch.zeros((r, width), dtype=torch.bool, device=cache.device)
    req_idx, row_idx, slot_list = [], [], []
    for b in range(r):
        L, gb = int(seq[b]), int(g[b])
        if gb == 0:
            continue
        pos = torch.arange(L - gb, L, dtype=torch.int64)
        blk = pos // bs
        if int(blk.max()) >= bt.shape[1]:
            fail(fn, "block_table", f"row {b} is too short: position {L - 1} needs block index "
                 f"{int(blk.max())} but the table has {bt.shape[1]} columns")
        pages = bt[b, blk]
        if bool(((pages < 0) | (pages >= nb)).any()):
            fail(fn, "block_table", f"row {b} must hold pages in [0, num_blocks = {nb}) for the gathered "
                 "positions", f"{pages[(pages < 0) | (pages >= nb)][:4].tolist()}")
        req_idx.append(torch.full((gb,), b, dtype=torch.int64))
        row_idx.append(offset + torch.arange(gb, dtype=torch.int64))
        slot_list.append(pages * bs + pos % bs)
    if slot_list:
        slots = torch.cat(slot_list)
        rows = dequantize_slots(cache, slots, bs, flavour, consumer)
        ri, rr = torch.cat(req_idx).to(cache.device), torch.cat(row_idx).to(cache.device)
        out[ri, rr] = rows
        valid[ri, rr] = True
    return out, valid


# --------------------------------------------------------------------------- defined bytes


def defined_byte_mask(
    cache: torch.Tensor | tuple[int, int],
    written_slots: torch.Tensor,
    block_size: int,
    include_pad: bool = False,
) -> torch.Tensor:
    """bool ``[num_blocks, page_stride]`` over the page bytes: True on the defined bytes of
    ``written_slots`` (H5): 576 data bytes + 7 scale bytes per slot, + the pad byte when
    ``include_pad`` (only meaningful for vLLM producers, which write 0 there).

    cache: an accepted cache tensor (geometry read from it) or a ``(num_blocks, page_stride)`` pair.
    written_slots: int ``[S]``; negative entries (the -1 sentinel) are ignored.
    """
    fn = "defined_byte_mask"
    if isinstance(cache, torch.Tensor):
        nb, bs, p = cache_geometry(fn, cache, block_size)
        device = cache.device
    else:
        if not (isinstance(cache, tuple) and len(cache) == 2):
            fail(fn, "cache", "must be a cache tensor or a (num_blocks, page_stride) tuple", type(cache).__name__)
        nb = check_int(fn, "cache[0] (num_blocks)", cache[0], minimum=1)
        check_int(fn, "block_size", block_size, minimum=1)
        p = check_int(fn, "cache[1] (page_stride)", cache[1], minimum=block_size * RECORD_BYTES)
        bs, device = block_size, torch.device("cpu")
    s = _check_slots(fn, "written_slots", written_slots).cpu()
    s = s[s >= 0]
    if bool((s >= nb * bs).any()):
        fail(fn, "written_slots", f"must be < num_blocks*block_size = {nb * bs}")
    mask = torch.zeros(nb * p, dtype=torch.bool)
    d_addr, s_addr = slot_addresses(s, bs, p)
    mask[(d_addr.unsqueeze(1) + torch.arange(DATA_ROW_BYTES)).flatten()] = True
    n_scale = SCALE_ROW_BYTES if include_pad else PAD_BYTE_INDEX
    mask[(s_addr.unsqueeze(1) + torch.arange(n_scale)).flatten()] = True
    return mask.reshape(nb, p).to(device)
