"""Tile quantiser (datapath 2.0, 2.8 set D/E, H1, H3, H16, H17) and output group quantiser (A3.3).

Known answers are derived by hand in the comments: r = amax/448 compared against powers of two.
Useful powers: 2**-23 = 1.192e-7, 2**-22 = 2.384e-7, 2**-21 = 4.768e-7, 2**-19 = 1.907e-6,
2**-18 = 3.815e-6, 2**-15 = 3.052e-5, 2**-14 = 6.104e-5, 2**-13 = 1.2207e-4, 2**-12 = 2.441e-4.
1e-4f = 9.99999975e-5.
"""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dsv4_numerics.reference.constants import FNUZ_GFX942_CLAMP, TINY_TILE_AMAX
from dsv4_numerics.reference.errors import InputError
from dsv4_numerics.reference.formats.fp8 import decode_fp8
from dsv4_numerics.reference.policies import Fp8Flavour, NonFinite, ScaleRule
from dsv4_numerics.reference.formats.quant import (
    dequantize_groups_ue8m0,
    dequantize_tiles,
    quantize_groups_ue8m0,
    quantize_tiles,
    tile_exponent,
)
from dsv4_numerics.strategies.cache import bf16_rows, bf16_tensors, boundary_tiles, tie_amax, tiles

QA, QS = ScaleRule.AMAX_CLAMP, ScaleRule.SCALE_CLAMP
NAN, INF = float("nan"), float("inf")


def tile_of(values: list[float], dtype=torch.bfloat16) -> torch.Tensor:
    t = torch.zeros(64, dtype=torch.float32)
    t[: len(values)] = torch.tensor(values, dtype=torch.float32)
    return t.to(dtype)


def scale_bytes(values: list[float], rule) -> int:
    return quantize_tiles(tile_of(values), rule)[1].item()


# ----------------------------------------------------------------------------- scale bytes by hand

def test_zero_tile_scale_bytes():
    # Q_A: r = fl32(1e-4f / 448) = 2.232e-7 in (2**-23, 2**-22] -> e = -22 -> byte 105.
    # Q_S: r = max(0, 1e-4f) = 1e-4 in (2**-14, 2**-13] -> e = -13 -> byte 114.
    for rule, byte in ((QA, 105), (QS, 114)):
        codes, s = quantize_tiles(torch.zeros(64, dtype=torch.bfloat16), rule)
        assert s.tolist() == [byte] and codes.eq(0x00).all()
        codes, s = quantize_tiles(torch.full((64,), -0.0, dtype=torch.bfloat16), rule)
        assert s.tolist() == [byte] and codes.eq(0x80).all()  # -0.0 keeps its sign (H17)


@pytest.mark.parametrize(
    "amax, qa, qs",
    [
        # datapath 2.8 set D; amax is rounded to bf16 first (the tile holds bf16 values)
        (1e-6, 105, 114),  # max(a, 1e-4f) = 1e-4f -> as the zero tile
        (1.0014e-4, 105, 114),  # bf16 1.00136e-4 > 1e-4f; /448 = 2.2352e-7 <= 2**-22
        (2.0027e-4, 106, 114),  # bf16 2.00272e-4; /448 = 4.4704e-7 in (2**-22, 2**-21] -> -21
        (1e-3, 109, 114),  # bf16 9.9945e-4; /448 = 2.2309e-6 in (2**-19, 2**-18] -> -18
        (0.02, 113, 114),  # bf16 0.0200195; /448 = 4.4686e-5 in (2**-15, 2**-14] -> -14
        (TINY_TILE_AMAX, 113, 114),  # 448 * 2**-14: /448 = 2**-14 exactly -> -14 (Q_S: 1e-4 -> -13)
        (0.03, 114, 114),  # bf16 0.0300293; /448 = 6.703e-5 in (2**-14, 2**-13] -> -13 both
        (0.0546875, 114, 114),  # 448 * 2**-13: exactly 2**-13 -> -13
        (0.06, 115, 115),  # bf16 0.0600586; /448 = 1.3406e-4 in (2**-13, 2**-12] -> -12
    ],
)
def test_set_d_scale_bytes(amax, qa, qs):
    assert scale_bytes([amax], QA) == qa
    assert scale_bytes([-amax], QS) == qs  # sign of the peak is irrelevant


