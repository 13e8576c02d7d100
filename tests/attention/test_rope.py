"""RoPE: exact fp32 FMA emulation, forward/inverse formulas per arithmetic, cos/sin cache."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dsv4_numerics.reference.errors import InputError
from dsv4_numerics.reference.policies import RopeArithmetic
from dsv4_numerics.reference.pipeline.rope import (
    YarnConfig,
    apply_rope,
    cos_sin_cache,
    fma_f32,
    round_to_odd_sum_f64,
    roundtrip_error_bound,
)

from .exact import F, f32, rn32

A = RopeArithmetic
f32s = st.floats(width=32, allow_nan=False, allow_infinity=False)
mid32 = st.floats(min_value=-4.0, max_value=4.0, width=32, allow_nan=False, allow_infinity=False)


def t32(*v):
    return torch.tensor(v, dtype=torch.float32)


# --------------------------------------------------------------------------- fma_f32
def test_fma_constructed_double_rounding_case():
    # a = 1 + 2^-23, b = 2^-24 - 2^-47 = 2^-24 (1 - 2^-23)  ->  a*b = 2^-24 (1 - 2^-46) = 2^-24 - 2^-70
    # c = 1 + 2^-23 (odd last bit).  Exact a*b + c = 1 + 3*2^-24 - 2^-70: just BELOW the midpoint
    # 1 + 3*2^-24 of the fp32 neighbours 1 + 2^-23 (odd) and 1 + 2^-22 (even), so RN32 = 1 + 2^-23.
    # fl64 of the sum drops the 2^-70 (< half ulp 2^-53) and lands ON the midpoint; RNE to fp32
    # then picks the even neighbour 1 + 2^-22: the double-rounding error the emulation must avoid.
    a, b, c = 1 + 2**-23, 2**-24 - 2**-47, 1 + 2**-23
    naive = torch.tensor(a * b + c, dtype=torch.float64).to(torch.float32).item()
    assert naive == 1 + 2**-22  # the trap is real
    assert fma_f32(t32(a), t32(b), t32(c)).item() == 1 + 2**-23
    # mirrored sign
    assert fma_f32(t32(-a), t32(b), t32(-c)).item() == -(1 + 2**-23)
    # just ABOVE a midpoint: b = 2^-24 (1 + 2^-23): exact = 1 + 3*2^-24 + 2^-70 -> 1 + 2^-22;
    # with c = 1 (even), fl64 would land on 1 + 2^-24 (midpoint) and RNE would give 1.
    a2, b2, c2 = 1 + 2**-23, 2**-24 + 2**-47, 1.0
    # exact = 1 + 2^-24 + 2^-46 + 2^-70... a2*b2 = 2^-24(1 + 2^-22 + 2^-46) -> above the midpoint
    assert fma_f32(t32(a2), t32(b2), t32(c2)).item() == 1 + 2**-23


def test_round_to_odd_known():
    # 1 + 2^-60 is not a float64: neighbours 1 (even) and 1 + 2^-52 (odd) -> round-to-odd = 1 + 2^-52
    a = torch.tensor([1.0], dtype=torch.float64)
    b = torch.tensor([2.0**-60], dtype=torch.float64)
    assert round_to_odd_sum_f64(a, b).item() == 1 + 2**-52
    # exact sums are returned unchanged
    assert round_to_odd_sum_f64(a, torch.tensor([0.5], dtype=torch.float64)).item() == 1.5
    # 1 - 2^-60: neighbours 1 - 2^-53 (odd) and 1 (even) -> 1 - 2^-53
    assert round_to_odd_sum_f64(a, -b).item() == 1 - 2**-53


@given(f32s, f32s, f32s)
def test_fma_matches_exact_fraction(a, b, c):
    want = rn32(F(a) * F(b) + F(c))
    got = fma_f32(t32(a), t32(b), t32(c)).item()
    assert got == want or (math.isinf(want) and got == want)


@given(st.integers(1, 300), st.integers(-20, 20), st.integers(0, 2**23 - 1), st.booleans(), st.booleans())
def test_fma_near_midpoints(m, k, cm, neg, flip):
    # Double-rounding-prone cases: c = (1 + cm 2^-23) 2^k, a = 1 + m 2^-23,
    # b = +-2^(k-24) (1 - m 2^-23)  ->  a*b = +-2^(k-24) (1 - m^2 2^-46): within m^2 2^(k-70)
    # < 2^(k-53) of a midpoint of c's fp32 grid, so fl64(a*b + c) lands on the midpoint.
    a = f32(1.0 + m * 2.0**-23)
    b = f32((-1.0 if neg else 1.0) * 2.0 ** (k - 24) * (1.0 - m * 2.0**-23))
    c = f32((-1.0 if flip else 1.0) * (1.0 + cm * 2.0**-23) * 2.0**k)
    want = rn32(F(a) * F(b) + F(c))
    assert fma_f32(t32(a), t32(b), t32(c)).item() == want


def test_fma_special_values():
    inf, nan = math.inf, math.nan
    got = fma_f32(t32(inf, 0.0, 1.0, 3.0e38), t32(1.0, inf, nan, 10.0), t32(1.0, 1.0, 1.0, 0.0))
    assert got[0].item() == inf and math.isnan(got[1].item()) and math.isnan(got[2].item())
    assert got[3].item() == inf  # 3e39 overflows fp32
    # signed zero: (-0)*1 + (+0) = +0 under RN; (-0)*1 + (-0) = -0
    z = fma_f32(t32(-0.0, -0.0), t32(1.0, 1.0), t32(0.0, -0.0))
    assert math.copysign(1, z[0].item()) == 1 and math.copysign(1, z[1].item()) == -1


def test_fma_rejects_non_fp32_float64():
    with pytest.raises(InputError, match="fma_f32.*'a'.*fp32-representable"):
        fma_f32(torch.tensor([0.1], dtype=torch.float64), t32(1.0), t32(1.0))


# --------------------------------------------------------------------------- apply_rope formulas
def _exact_pair(e, o, c, s, inverse, arith):
    """Independent Fraction evaluation of the module docstring table (one rounding per fl32/fma)."""
    E, O, C, S = F(e), F(o), F(c), F(s)
    r = lambda x: F(rn32(x))  # noqa: E731
    if arith == A.SEPARATE:
        if not inverse:
            return rn32(r(E * C) - r(O * S)), rn32(r(E * S) + r(O * C))
        return rn32(r(E * C) + r(O * S)), rn32(r(O * C) - r(E * S))
    if arith == A.FMA:
        if not inverse:
            return rn32(E * C - r(O * S)), rn32(E * S + r(O * C))
        return rn32(E * C + r(O * S)), rn32(-E * S + r(O * C))
    if not inverse:  # FMA_TRITON
        return rn32(E * C - r(O * S)), rn32(O * C + r(E * S))
    return rn32(E * C + r(O * S)), rn32(O * C - r(E * S))


def _row_with_pair(e, o, j=0):
    x = torch.zeros(1, 512, dtype=torch.float32)
    x[0, :448] = torch.arange(448, dtype=torch.float32) * 0.25 - 3.0  # NoPE marker values
    x[0, 448 + 2 * j] = e
    x[0, 449 + 2 * j] = o
    return x


def _table_row(c, s, j=0):
    cs = torch.zeros(1, 64, dtype=torch.float32)
    cs[0, :32] = 1.0
    cs[0, j] = c
    cs[0, 32 + j] = s
    return cs


def test_apply_rope_hand_values():
    # e=1.5, o=0.25, cos=0.5, sin=0.75: every product is exact in fp32, so all arithmetics agree:
    # forward  e' = 1.5*0.5 - 0.25*0.75 = 0.75 - 0.1875 = 0.5625;  o' = 1.5*0.75 + 0.25*0.5 = 1.25
    # inverse  e' = 0.75 + 0.1875 = 0.9375;                         o' = 0.125 - 1.125 = -1.0
    x = _row_with_pair(1.5, 0.25, j=5)
    cs = _table_row(0.5, 0.75, j=5)
    pos = torch.tensor([0])
    for arith in A:
        fwd = apply_rope(x, pos, cs, arithmetic=arith)
        inv = apply_rope(x, pos, cs, inverse=True, arithmetic=arith)
        assert (fwd[0, 458].item(), fwd[0, 459].item()) == (0.5625, 1.25)
        assert (inv[0, 458].item(), inv[0, 459].item()) == (0.9375, -1.0)
        assert torch.equal(fwd[0, :448], x[0, :448]) and torch.equal(inv[0, :448], x[0, :448])
        # other pairs use cos = 1, sin = 0 -> unchanged (e*1 - o*0 = e exactly)
        assert torch.equal(fwd[0, 448:458], x[0, 448:458])


def test_apply_rope_fma_vs_separate_constructed():
    # Even lane, forward: e' = e*cos - o*sin with e = 1 + 2^-23, cos = 2^-24 - 2^-47,
    # o = -(1 + 2^-23), sin = 1: -fl32(o*sin) = 1 + 2^-23 = c of the fma double-rounding case.
    # FMA:      fma(e, cos, 1 + 2^-23) = RN32(1 + 3*2^-24 - 2^-70) = 1 + 2^-23
    # SEPARATE: fl32(e*cos) = RN32(2^-24 - 2^-70) = 2^-24; fl32(2^-24 + 1 + 2^-23) is the tie
    #           1 + 3*2^-24 -> even neighbour 1 + 2^-22.
    e, c, o, s = 1 + 2**-23, 2**-24 - 2**-47, -(1 + 2**-23), 1.0
    x = _row_with_pair(e, o)
    cs = _table_row(c, s)
    pos = torch.tensor([0])
    assert apply_rope(x, pos, cs, arithmetic=A.FMA)[0, 448].item() == 1 + 2**-23
    assert apply_rope(x, pos, cs, arithmetic=A.FMA_TRITON)[0, 448].item() == 1 + 2**-23
    assert apply_rope(x, pos, cs, arithmetic=A.SEPARATE)[0, 448].item() == 1 + 2**-22


@given(mid32, mid32, st.floats(-1, 1, width=32), st.floats(-1, 1, width=32), st.booleans(),
       st.sampled_from(list(A)))
def test_apply_rope_matches_exact_formulas(e, o, c, s, inverse, arith):
    x = _row_with_pair(e, o, j=31)
    cs = _table_row(c, s, j=31)
    got = apply_rope(x, torch.tensor([0]), cs, inverse=inverse, arithmetic=arith)
    want = _exact_pair(e, o, c, s, inverse, arith)
    assert (got[0, 510].item(), got[0, 511].item()) == want


def test_apply_rope_random_rows_match_exact_formulas():
    g = torch.Generator().manual_seed(7)
    table = cos_sin_cache(64)
    x = (torch.randn(6, 3, 512, generator=g) * 4).to(torch.bfloat16)
    pos = torch.randint(0, 64, (6,), generator=g)
    for arith in A:
        for inverse in (False, True):
            got = apply_rope(x, pos, table, inverse=inverse, arithmetic=arith)
            for t in range(6):
                for h in (0, 2):
                    for j in (0, 7, 31):
                        e, o = x[t, h, 448 + 2 * j].item(), x[t, h, 449 + 2 * j].item()
                        c, s = table[pos[t], j].item(), table[pos[t], 32 + j].item()
                        want = _exact_pair(e, o, c, s, inverse, arith)
                        assert (got[t, h, 448 + 2 * j].item(), got[t, h, 449 + 2 * j].item()) == want


def test_fma_and_separate_differ_sometimes_on_real_tables():
    # H6: the contraction changes ~1e-5 of bf16 outputs; over 1.3M pair lanes some fp32 results
    # must differ (sanity check that the two emulations are not accidentally the same formula).
    g = torch.Generator().manual_seed(3)
    table = cos_sin_cache(4096, theta=160000.0, yarn=YarnConfig(16, 65536))
    x = torch.randn(4096, 5, 512, generator=g).to(torch.bfloat16)
    pos = torch.arange(4096)
    a = apply_rope(x, pos, table, arithmetic=A.FMA)
    b = apply_rope(x, pos, table, arithmetic=A.SEPARATE)
    assert torch.equal(a[..., :448], b[..., :448])
    assert 0 < int((a != b).sum()) < a[..., 448:].numel() // 2


@given(st.integers(0, 2**31 - 1), st.sampled_from(list(A)))
def test_roundtrip_within_bound(seed, arith):
    g = torch.Generator().manual_seed(seed)
    table = cos_sin_cache(300, theta=160000.0, yarn=YarnConfig(16, 65536))
    x = torch.randn(4, 2, 512, generator=g) * 10
    pos = torch.randint(0, 300, (4,), generator=g)
    y = apply_rope(apply_rope(x, pos, table, arithmetic=arith), pos, table, inverse=True, arithmetic=arith)
    assert torch.equal(y[..., :448], x[..., :448])
    bound = roundtrip_error_bound(x[..., 448:], table[pos][:, None, :])
    err = (y[..., 448:].double() - x[..., 448:].double()).abs()
    assert bool((err <= bound).all())


def test_positions_broadcast_over_heads_and_dtypes():
    table = cos_sin_cache(16)
    x = torch.randn(3, 4, 512).to(torch.bfloat16)
    pos = torch.tensor([0, 5, 15], dtype=torch.int32)
    y = apply_rope(x, pos, table)
    for h in range(4):
        assert torch.equal(y[:, h], apply_rope(x[:, h], pos, table))
    # position 0: cos = 1, sin = 0 exactly -> identity on every arithmetic
    assert torch.equal(y[0], x[0].float())


def test_apply_rope_validation():
    table = cos_sin_cache(8)
    x = torch.zeros(2, 512)
    with pytest.raises(InputError, match="apply_rope.*'x'.*last dimension 512"):
        apply_rope(torch.zeros(2, 511), torch.tensor([0, 1]), table)
    with pytest.raises(InputError, match="apply_rope.*'x'.*dtype"):
        apply_rope(x.double(), torch.tensor([0, 1]), table)
    with pytest.raises(InputError, match="apply_rope.*'positions'.*\\[0, 8\\)"):
        apply_rope(x, torch.tensor([0, 8]), table)
    with pytest.raises(InputError, match="apply_rope.*'positions'.*prefix"):
        apply_rope(x, torch.tensor([0, 1, 2]), table)
    with pytest.raises(InputError, match="apply_rope.*'cos_sin'"):
        apply_rope(x, torch.tensor([0, 1]), table.double())
    with pytest.raises(InputError, match="apply_rope.*'arithmetic'"):
        apply_rope(x, torch.tensor([0, 1]), table, arithmetic="fast")


# --------------------------------------------------------------------------- cos/sin cache
def test_cos_sin_cache_known_rows():
    t = cos_sin_cache(3, theta=10000.0)
    assert t.dtype == torch.float32 and t.shape == (3, 64)
    assert torch.equal(t[0], torch.cat((torch.ones(32), torch.zeros(32))))
    # row 1, pair 0: frequency theta^0 = 1 -> cos(1), sin(1); pair 1: 10000^(-2/64)
    assert t[1, 0].item() == f32(math.cos(1.0)) and t[1, 32].item() == f32(math.sin(1.0))
    f1 = 10000.0 ** (-2 / 64)
    assert abs(t[2, 1].item() - math.cos(2 * f1)) <= 2**-24
    assert abs(t[2, 33].item() - math.sin(2 * f1)) <= 2**-24


def test_yarn_frequencies():
    # DSv4 compressed layers: theta 160000, factor 16, original 65536, beta 32/1.
    # correction dim(r) = 64 * ln(65536 / (2 pi r)) / (2 ln 160000):
    #   r = 32 -> 64*ln(325.95)/23.9817 = 64*5.7867/23.9817 = 15.44 -> floor 15
    #   r = 1  -> 64*ln(10430.4)/23.9817 = 64*9.2525/23.9817 = 24.69 -> ceil 25
    # pair j < 15: extrapolation (plain) frequency; j >= 25: interpolated = plain / 16;
    # 15 <= j < 25: linear blend with ramp (j - 15)/10.
    yarn = cos_sin_cache(2, theta=160000.0, yarn=YarnConfig(16, 65536))
    plain = lambda j: 160000.0 ** (-2 * j / 64)  # noqa: E731
    for j in (0, 14, 15, 20, 24, 25, 31):
        ramp = min(max((j - 15) / 10, 0.0), 1.0)
        freq = plain(j) / 16 * ramp + plain(j) * (1 - ramp)
        assert abs(yarn[1, j].item() - math.cos(freq)) <= 2**-24
        assert abs(yarn[1, 32 + j].item() - math.sin(freq)) <= 2**-24 * max(1.0, freq)


def test_vllm_flavour_close_to_float64():
    # vLLM rounds the angle t*f to fp32: |error| <= 2^-24 * t*f (+ fp32 frequency error 2^-23 t f)
    # plus ~2 ulp of cos/sin; at t < 70000 that is position-growing, as documented.
    a = cos_sin_cache(70000, theta=160000.0, yarn=YarnConfig(16, 65536), flavour="vllm")
    b = cos_sin_cache(70000, theta=160000.0, yarn=YarnConfig(16, 65536))
    t = torch.arange(70000, dtype=torch.float64)[:, None]
    assert bool(((a.double() - b.double()).abs() <= t * 2.0**-22 + 2.0**-22).all())
    assert not torch.equal(a, b)


def test_cos_sin_cache_validation():
    with pytest.raises(InputError, match="cos_sin_cache.*'max_pos'"):
        cos_sin_cache(0)
    with pytest.raises(InputError, match="cos_sin_cache.*'flavour'"):
        cos_sin_cache(4, flavour="x")
    with pytest.raises(InputError, match="cos_sin_cache.*'theta'"):
        cos_sin_cache(4, theta=float("nan"))


# --------------------------------------------------------------------------- GPU: Triton contraction
@pytest.mark.gpu
def test_triton_contraction_matches():
    """On a GPU with Triton: kernels with the production expressions (compressor forward RoPE,
    fused_inv_rope inverse) give exactly the FMA_TRITON emulation; the SEPARATE emulation differs
    somewhere (so the test can tell the two apart)."""
    triton = pytest.importorskip("triton")
    import triton.language as tl

    @triton.jit
    def _fwd(e_ptr, o_ptr, c_ptr, s_ptr, oe_ptr, oo_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = i < n
        e = tl.load(e_ptr + i, mask=m)
        o = tl.load(o_ptr + i, mask=m)
        c = tl.load(c_ptr + i, mask=m)
        s = tl.load(s_ptr + i, mask=m)
        tl.store(oe_ptr + i, e * c - o * s, mask=m)  # compressor: even*cos - odd*sin
        tl.store(oo_ptr + i, o * c + e * s, mask=m)  # compressor: odd*cos + even*sin

    @triton.jit
    def _inv(x_ptr, c_ptr, s_ptr, out_ptr, n2, BLOCK: tl.constexpr):
        # fused_inv_rope_fp8_quant structure: every lane computes x*cos +- x_partner*sin with
        # the partner at (lane ^ 1), then selects x_add for even lanes and x_sub for odd lanes.
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = i < n2
        x = tl.load(x_ptr + i, mask=m)
        xp = tl.load(x_ptr + (i ^ 1), mask=m)
        c = tl.load(c_ptr + (i >> 1), mask=m)
        s = tl.load(s_ptr + (i >> 1), mask=m)
        x_add = x * c + xp * s
        x_sub = x * c - xp * s
        tl.store(out_ptr + i, tl.where((i & 1) == 0, x_add, x_sub), mask=m)

    n = 1 << 20
    g = torch.Generator().manual_seed(11)
    e = torch.randn(n, generator=g).to(torch.bfloat16).float()
    o = torch.randn(n, generator=g).to(torch.bfloat16).float()
    ang = torch.rand(n, generator=g, dtype=torch.float64) * 1000
    c, s = torch.cos(ang).float(), torch.sin(ang).float()
    dev = "cuda"
    outs = []
    oe = torch.empty(n, device=dev)
    oo = torch.empty(n, device=dev)
    _fwd[(n // 1024,)](e.to(dev), o.to(dev), c.to(dev), s.to(dev), oe, oo, n, BLOCK=1024)
    outs.append((oe.cpu(), oo.cpu()))
    x = torch.stack((e, o), dim=1).reshape(-1).to(dev)
    out = torch.empty(2 * n, device=dev)
    _inv[(2 * n // 1024,)](x, c.to(dev), s.to(dev), out, 2 * n, BLOCK=1024)
    out = out.cpu()
    outs.append((out[0::2], out[1::2]))
    from dsv4_numerics.reference.pipeline.rope import rope_pairs

    d = lambda t: t.double()  # noqa: E731
    for inverse, (ge, go) in zip((False, True), outs):
        we, wo = rope_pairs(d(e), d(o), d(c), d(s), inverse, A.FMA_TRITON)
        assert torch.equal(ge, we.float()), f"inverse={inverse} even lane: {(ge != we.float()).sum()} differ"
        assert torch.equal(go, wo.float()), f"inverse={inverse} odd lane: {(go != wo.float()).sum()} differ"
        se, so = rope_pairs(d(e), d(o), d(c), d(s), inverse, A.SEPARATE)
        assert not (torch.equal(ge, se.float()) and torch.equal(go, so.float()))
