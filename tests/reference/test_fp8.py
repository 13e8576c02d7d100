"""FP8 / UE8M0 codecs: all 256 codes both ways, rounding boundaries, non-finite policies.

Expected tables are built here from the format definitions (sign, exponent field, mantissa field
and bias written out), never from the code under test; torch's own float8 dtypes are a second,
independent oracle where torch has them.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dsv4_numerics.reference.errors import InputError
from dsv4_numerics.reference.formats.fp8 import (
    decode_e4m3fn,
    decode_e4m3fnuz,
    decode_fp8,
    decode_ue8m0,
    encode_e4m3fn,
    encode_e4m3fnuz,
    encode_fp8,
    exact_ceil_log2,
    ue8m0_from_exponent,
)
from dsv4_numerics.reference.policies import Fp8Flavour, NonFinite, Ue8m0Consumer

NAN, INF = float("nan"), float("inf")
ALL = torch.arange(256, dtype=torch.uint8)


# ----------------------------------------------------------------------------- hand tables

def e4m3fn_by_definition(c: int) -> float:
    """OCP E4M3FN: sign bit 7, exponent bits 6..3 (bias 7), mantissa bits 2..0.
    E = 0: (M/8) * 2**(1-7) (subnormal); else (1 + M/8) * 2**(E-7); S.1111.111 is NaN."""
    s, e, m = c >> 7, (c >> 3) & 0b1111, c & 0b111
    if e == 0b1111 and m == 0b111:
        return NAN
    mag = (m / 8) * 2.0 ** (1 - 7) if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
    return -mag if s else mag


def e4m3fnuz_by_definition(c: int) -> float:
    """E4M3FNUZ: bias 8; E = 0: (M/8) * 2**(1-8); else (1 + M/8) * 2**(E-8); 1.0000.000 is the
    only NaN (no negative zero)."""
    if c == 0x80:
        return NAN
    s, e, m = c >> 7, (c >> 3) & 0b1111, c & 0b111
    mag = (m / 8) * 2.0 ** (1 - 8) if e == 0 else (1 + m / 8) * 2.0 ** (e - 8)
    return -mag if s else mag


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """float32 equality that also distinguishes -0.0 and treats NaN == NaN."""
    a, b = a.to(torch.float32), b.to(torch.float32)
    nan = torch.isnan(a)
    if not torch.equal(nan, torch.isnan(b)):
        return False
    return torch.equal(a[~nan].view(torch.int32), b[~nan].view(torch.int32))


FN_TABLE = torch.tensor([e4m3fn_by_definition(c) for c in range(256)], dtype=torch.float64)
FNUZ_TABLE = torch.tensor([e4m3fnuz_by_definition(c) for c in range(256)], dtype=torch.float64)


def test_hand_table_landmarks():
    # the definition itself, checked at a few well-known codes
    assert FN_TABLE[0x7E] == 448.0 and FN_TABLE[0x38] == 1.0 and FN_TABLE[0x01] == 2.0**-9
    assert FN_TABLE[0x08] == 2.0**-6 and math.isnan(FN_TABLE[0x7F]) and math.isnan(FN_TABLE[0xFF])
    assert FNUZ_TABLE[0x7F] == 240.0 and FNUZ_TABLE[0x40] == 1.0 and FNUZ_TABLE[0x01] == 2.0**-10
    assert math.isnan(FNUZ_TABLE[0x80]) and FNUZ_TABLE[0xFF] == -240.0


# ----------------------------------------------------------------------------- decode, all 256 codes

def test_decode_e4m3fn_all_codes_vs_definition_and_torch():
    got = decode_e4m3fn(ALL)
    assert got.dtype == torch.float32
    assert same_bits(got, FN_TABLE)
    assert same_bits(got, ALL.view(torch.float8_e4m3fn).to(torch.float32))
    assert got[0x80].item() == 0.0 and torch.signbit(got[0x80])  # -0.0


def test_decode_e4m3fnuz_all_codes_vs_definition_and_torch():
    got = decode_e4m3fnuz(ALL)
    assert same_bits(got, FNUZ_TABLE)
    assert same_bits(got, ALL.view(torch.float8_e4m3fnuz).to(torch.float32))


def test_decode_fp8_dispatch():
    assert same_bits(decode_fp8(ALL, Fp8Flavour.E4M3FN), FN_TABLE)
    assert same_bits(decode_fp8(ALL, "e4m3fnuz"), FNUZ_TABLE)


# ----------------------------------------------------------------------------- encode, all codes

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_encode_e4m3fn_every_finite_code_roundtrips(dtype):
    codes = [c for c in range(256) if not math.isnan(FN_TABLE[c])]
    vals = FN_TABLE[codes].to(dtype)  # every E4M3 value is exact in bf16 (<= 4 significant bits)
    assert torch.equal(encode_e4m3fn(vals), torch.tensor(codes, dtype=torch.uint8))


def test_encode_e4m3fnuz_every_finite_code_roundtrips():
    codes = [c for c in range(256) if c != 0x80]
    assert torch.equal(encode_e4m3fnuz(FNUZ_TABLE[codes]), torch.tensor(codes, dtype=torch.uint8))


def _midpoint_cases(table: torch.Tensor, max_code: int):
    """(value, expected code) for midpoints between adjacent positive codes and values just off them."""
    out = []
    for c in range(0, max_code):
        lo, hi = table[c].item(), table[c + 1].item()
        mid = (lo + hi) / 2  # exact in float64
        even = c if c % 2 == 0 else c + 1  # the code's LSB is the mantissa LSB: ties go to even
        out.append((mid, even))
        out.append((math.nextafter(mid, -INF), c))
        out.append((math.nextafter(mid, INF), c + 1))
    return out


def test_encode_e4m3fn_midpoints_ties_to_even():
    cases = _midpoint_cases(FN_TABLE, 0x7E)
    x = torch.tensor([v for v, _ in cases], dtype=torch.float64)
    want = torch.tensor([c for _, c in cases], dtype=torch.uint8)
    assert torch.equal(encode_e4m3fn(x), want)
    assert torch.equal(encode_e4m3fn(-x), want | 0x80)


def test_encode_e4m3fnuz_midpoints_ties_to_even():
    cases = _midpoint_cases(FNUZ_TABLE, 0x7F)
    x = torch.tensor([v for v, _ in cases], dtype=torch.float64)
    want = torch.tensor([c for _, c in cases], dtype=torch.uint8)
    assert torch.equal(encode_e4m3fnuz(x), want)
    neg = torch.where(want == 0, want, want | 0x80)  # negative values rounding to 0 give 0x00
    assert torch.equal(encode_e4m3fnuz(-x), neg)


def test_encode_e4m3fn_boundaries_by_hand():
    # value -> code, each derived from the definition:
    cases = [
        (448.0, 0x7E),  # largest finite: 1.75 * 2**8
        (416.0, 0x7D),  # 1.625 * 2**8
        (432.0, 0x7E),  # tie between 416 (0x7D, odd) and 448 (0x7E, even) -> 0x7E
        (2.0**-9, 0x01),  # smallest subnormal
        (2.0**-10, 0x00),  # half of it: tie between 0 (even) and 0x01 -> 0
        (2.0**-10 * (1 + 2.0**-20), 0x01),  # just above half -> rounds up
        (3 * 2.0**-10, 0x02),  # tie between 0x01 and 0x02 -> even 0x02
        (7 * 2.0**-9, 0x07),  # largest subnormal
        (15 * 2.0**-10, 0x08),  # tie between 7*2**-9 (0x07) and 2**-6 (0x08) -> 0x08
        (0.0, 0x00),
        (-0.0, 0x80),  # signed zero keeps its sign
        (-1e-30, 0x80),  # negative underflow keeps its sign (H17)
        (1.0, 0x38),  # exponent field 7, mantissa 0
        (-1.5, 0xBC),  # 1 0111 100
    ]
    x = torch.tensor([v for v, _ in cases], dtype=torch.float64)
    assert encode_e4m3fn(x).tolist() == [c for _, c in cases]


def test_encode_e4m3fn_saturation_and_torch_policies():
    x = torch.tensor([464.0, 465.0, 479.0, 480.0, 1e30, -464.0, -500.0], dtype=torch.float32)
    # satfinite: everything beyond 448 saturates to +-448
    assert encode_e4m3fn(x).tolist() == [0x7E, 0x7E, 0x7E, 0x7E, 0x7E, 0xFE, 0xFE]
    # torch 2.11: 464 ties to even (448); (464, 480) rounds up into 0x7F; >= 480 -> 0x7F; sign kept
    assert encode_e4m3fn(x, NonFinite.TORCH).tolist() == [0x7E, 0x7F, 0x7F, 0x7F, 0x7F, 0xFE, 0xFF]
    # torch 2.13: finite overflow saturates
    assert encode_e4m3fn(x, NonFinite.TORCH_SATURATING).tolist() == [0x7E] * 5 + [0xFE, 0xFE]


def test_encode_e4m3fn_nonfinite_policies_by_hand():
    x = torch.tensor([NAN, -NAN, INF, -INF], dtype=torch.float32)
    # CUDA: fminf(fmaxf(v, -448), 448): fmaxf(NaN, -448) = -448 -> 0xFE; Inf -> +-448
    assert encode_e4m3fn(x, NonFinite.CUDA_SATFINITE).tolist() == [0xFE, 0xFE, 0x7E, 0xFE]
    # Triton tl.clamp (measured on H200): NaN -> +-448 by the NaN's sign bit; Inf -> +-448
    assert encode_e4m3fn(x, NonFinite.TRITON).tolist() == [0x7E, 0xFE, 0x7E, 0xFE]
    # torch 2.11 cast: NaN/Inf -> 0x7F with the sign bit
    assert encode_e4m3fn(x, NonFinite.TORCH).tolist() == [0x7F, 0xFF, 0x7F, 0xFF]
    assert encode_e4m3fn(x, NonFinite.TORCH_SATURATING).tolist() == [0x7F, 0xFF, 0x7E, 0xFE]
    with pytest.raises(InputError, match="encode_e4m3fn.*'x'.*finite"):
        encode_e4m3fn(x)


def test_installed_torch_cast_matches_one_torch_policy():
    """torch's float8_e4m3fn cast is exactly one of the two modelled torch versions."""
    grid = torch.cat([
        torch.tensor([NAN, -NAN, INF, -INF, 464.0, 465.0, 470.0, 479.9, 480.0, 500.0, 1e30, -470.0, -0.0]),
        torch.linspace(-600, 600, 4801),
    ]).to(torch.float32)
    got = grid.to(torch.float8_e4m3fn).view(torch.uint8)
    a = encode_e4m3fn(grid, NonFinite.TORCH)
    b = encode_e4m3fn(grid, NonFinite.TORCH_SATURATING)
    assert torch.equal(got, a) or torch.equal(got, b)