def test_tiny_tile_codes_by_hand():
    # amax = bf16(1e-3) = 0.00099945068359375 = 131 * 2**-17.
    # Q_A: e = -18 -> y = 131 * 2**1 = 262 in [256, 512): quantum 32 -> 262/32 = 8.19 -> 8 -> 256
    #      = 1.0 * 2**8: exponent field 8 + 7 = 15, mantissa 0 -> 0x78.
    # Q_S: e = -13 -> y = 262 * 2**-5 = 8.1875 in [8, 16): quantum 1 -> 8 = 2**3: field 10 -> 0x50.
    c, _ = quantize_tiles(tile_of([1e-3, -1e-3]), QA)
    assert c[:2].tolist() == [0x78, 0xF8]
    c, _ = quantize_tiles(tile_of([1e-3, -1e-3]), QS)
    assert c[:2].tolist() == [0x50, 0xD0]


@pytest.mark.parametrize("m", [-13, -5, -1, 0, 1, 7, 20, 39])
def test_tie_tiles(m):
    # a = 1.75 * 2**m: a / 448 = 2**(m - 8) exactly, so e = m - 8 (H16) and byte = m + 119 under
    # both rules once 2**(m-8) >= 1e-4 (m >= -5; below that Q_S floors at -13 = byte 114).
    # The peak scales to exactly 448 -> 0x7E; half the peak (0.875 * 2**m) -> 224 -> 0x76.
    a = 1.75 * 2.0**m
    codes, s = quantize_tiles(tile_of([a, -a / 2]), QA)
    assert s.item() == m + 119 and codes[:2].tolist() == [0x7E, 0xF6]
    _, s_s = quantize_tiles(tile_of([a]), QS)
    assert s_s.item() == (m + 119 if m >= -5 else 114)


@pytest.mark.parametrize("k", [-20, -3, 0, 5, 19])
def test_448_pow2_tiles(k):
    # a = 448 * 2**k = 1.75 * 2**(k+8): e = k, byte 127 + k; codes: 448 -> 0x7E, 1 * 2**k -> 1.0 = 0x38,
    # 2**(k-9) -> the smallest subnormal 0x01, 2**(k-10) -> tie -> 0x00, -2**(k-10) -> 0x80
    a = 448.0 * 2.0**k
    vals = [a, 2.0**k, 2.0 ** (k - 9), 2.0 ** (k - 10), -(2.0 ** (k - 10)), 3 * 2.0 ** (k - 10)]
    codes, s = quantize_tiles(tile_of(vals), QA)
    assert s.item() == 127 + k
    assert codes[:6].tolist() == [0x7E, 0x38, 0x01, 0x00, 0x80, 0x02]


def test_subnormal_codes_and_signed_zeros():
    # amax 448 -> e = 0; elements m * 2**-9 -> code m (subnormal), 15 * 2**-10 -> tie -> 0x08 (2**-6)
    vals = [448.0] + [m * 2.0**-9 for m in range(1, 8)] + [15 * 2.0**-10, 0.0, -0.0, -(3 * 2.0**-9)]
    codes, s = quantize_tiles(tile_of(vals, torch.float32), QS)
    assert s.item() == 127
    assert codes[:12].tolist() == [0x7E, 1, 2, 3, 4, 5, 6, 7, 0x08, 0x00, 0x80, 0x83]


def test_huge_tile_scale_247():
    # bf16 max 255 * 2**120: /448 = 2**119.19 -> e = 120 -> byte 247; y = 255 -> RNE -> 256 (0x78).
    # The dequantised value 256 * 2**120 = 2**128 overflows fp32 -> +inf (as in every consumer).
    bmax = float(torch.finfo(torch.bfloat16).max)
    codes, s = quantize_tiles(tile_of([bmax]), QA)
    assert s.item() == 247 and codes[0].item() == 0x78
    assert dequantize_tiles(codes, s)[0].item() == INF


