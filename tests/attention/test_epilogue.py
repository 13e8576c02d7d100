"""Output epilogue: inverse RoPE + 128-wide UE8M0 FP8 groups, group-major layout, scale packing."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dsv4_numerics.reference.attention.epilogue import (
    inv_rope_fp8_quant,
    inverse_rope_output,
    pack_scales_sm90,
    pack_scales_sm100,
    unpack_scales_sm100,
)
from dsv4_numerics.reference.errors import InputError
from dsv4_numerics.reference.policies import RopeArithmetic
from dsv4_numerics.reference.pipeline.rope import apply_rope, cos_sin_cache

IDENT = cos_sin_cache(1)  # row 0: cos = 1, sin = 0 exactly


def test_known_codes_and_scales_single_head_group():
    # Head 0, group 0 (dims 0..127): x[0] = 1.0, the rest 0.5. Position 0 (identity rotation).
    # amax = 1.0; r = fl32(1.0 * fl32(1/448)) = fl32(1/448) = 2.2321428e-3, 2^-9 < r <= 2^-8
    # -> e = -8, scale 2^-8, UE8M0 byte 119. Codes: 1.0 * 2^8 = 256 = 1.0 * 2^8 -> E4M3 exponent
    # field 8 + 7 = 15, mantissa 0 -> 0b0_1111_000 = 0x78; 0.5 * 2^8 = 128 -> field 14 -> 0x70.
    # Group 1 all zero: amax -> fl32(1e-10); r = fl32(fl32(1e-10) * fl32(1/448)) ~ 2.232e-13 and
    # 2^-43 = 1.137e-13 < r <= 2^-42 = 2.274e-13 -> e = -42, byte 85; codes 0x00.
    # Group 2 = -0.0: codes 0x80 (signed zero), e = -42.
    o = torch.zeros(1, 8, 512, dtype=torch.bfloat16)
    o[0, 0, :128] = 0.5
    o[0, 0, 0] = 1.0
    o[0, 0, 256:384] = -0.0
    o[0, 0, 384:] = 0.25  # group 3: amax 0.25 -> r = fl32(0.25/448) -> e = -10 (2^-11 < r <= 2^-10)
    r = inv_rope_fp8_quant(o, torch.tensor([0]), IDENT, heads_per_group=8)
    assert r.exponents[0, 0].tolist() == [-8, -42, -42, -10]
    codes = r.codes_tgd[0, 0, :512]
    assert codes[0].item() == 0x78 and bool((codes[1:128] == 0x70).all())
    assert bool((codes[128:256] == 0x00).all()) and bool((codes[256:384] == 0x80).all())
    # 0.25 * 2^10 = 256 -> 0x78
    assert bool((codes[384:] == 0x78).all())
    assert r.scales_sm90[0, 0, :4].tolist() == [2.0**-8, 2.0**-42, 2.0**-42, 2.0**-10]
    assert unpack_scales_sm100(r.scales_sm100)[0, 0, 0].tolist() == [119, 85, 85, 117]
    assert r.dequantized[0, 0, 0].item() == 1.0 and r.dequantized[0, 0, 1].item() == 0.5


def test_sm100_packing_by_hand():
    # exponents (-8, -42, -8, 1) -> bytes (119, 85, 119, 128) ->
    # 119 + 85*2^8 + 119*2^16 + 128*2^24 = 119 + 21760 + 7798784 + 2147483648 = 2155304311,
    # which wraps to the int32 2155304311 - 2^32 = -2139662985.
    e = torch.tensor([[[-8, -42, -8, 1]] * 8], dtype=torch.int32)  # [T=1, H=8, 4]
    packed = pack_scales_sm100(e, 8)
    assert packed.shape == (1, 1, 8) and packed[0, 0, 0].item() == -2139662985
    assert unpack_scales_sm100(packed)[0, 0, 0].tolist() == [119, 85, 119, 128]


def test_layout_strides_and_zero_padding():
    # T = 5 -> T_al = round_up(5, 4) = 8; H = 16, hpg = 8 -> G = 2.
    # SM90: [G, T, 4*hpg] = [2, 5, 32], strides (32*8, 1, 8); storage 2*32*8 = 512 floats.
    # SM100: [2, 5, 8], strides (8*8, 1, 8); storage 2*8*8 = 128 int32.
    g = torch.Generator().manual_seed(0)
    o = torch.randn(5, 16, 512, generator=g).to(torch.bfloat16)
    r = inv_rope_fp8_quant(o, torch.arange(5), cos_sin_cache(8), heads_per_group=8)
    assert r.codes.shape == (2, 5, 4096) and r.codes_tgd.shape == (5, 2, 4096)
    assert r.scales_sm90.shape == (2, 5, 32) and r.scales_sm90.stride() == (256, 1, 8)
    assert r.scales_sm100.shape == (2, 5, 8) and r.scales_sm100.stride() == (64, 1, 8)
    s90 = torch.as_strided(r.scales_sm90, (2, 32, 8), (256, 8, 1))  # [G, inner, T_al] storage
    assert s90.untyped_storage().nbytes() == 512 * 4
    assert bool((s90[:, :, 5:] == 0).all()) and bool((s90[:, :, :5] > 0).all())
    s100 = torch.as_strided(r.scales_sm100, (2, 8, 8), (64, 8, 1))
    assert bool((s100[:, :, 5:] == 0).all())
    # element mapping: codes_tgd[t, g, hi*512 + d] is head g*8 + hi; scales_sm90[g, t, hi*4 + i]
    for t, h, d in ((0, 0, 0), (3, 9, 300), (4, 15, 511)):
        gi, hi = divmod(h, 8)
        flat_codes = r.codes_tgd[t, gi, hi * 512 + d]
        single = inv_rope_fp8_quant(o[t:t + 1, h // 8 * 8:(h // 8 + 1) * 8], torch.tensor([t]), cos_sin_cache(8))
        assert flat_codes.item() == single.codes_tgd[0, 0, hi * 512 + d].item()
        i = d // 128
        assert r.scales_sm90[gi, t, hi * 4 + i].item() == 2.0 ** r.exponents[t, h, i].item()


def test_rotation_is_the_triton_inverse_and_nope_untouched():
    g = torch.Generator().manual_seed(1)
    tab = cos_sin_cache(100, theta=160000.0)
    o = torch.randn(3, 8, 512, generator=g).to(torch.bfloat16)
    pos = torch.tensor([7, 50, 99])
    r = inv_rope_fp8_quant(o, pos, tab)
    assert torch.equal(r.rotated, apply_rope(o, pos, tab, inverse=True, arithmetic=RopeArithmetic.FMA_TRITON))
    assert torch.equal(r.rotated[..., :448], o[..., :448].float())
    assert torch.equal(inverse_rope_output(o, pos, tab), r.rotated)


def test_log2f_exponent_known_divergence():
    # amax a = 0.4375 + 2^-25 (the fp32 after 448 * 2^-10 = 0.4375). fl32(1/448) = 9586981 * 2^-32
    # = (1/448)(1 + 4.47e-8), so a * fl32(1/448) = 2^-10 (1 + 6.8e-8 + 4.47e-8) -> rounds to the fp32
    # r = 2^-10 (1 + 2^-23). Exact rule: ceil(log2 r) = -9. Kernel: log2 r = -10 + 2^-23/ln 2
    # = -10 + 1.72e-7, and fp32 values near -10 are 2^-20 apart, so fl32(log2 r) = -10 and
    # e = -10. Codes of a: log2f: a * 2^10 = 448.00003 -> clamp 448 -> 0x7E;
    # exact: a * 2^9 = 224.000015 -> RNE 224 = 1.75 * 2^7 -> 0b0_1110_110 = 0x76.
    from dsv4_numerics.reference.attention.epilogue import quantize_groups_log2f
    from dsv4_numerics.reference.formats.quant import quantize_groups_ue8m0

    x = torch.zeros(1, 128)
    x[0, 0] = 0.4375 + 2.0**-25
    codes, e = quantize_groups_log2f(x)
    assert e.item() == -10 and codes[0, 0].item() == 0x7E
    codes, e = quantize_groups_ue8m0(x)
    assert e.item() == -9 and codes[0, 0].item() == 0x76


@given(st.integers(0, 2**31 - 1), st.integers(1, 9), st.floats(1e-6, 1e4), st.sampled_from(["log2f", "exact"]))
def test_tier_c_bound_and_scale_rule(seed, T, mag, rule):
    # Tier C (attention 7): |deq - ref| <= 16 * 2^e (half an E4M3 step at the top of the group's
    # range, [256, 448] * 2^e has step 32 * 2^e). "exact": e is the smallest integer with
    # 2^e >= r = fl32(max(amax, 1e-10) * fl32(1/448)) (checked against exact rationals here);
    # "log2f": the same, or one less when r lies within 2^-16 (relative) above 2^(e_exact - 1).
    from fractions import Fraction

    from .exact import rn32

    g = torch.Generator().manual_seed(seed)
    o = (torch.randn(T, 8, 512, generator=g) * mag).to(torch.bfloat16)
    pos = torch.randint(0, 64, (T,), generator=g)
    r = inv_rope_fp8_quant(o, pos, cos_sin_cache(64), exponent_rule=rule)
    e = r.exponents.to(torch.float64).repeat_interleave(128, dim=-1)
    assert bool(((r.dequantized.double() - r.rotated.double()).abs() <= 16 * 2.0**e).all())
    inv448 = Fraction(rn32(Fraction(1, 448)))
    for t in range(T):
        for h in (0, 7):
            for i in range(4):
                a = r.rotated[t, h, i * 128:(i + 1) * 128].abs().max().item()
                rr = Fraction(rn32(Fraction(max(a, rn32(Fraction(1e-10)))) * inv448))
                want = 0
                while Fraction(2) ** want < rr:
                    want += 1
                while Fraction(2) ** (want - 1) >= rr:
                    want -= 1
                got = r.exponents[t, h, i].item()
                near = rr <= Fraction(2) ** (want - 1) * (1 + Fraction(1, 2**16))
                assert got == want or (rule == "log2f" and near and got == want - 1)


def test_validation():
    tab = cos_sin_cache(4)
    o = torch.zeros(2, 16, 512, dtype=torch.bfloat16)
    with pytest.raises(InputError, match="inv_rope_fp8_quant.*'heads_per_group'.*divide"):
        inv_rope_fp8_quant(o, torch.tensor([0, 1]), tab, heads_per_group=3)
    with pytest.raises(InputError, match="inv_rope_fp8_quant.*'o'.*dtype"):
        inv_rope_fp8_quant(o.float(), torch.tensor([0, 1]), tab)
    bad = o.clone()
    bad[0, 0, 0] = float("nan")
    with pytest.raises(InputError, match="inv_rope_fp8_quant.*'o'.*finite"):
        inv_rope_fp8_quant(bad, torch.tensor([0, 1]), tab)
    with pytest.raises(InputError, match="inv_rope_fp8_quant.*'positions'.*shape"):
        inv_rope_fp8_quant(o, torch.tensor([0]), tab)
    with pytest.raises(InputError, match="pack_scales_sm90.*'exponents'"):
        pack_scales_sm90(torch.zeros(2, 16, 3, dtype=torch.int32), 8)