def test_torch_policy_double_rounds_float64_like_torch():
    # 1.0625 is the midpoint of 1.0 (0x38) and 1.125 (0x39); 2**-40 above it is lost when torch
    # first rounds the double to float (fp32 ulp at 1 is 2**-23), then the tie goes to even.
    x = torch.tensor([1.0625 + 2.0**-40], dtype=torch.float64)
    assert encode_e4m3fn(x).tolist() == [0x39]  # exact RNE from the double
    assert encode_e4m3fn(x, NonFinite.TORCH).tolist() == [0x38]
    assert encode_e4m3fn(x, NonFinite.TORCH).tolist() == x.to(torch.float8_e4m3fn).view(torch.uint8).tolist()


def test_encode_e4m3fn_all_bf16_values_vs_torch():
    """Exhaustive: every finite bf16 bit pattern; torch's RNE cast of the 448-clamped value is the oracle
    (torch saturates nothing below 464, so the clamp makes it version independent)."""
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    x = bits.view(torch.bfloat16)
    x = x[torch.isfinite(x)]
    want = x.to(torch.float32).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(encode_e4m3fn(x), want)


def test_encode_e4m3fnuz_all_bf16_values_vs_torch():
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    x = bits.view(torch.bfloat16)
    x = x[torch.isfinite(x)]
    want = x.to(torch.float32).clamp(-240, 240).to(torch.float8_e4m3fnuz).view(torch.uint8)
    assert torch.equal(encode_e4m3fnuz(x), want)