# ----------------------------------------------------------------------------- FNUZ (gfx942)

def test_fnuz_gfx942_clamp_224():
    # M = 224 is the divisor and the clamp. amax 224: r = 1 -> e = 0; 224 = 1.75 * 2**7 ->
    # FNUZ field 7 + 8 = 15, mantissa 6 -> 0x7E. amax 240: r = 240/224 = 1.07 -> e = 1; 240/2 = 120
    # = 1.875 * 2**6 -> field 14, mantissa 7 -> 0x77. -0.0 -> 0x00 (no -0 in FNUZ).
    c, s = quantize_tiles(tile_of([224.0, -0.0]), QA, Fp8Flavour.E4M3FNUZ, clamp=FNUZ_GFX942_CLAMP)
    assert s.item() == 127 and c[:2].tolist() == [0x7E, 0x00]
    c, s = quantize_tiles(tile_of([240.0, -1.0]), QA, Fp8Flavour.E4M3FNUZ, clamp=FNUZ_GFX942_CLAMP)
    # -1.0 / 2 = -0.5 = 1.0 * 2**-1: field 7, sign -> 0x80 | 0x38 = 0xB8
    assert s.item() == 128 and c[:2].tolist() == [0x77, 0xB8]


# ----------------------------------------------------------------------------- non-finite (set E)

def test_nan_element_per_policy():
    # amax of the finite elements = 3 (NaN ignored): 3/448 = 6.7e-3 in (2**-8, 2**-7] -> e = -7 -> 120;
    # 2 * 2**7 = 256 -> 0x78; -3 * 2**7 = -384 = -1.5 * 2**8 -> 0xFC.
    x = tile_of([NAN, 2.0, -3.0], torch.float32)
    c, s = quantize_tiles(x, QA, nonfinite=NonFinite.CUDA_SATFINITE)
    assert s.item() == 120 and c[:4].tolist() == [0xFE, 0x78, 0xFC, 0x00]
    c, s = quantize_tiles(x, QA, nonfinite=NonFinite.TRITON)
    assert s.item() == 120 and c[:4].tolist() == [0x7E, 0x78, 0xFC, 0x00]
    # a negative NaN input still gives 0x7E: x / scale yields the GPU's canonical positive NaN
    c, _ = quantize_tiles(-x, QA, nonfinite=NonFinite.TRITON)
    assert c[:4].tolist() == [0x7E, 0xF8, 0x7C, 0x80]
    # torch: NaN-propagating amax -> scale byte 255, every code NaN
    c, s = quantize_tiles(x, QS, nonfinite=NonFinite.TORCH)
    assert s.item() == 255 and c.eq(0x7F).all()
    with pytest.raises(InputError, match="quantize_tiles.*'x'.*finite"):
        quantize_tiles(x, QA)


def test_inf_element_per_policy():
    # amax = inf -> byte 255; x * exp2f(-inf) = x * 0: finite -> +-0, inf * 0 = NaN
    x = tile_of([INF, 2.0, -3.0, -INF], torch.float32)
    for pol, nan_code in ((NonFinite.CUDA_SATFINITE, 0xFE), (NonFinite.TRITON, 0x7E), (NonFinite.TORCH, 0x7F)):
        c, s = quantize_tiles(x, QA, nonfinite=pol)
        assert s.item() == 255
        assert c[:5].tolist() == [nan_code, 0x00, 0x80, nan_code, 0x00], pol


# ----------------------------------------------------------------------------- tile_exponent

def test_tile_exponent_by_hand_and_errors():
    a = torch.tensor([0.0, 1.75, 448.0, 449.0, 1e-3], dtype=torch.float32)
    # 1.75/448 = 2**-8 -> -8; 448/448 = 1 -> 0; 449/448 just above 1 -> 1; 1e-3/448 = 2.23e-6 -> -18
    assert tile_exponent(a, QA).tolist() == [-22, -8, 0, 1, -18]
    assert tile_exponent(a, QS).tolist() == [-13, -8, 0, 1, -13]
    # FNUZ divisor 224: 224/224 = 1 -> 0; 1.75/224 = 2**-7 -> -7
    assert tile_exponent(torch.tensor([224.0, 1.75]), QA, 224.0).tolist() == [0, -7]
    with pytest.raises(InputError, match="tile_exponent.*'amax'"):
        tile_exponent(torch.tensor([-1.0]), QA)
    with pytest.raises(InputError, match="'rule'"):
        tile_exponent(a, "bogus")
    with pytest.raises(InputError, match="'amax'.*float32"):
        tile_exponent(a.double(), QA)


def _fl32_exact(q: Fraction) -> float:
    """RNE of the exact rational ``q > 0`` to fp32, decided with exact rational comparisons among the
    fp32 neighbours of a first guess (independent of the float64 trick used by the code)."""
    guess = torch.tensor(float(q), dtype=torch.float64).to(torch.float32)
    cands = [torch.nextafter(guess, torch.tensor(-INF)), guess, torch.nextafter(guess, torch.tensor(INF))]
    best = None
    for c in cands:
        d = abs(Fraction(c.item()) - q)
        even = (c.view(torch.int32).item() & 1) == 0
        key = (d, not even)
        if best is None or key < best[0]:
            best = (key, c.item())
    return best[1]


@given(st.floats(width=32, min_value=0.0, allow_nan=False, allow_infinity=False))
def test_tile_exponent_definition(v):
    a = torch.tensor([v], dtype=torch.float32)
    floor = 9.99999974737875e-05  # 1e-4f (0x38D1B717)
    e_a = tile_exponent(a, QA).item()
    e_s = tile_exponent(a, QS).item()
    r_a = _fl32_exact(Fraction(max(a.item(), floor)) / 448)
    q_s = Fraction(a.item()) / 448
    r_s = max(_fl32_exact(q_s) if q_s > 0 else 0.0, floor)
    for e, r in ((e_a, r_a), (e_s, r_s)):
        assert 2.0**e >= r > 2.0 ** (e - 1)


# ----------------------------------------------------------------------------- properties

def _half_step_bound(y: torch.Tensor, fmin_exp: int = -6) -> torch.Tensor:
    """Half the E4M3FN quantum at |y| (float64): 2**(max(floor(log2|y|), -6) - 3) / 2."""
    ay = y.abs()
    fl = torch.where(ay > 0, torch.floor(torch.log2(torch.where(ay > 0, ay, torch.ones_like(ay)))), torch.zeros_like(ay))
    # log2 of a float64 is only used to pick the binade; correct it exactly
    fl = fl - (torch.exp2(fl) > ay).double() + (torch.exp2(fl + 1) <= ay).double()
    return torch.exp2(torch.clamp(fl, min=fmin_exp) - 3) / 2


@given(st.one_of(bf16_tensors((2, 128)), bf16_rows(n=2).map(lambda r: r[:, :448])), st.sampled_from([QA, QS]))
def test_roundtrip_error_within_half_step(x, rule):
    codes, s = quantize_tiles(x, rule)
    vals = decode_fp8(codes).double()  # exact E4M3 values
    mult = torch.exp2(s.double() - 127).repeat_interleave(64, dim=-1)  # exact powers of two
    deq = vals * mult
    xd = x.double()
    y = xd / mult  # the exact scaled value
    assert (y.abs() <= 448).all()  # the clamp never bites for finite bf16 input
    assert ((deq - xd).abs() <= _half_step_bound(y) * mult).all()
    assert torch.equal(torch.signbit(deq), torch.signbit(xd))  # sign (incl. of zero) preserved
    dq = dequantize_tiles(codes, s)
    fin = torch.isfinite(deq.float())
    assert torch.equal(dq[fin], deq.float()[fin])