@given(st.floats(width=32, allow_nan=False, allow_infinity=False, min_value=-463.0, max_value=463.0))
def test_encode_e4m3fn_float32_matches_torch(v):
    x = torch.tensor([v], dtype=torch.float32)
    assert torch.equal(encode_e4m3fn(x), x.to(torch.float8_e4m3fn).view(torch.uint8))


def test_encode_e4m3fnuz_no_negative_zero_and_clamp():
    cases = [
        (-0.0, 0x00),  # no -0 in FNUZ
        (-(2.0**-12), 0x00),  # negative underflow -> 0x00, not 0x80 (0x80 is NaN)
        (-(2.0**-11), 0x00),  # tie between 0 and 2**-10 -> 0
        (-(2.0**-11) * (1 + 2.0**-10), 0x81),  # just above the tie -> -2**-10
        (240.0, 0x7F),
        (248.0, 0x7F),  # satfinite
        (-1.0, 0xC0),  # 1 1000 000
    ]
    x = torch.tensor([v for v, _ in cases], dtype=torch.float64)
    assert encode_e4m3fnuz(x).tolist() == [c for _, c in cases]
    # gfx942 writer: clamp to +-224 first; 224 = 1.75 * 2**7: exponent field 15, mantissa 6 -> 0x7E
    y = torch.tensor([230.0, 240.0, -1000.0, 100.0])
    assert encode_e4m3fnuz(y, clamp=224.0).tolist() == [0x7E, 0x7E, 0xFE, encode_e4m3fnuz(torch.tensor([100.0])).item()]
    z = torch.tensor([NAN, INF, -INF, 248.0])
    assert encode_e4m3fnuz(z, clamp=224.0, nonfinite=NonFinite.CUDA_SATFINITE).tolist() == [0xFE, 0x7E, 0xFE, 0x7E]
    assert encode_e4m3fnuz(z, nonfinite=NonFinite.TORCH).tolist() == [0x80] * 4
    assert encode_e4m3fnuz(z, nonfinite=NonFinite.TORCH).tolist() == z.to(torch.float8_e4m3fnuz).view(torch.uint8).tolist()


def test_encode_fp8_dispatch_and_errors():
    x = torch.tensor([1.0, -0.0])
    assert encode_fp8(x, Fp8Flavour.E4M3FN).tolist() == [0x38, 0x80]
    assert encode_fp8(x, "e4m3fnuz").tolist() == [0x40, 0x00]
    with pytest.raises(InputError, match="'flavour'"):
        encode_fp8(x, "e5m2")
    with pytest.raises(InputError, match="'x'.*dtype"):
        encode_e4m3fn(torch.tensor([1], dtype=torch.int32))
    with pytest.raises(InputError, match="'clamp'"):
        encode_e4m3fnuz(x, clamp=300.0)
    with pytest.raises(InputError, match="'nonfinite'"):
        encode_e4m3fn(x, nonfinite="bogus")
    with pytest.raises(InputError, match="'codes'.*uint8"):
        decode_e4m3fn(torch.tensor([1], dtype=torch.int32))


# ----------------------------------------------------------------------------- UE8M0

def test_ue8m0_from_exponent_by_hand():
    e = torch.tensor([-200, -128, -127, -22, -13, 0, 120, 127, 128, 300], dtype=torch.int32)
    assert ue8m0_from_exponent(e).tolist() == [0, 0, 0, 105, 114, 127, 247, 254, 255, 255]
    with pytest.raises(InputError, match="'e'"):
        ue8m0_from_exponent(torch.tensor([1.0]))


def test_decode_ue8m0_all_bytes_exact():
    got = decode_ue8m0(ALL)
    want = torch.tensor([2.0 ** (b - 127) for b in range(255)] + [NAN], dtype=torch.float64)
    assert same_bits(got, want)
    assert same_bits(got, ALL.view(torch.float8_e8m0fnu).to(torch.float32))
    assert got[0].item() == 2.0**-127  # an fp32 subnormal, exact