@given(st.one_of(boundary_tiles(), tiles(), tiles(amax=TINY_TILE_AMAX)))
def test_rules_agree_iff_amax_above_boundary(t):
    ca, sa = quantize_tiles(t, QA)
    cs, ss = quantize_tiles(t, QS)
    agree = torch.equal(ca, cs) and torch.equal(sa, ss)
    assert agree == (t.float().abs().max().item() > TINY_TILE_AMAX)


@given(tie_amax((-13, 40)))
def test_tie_property(a):
    # any tie amax 1.75 * 2**m (representable in bf16) gives e = m - 8 under Q_A
    m = round(math.log2(a / 1.75))
    assert quantize_tiles(tile_of([a]), QA)[1].item() == m - 8 + 127


def test_quantize_tiles_input_errors():
    with pytest.raises(InputError, match="'x'.*multiple of 64"):
        quantize_tiles(torch.zeros(65, dtype=torch.bfloat16), QA)
    with pytest.raises(InputError, match="'x'.*bfloat16 values"):
        quantize_tiles(torch.full((64,), 1.0 + 2.0**-20), QA)
    with pytest.raises(InputError, match="'x'.*dtype"):
        quantize_tiles(torch.zeros(64, dtype=torch.float64), QA)
    with pytest.raises(InputError, match="'clamp'"):
        quantize_tiles(torch.zeros(64, dtype=torch.bfloat16), QA, Fp8Flavour.E4M3FNUZ, clamp=448.0)
    with pytest.raises(InputError, match="'scale_bytes'.*shape"):
        dequantize_tiles(torch.zeros(128, dtype=torch.uint8), torch.zeros(3, dtype=torch.uint8))


# ----------------------------------------------------------------------------- output group quantiser

def test_output_group_quantiser_by_hand():
    # group of 128: amax 448 -> r = fl32(448 * fl32(1/448)); fl32(1/448) = 0x3B124925 rounds 1/448 up
    # by 2**-33 relative, the product 1 + ~6.2e-9 rounds to fp32 1.0 -> e = 0 -> codes exact.
    x = torch.zeros(2, 128)
    x[0, 0], x[0, 1], x[0, 2] = 448.0, -1.0, 2.0**-10  # 0x7E, 0xB8, tie -> 0x00
    # second group: all zeros -> amax = eps = 1e-10 -> r = 2.23e-13 in (2**-43, 2**-42] -> e = -42
    codes, e = quantize_groups_ue8m0(x.reshape(1, 256))
    assert e.tolist() == [[0, -42]]
    assert codes[0, :3].tolist() == [0x7E, 0xB8, 0x00] and codes[0, 128:].eq(0).all()
    assert torch.equal(dequantize_groups_ue8m0(codes, e)[0, :3], torch.tensor([448.0, -1.0, 0.0]))


@pytest.mark.parametrize("k", [-30, -9, -1, 0, 1, 17, 100])
def test_output_group_exponent_near_powers_of_two(k):
    # The multiply by fl32(1/448) still yields e = ceil(log2(a / 448)) next to a = 448 * 2**k:
    # a = 448 * 2**k -> e = k; the fp32 neighbours above -> k + 1; below -> k.
    base = torch.tensor(448.0 * 2.0**k, dtype=torch.float32)
    up, down = base.clone(), base.clone()
    for step in range(1, 4):
        up = torch.nextafter(up, torch.tensor(INF))
        down = torch.nextafter(down, torch.tensor(-INF))
        x = torch.zeros(3, 128)
        x[0, 0], x[1, 0], x[2, 0] = base, up, down
        codes, e = quantize_groups_ue8m0(x)
        assert e.flatten().tolist() == [k, k + 1, k]
        assert codes[0, 0].item() == 0x7E  # exactly 448 after scaling, no clamp needed


def test_output_group_quantiser_errors():
    with pytest.raises(InputError, match="'x'.*finite"):
        quantize_groups_ue8m0(torch.full((128,), NAN))
    with pytest.raises(InputError, match="'x'.*multiple of group"):
        quantize_groups_ue8m0(torch.zeros(100))