def test_decode_ue8m0_consumers_bytes_0_and_255():
    b = torch.tensor([0, 1, 127, 254, 255], dtype=torch.uint8)
    mid = [2.0**-126, 1.0, 2.0**127]
    table = {
        Ue8m0Consumer.EXACT: [2.0**-127, *mid, NAN],
        Ue8m0Consumer.FLASHMLA: [2.0**-127, *mid, NAN],
        Ue8m0Consumer.SM120: [2.0**-127, *mid, NAN],
        Ue8m0Consumer.TRITON: [0.0, *mid, INF],
        Ue8m0Consumer.ROCM_TRITON: [0.0, *mid, INF],
        Ue8m0Consumer.CUTE: [0.0, *mid, INF],
        Ue8m0Consumer.ROCM_GFX950: [2.0**-127, *mid, INF],
    }
    for consumer, want in table.items():
        assert same_bits(decode_ue8m0(b, consumer), torch.tensor(want)), consumer


def test_decode_ue8m0_flashmla_bf16_bits_match_cvt():
    # datapath appendix A: __nv_cvt_e8m0_to_bf16raw 0->0x0040, 1->0x0080, 2->0x0100, 105->0x3480,
    # 127->0x3F80, 128->0x4000, 254->0x7F00 (255 is NaN)
    b = torch.tensor([0, 1, 2, 105, 127, 128, 254], dtype=torch.uint8)
    bits = decode_ue8m0(b, Ue8m0Consumer.FLASHMLA).to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF
    assert bits.tolist() == [0x0040, 0x0080, 0x0100, 0x3480, 0x3F80, 0x4000, 0x7F00]


# ----------------------------------------------------------------------------- exact_ceil_log2

def _f32_from_bits(bits: list[int]) -> torch.Tensor:
    return torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)


def test_exact_ceil_log2_powers_and_neighbours():
    ks = list(range(-126, 128))
    pow2 = _f32_from_bits([(k + 127) << 23 for k in ks])  # exact 2**k
    assert exact_ceil_log2(pow2).tolist() == ks
    above = _f32_from_bits([((k + 127) << 23) + 1 for k in ks])  # 2**k * (1 + 2**-23)
    assert exact_ceil_log2(above).tolist() == [k + 1 for k in ks]
    below = _f32_from_bits([((k + 127) << 23) - 1 for k in ks[1:]])  # largest float below 2**k
    assert exact_ceil_log2(below).tolist() == ks[1:]


def test_exact_ceil_log2_subnormals_by_hand():
    # subnormal M * 2**-149: M=1 -> -149; M=2 -> -148; M=3 -> -147 (2**-148 < 3*2**-149 <= 2**-147);
    # M=4 -> -147; M=5 -> -146; M=2**22 -> -127; M=2**22+1 -> -126; M=2**23-1 -> -126
    m = [1, 2, 3, 4, 5, 2**22, 2**22 + 1, 2**23 - 1]
    assert exact_ceil_log2(_f32_from_bits(m)).tolist() == [-149, -148, -147, -147, -146, -127, -126, -126]


@given(st.floats(width=32, min_value=0.0, exclude_min=True, allow_nan=False, allow_infinity=False))
def test_exact_ceil_log2_property(v):
    r = torch.tensor([v], dtype=torch.float32)
    e = exact_ceil_log2(r).item()
    rv = r.item()
    # smallest integer with 2**e >= r; Python's 2.0**n and comparisons are exact
    assert 2.0**e >= rv > 2.0 ** (e - 1)


def test_exact_ceil_log2_rejects_bad_input():
    for bad in ([0.0], [-1.0], [INF], [NAN]):
        with pytest.raises(InputError, match="exact_ceil_log2.*'r'.*positive and finite"):
            exact_ceil_log2(torch.tensor(bad, dtype=torch.float32))
    with pytest.raises(InputError, match="'r'.*float32"):
        exact_ceil_log2(torch.tensor([1.0], dtype=torch.float64))
