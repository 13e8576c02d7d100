"""V3.2 656-byte rows (reference/caches/v32.py): hand-worked byte layouts, the FlashMLA V32
quantiser, paged insert/read, and the consumer scale policies (datapath 1.5, attention.md 6)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dsv4_numerics.reference.caches.v32 import (
    dequantize_v32,
    dequantize_v32_cache,
    encode_v32_rows,
    insert_v32,
    pack_v32_rows,
    quantize_v32,
    read_v32,
    unpack_v32_rows,
    v32_nan_row,
    v32_page_view,
    v32_scale_multipliers,
)
from dsv4_numerics.reference.errors import InputError

ROW = 656


def _row(codes=None, scales=(1.0, 1.0, 1.0, 1.0), rope=None):
    c = torch.zeros(1, 512, dtype=torch.uint8) if codes is None else codes.view(1, 512)
    s = torch.tensor([scales], dtype=torch.float32)
    r = torch.zeros(1, 64, dtype=torch.bfloat16) if rope is None else rope.view(1, 64)
    return pack_v32_rows(c, s, r)[0]


# --------------------------------------------------------------------------- byte layout


def test_row_layout_known_bytes():
    # codes: byte i holds i % 251 (a pattern that is not periodic in 256, so a shifted or
    # reversed region would show); scales 1.0, 0.75, -2.0, 2**-13; rope: dim 512 = 1.0,
    # dim 513 = -2.0, the rest 0.
    codes = torch.tensor([i % 251 for i in range(512)], dtype=torch.uint8)
    rope = torch.zeros(64, dtype=torch.bfloat16)
    rope[0], rope[1] = 1.0, -2.0
    row = _row(codes, (1.0, 0.75, -2.0, 2.0**-13), rope)
    assert row.shape == (ROW,) and row.dtype == torch.uint8
    assert row[:512].tolist() == [i % 251 for i in range(512)]
    # fp32 1.0 = 0x3F800000, little endian 00 00 80 3F
    assert row[512:516].tolist() == [0x00, 0x00, 0x80, 0x3F]
    # fp32 0.75 = 1.5 * 2**-1: sign 0, exponent 126 = 0x7E, mantissa 0x400000 -> 0x3F400000
    assert row[516:520].tolist() == [0x00, 0x00, 0x40, 0x3F]
    # fp32 -2.0 = 0xC0000000
    assert row[520:524].tolist() == [0x00, 0x00, 0x00, 0xC0]
    # fp32 2**-13: exponent 127 - 13 = 114 = 0x72 -> bits 0x72 << 23 = 0x39000000
    assert row[524:528].tolist() == [0x00, 0x00, 0x00, 0x39]
    # bf16 1.0 = 0x3F80 -> bytes 80 3F at 528, 529; bf16 -2.0 = 0xC000 -> 00 C0 at 530, 531
    assert row[528:532].tolist() == [0x80, 0x3F, 0x00, 0xC0]
    assert row[532:].tolist() == [0] * 124


def test_unpack_is_exact_inverse_including_nan_payloads():
    g = torch.Generator().manual_seed(7)
    raw = torch.randint(0, 256, (5, ROW), generator=g, dtype=torch.uint8)
    codes, scales, rope = unpack_v32_rows(raw)
    assert torch.equal(pack_v32_rows(codes, scales, rope), raw)  # every bit pattern, NaNs included


def test_nan_row_bytes():
    row = v32_nan_row()
    assert row[:512].eq(0x7F).all()  # E4M3FN NaN
    # fp32 quiet NaN 0x7FC00000 -> 00 00 C0 7F, four times
    assert row[512:528].tolist() == [0x00, 0x00, 0xC0, 0x7F] * 4
    # bf16 quiet NaN 0x7FC0 -> C0 7F, 64 times
    assert row[528:].tolist() == [0xC0, 0x7F] * 64


# --------------------------------------------------------------------------- FlashMLA V32 quantiser


def test_quantiser_known_tiles():
    k = torch.zeros(1, 576, dtype=torch.bfloat16)
    # tile 0: amax 1.75 -> 1.75/448 = 2**-8 exactly (the tie of datapath 2.0) -> e = -8,
    # scale 2**-8. x = 1.75 -> 1.75 * 2**8 = 448 = code 0x7E; x = -0.5 -> -128 = -(1.0 * 2**7):
    # exponent field 7 + 7 = 14 -> 0b1_1110_000 = 0xF0.
    k[0, 0], k[0, 1] = 1.75, -0.5
    # tile 1 (dims 128..255): all zero -> r = 0 < 1e-4f -> e = ceil(log2 1e-4f) = -13
    #   (2**-14 = 6.1e-5 < 1e-4 <= 2**-13 = 1.22e-4); codes 0.
    # tile 2: amax 3.0 -> 3/448 = 0.0066964 -> ceil(log2) = -7 (2**-8 = 0.0039 < r <= 2**-7);
    # x = 3.0 -> 384 = 1.5 * 2**8 -> E = 15, m = 4 -> 0x7C; x = bf16(0.1) = 0.10009765625 ->
    # * 128 = 12.8125 = 1.6015625 * 2**3 -> nearest 3-bit mantissa 1.625 -> 13 -> E = 10,
    # m = 5 -> 0x55.
    k[0, 256], k[0, 257] = 3.0, 0.1
    # tile 3: amax bf16(1e-6) = 1.046875 * 2**-20 (1e-6 * 2**20 = 1.048576 -> 134/128) ->
    # r < 1e-4f -> e = -13; x * 2**13 = 1.046875 * 2**-7 = 4.1875 subnormal steps of 2**-9 ->
    # RNE 4 -> code 0x04 (this is where Q_S differs from Q_A: Q_A would give e = -21).
    k[0, 384] = 1e-6
    # rope dims copied verbatim
    k[0, 512], k[0, 575] = -3.5, 0.25
    codes, scales, rope = quantize_v32(k)
    assert scales.tolist() == [[2.0**-8, 2.0**-13, 2.0**-7, 2.0**-13]]
    assert codes[0, 0].item() == 0x7E and codes[0, 1].item() == 0xF0
    assert codes[0, 2:128].eq(0).all() and codes[0, 128:256].eq(0).all()
    assert codes[0, 256].item() == 0x7C and codes[0, 257].item() == 0x55
    assert codes[0, 384].item() == 0x04
    assert torch.equal(rope[0], k[0, 512:])
    row = encode_v32_rows(k)[0]
    # scale 2**-8 as fp32 = exponent 119 = 0x77 -> 0x3B800000 -> bytes 00 00 80 3B
    assert row[512:516].tolist() == [0x00, 0x00, 0x80, 0x3B]


def _flashmla_torch_formula(k: torch.Tensor):
    """FlashMLA tests/quant.py V32 branch, re-expressed (independent of the code under test):
    scale = 2**ceil(log2(clamp_min(amax/448, 1e-4))), codes = (x / scale).to(float8_e4m3fn)."""
    x = k[:, :512].float().reshape(-1, 4, 128)
    inv = torch.pow(2, torch.clamp_min(x.abs().amax(-1) / 448.0, 1e-4).log2().ceil())
    codes = (x / inv.unsqueeze(-1)).to(torch.float8_e4m3fn).view(torch.uint8).reshape(-1, 512)
    return codes, inv


def _bf16_rows(seed: int, n: int, log_mags) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 576, generator=g, dtype=torch.float64)
    mags = torch.tensor(log_mags, dtype=torch.float64).repeat(n // len(log_mags) + 1)[:n]
    return (x * torch.pow(2.0, mags).unsqueeze(1)).to(torch.bfloat16)


@given(seed=st.integers(0, 2**31 - 1), mags=st.lists(st.integers(-30, 20), min_size=1, max_size=4))
def test_quantiser_matches_flashmla_formula(seed, mags):
    # For bf16 input the torch log2 of FlashMLA is exact enough (amax/448 is never within an fp32
    # ulp of a power of two unless it is one), and |x/scale| <= 448 so the torch cast never
    # saturates: the two must agree bit for bit.
    k = _bf16_rows(seed, 8, mags)
    codes, scales, _ = quantize_v32(k)
    want_codes, want_scales = _flashmla_torch_formula(k)
    assert torch.equal(scales, want_scales)
    assert torch.equal(codes, want_codes)


@given(seed=st.integers(0, 2**31 - 1), mags=st.lists(st.integers(-12, 12), min_size=1, max_size=4))
def test_dequantised_error_within_half_a_code_step(seed, mags):
    # |x - decode(code) * scale| <= half the E4M3 spacing at |x| (RNE), i.e. <= 2**-4 |x| for normal
    # codes and <= 2**-10 * scale (half a subnormal step 2**-9) below them.
    k = _bf16_rows(seed, 6, mags)
    deq = dequantize_v32(encode_v32_rows(k))
    x = k.to(torch.float64)
    _, scales, _ = quantize_v32(k)
    s = scales.to(torch.float64).repeat_interleave(128, dim=1)
    err = (deq[:, :512] - x[:, :512]).abs()
    bound = torch.maximum(x[:, :512].abs() * 2.0**-4, s * 2.0**-10)
    assert bool((err <= bound).all())
    assert torch.equal(deq[:, 512:], x[:, 512:])  # rope exact


def test_quantiser_rejects_bad_input():
    with pytest.raises(InputError, match="quantize_v32: argument 'k' must have dtype bfloat16"):
        quantize_v32(torch.zeros(1, 576))
    with pytest.raises(InputError, match=r"quantize_v32: argument 'k' must have shape \[\*, 576\]"):
        quantize_v32(torch.zeros(1, 512, dtype=torch.bfloat16))
    k = torch.zeros(1, 576, dtype=torch.bfloat16)
    k[0, 3] = float("nan")
    with pytest.raises(InputError, match="must be finite"):
        quantize_v32(k)


# --------------------------------------------------------------------------- dequantisation policies


def test_scale_multipliers_known_values():
    s = torch.tensor([0.75, 3.0, 2.0**-5, 0.7, 1.0], dtype=torch.float32)
    assert v32_scale_multipliers(s, "exact").tolist() == [0.75, 3.0, 2.0**-5, float(np.float32(0.7)), 1.0]
    # RZ through E8M0: the power of two at or below: 0.75 -> 0.5, 3 -> 2, powers of two unchanged,
    # 0.7 -> 0.5 (0.7 = 1.4 * 2**-1)
    assert v32_scale_multipliers(s, "sm100_rz_e8m0").tolist() == [0.5, 2.0, 2.0**-5, 0.5, 1.0]
    # bf16 RNE: 0.7 = 1.4 * 2**-1, 1.4 * 128 = 179.2 -> 179 -> 179/256 = 0.69921875
    assert v32_scale_multipliers(s, "bf16_rne").tolist() == [0.75, 3.0, 2.0**-5, 0.69921875, 1.0]


def test_dequantise_under_each_policy_known_values():
    codes = torch.zeros(512, dtype=torch.uint8)
    codes[0] = 0x7E  # 448
    codes[1] = 0x38  # 0b0_0111_000 = 1.0
    codes[128] = 0x7E  # tile 1
    row = _row(codes, (0.7, 0.75, 1.0, 1.0)).view(1, ROW)
    s07 = float(np.float32(0.7))  # 0.699999988079071
    ex = dequantize_v32(row, "exact")[0]
    assert ex[0].item() == 448 * s07 and ex[1].item() == s07  # exact in float64 (3 + 24 bits)
    assert ex[128].item() == 336.0
    bf = dequantize_v32(row, "bf16_rne")[0]
    # 448 * 0.69921875 = 313.25; bf16 spacing in [256, 512) is 2 -> 314 (313.25 is nearer 314)
    assert bf[0].item() == 314.0 and bf[1].item() == 0.69921875 and bf[128].item() == 336.0
    rz = dequantize_v32(row, "sm100_rz_e8m0")[0]
    assert rz[0].item() == 224.0 and rz[1].item() == 0.5  # 0.7 -> 0.5
    assert rz[128].item() == 224.0  # the spec's example: scale 0.75 -> 0.5


@given(seed=st.integers(0, 2**31 - 1), mags=st.lists(st.integers(-20, 20), min_size=1, max_size=4))
def test_policies_agree_on_power_of_two_scales(seed, mags):
    rows = encode_v32_rows(_bf16_rows(seed, 4, mags))
    ex = dequantize_v32(rows, "exact")
    assert torch.equal(ex, dequantize_v32(rows, "bf16_rne"))
    assert torch.equal(ex, dequantize_v32(rows, "sm100_rz_e8m0"))


def test_rz_policy_domain():
    with pytest.raises(InputError, match="v32_scale_multipliers: argument 'scales' must be positive normal"):
        v32_scale_multipliers(torch.tensor([0.0]), "sm100_rz_e8m0")
    with pytest.raises(InputError, match="positive normal"):
        v32_scale_multipliers(torch.tensor([-1.0]), "sm100_rz_e8m0")
    assert math.isnan(v32_scale_multipliers(torch.tensor([float("nan")]), "sm100_rz_e8m0").item())
    with pytest.raises(InputError, match="argument 'policy' must be one of"):
        v32_scale_multipliers(torch.tensor([1.0]), "rz")


# --------------------------------------------------------------------------- paged cache


def _cache(nb=3, bs=4, pad_rows=1, fill=0xAB):
    return torch.full((nb, (bs + pad_rows) * ROW), fill, dtype=torch.uint8)


def test_page_view_forms_and_strides():
    c = _cache()
    v = v32_page_view(c, 4)
    assert v.shape == (3, 4, ROW) and v.stride() == (5 * ROW, ROW, 1)
    v4 = v.unsqueeze(2)
    assert v32_page_view(v4, 4).stride() == v.stride()
    assert v32_page_view(v, 4).data_ptr() == c.data_ptr()
    with pytest.raises(InputError, match="v32_page_view: argument 'cache' must have dtype uint8"):
        v32_page_view(c.float(), 4)
    with pytest.raises(InputError, match="must hold block_size\\*656"):
        v32_page_view(torch.zeros(2, 3 * ROW, dtype=torch.uint8), 4)
    bad = torch.zeros(2, 4, 660, dtype=torch.uint8)[:, :, :ROW]  # rows 660 bytes apart
    with pytest.raises(InputError, match="rows must be exactly 656 bytes apart"):
        v32_page_view(bad, 4)


def test_insert_read_round_trip_with_padded_pages():
    bs = 4
    c = _cache(bs=bs)
    k = _bf16_rows(11, 3, [-3])
    rows = encode_v32_rows(k)
    slots = torch.tensor([9, -1, 2], dtype=torch.int32)  # page 2 row 1, skipped, page 0 row 2
    out = insert_v32(c, rows, slots, bs)
    assert out.shape == c.shape and out.stride() == c.stride()
    assert torch.equal(c, _cache(bs=bs))  # input untouched
    # slot 9 -> page 9 // 4 = 2, entry 1 -> bytes [2*P + 656, 2*P + 1312) with P = 5*656
    p = 5 * ROW
    assert torch.equal(out.view(-1)[2 * p + ROW: 2 * p + 2 * ROW], rows[0])
    assert torch.equal(out.view(-1)[2 * ROW: 3 * ROW], rows[2])
    assert torch.equal(read_v32(out, torch.tensor([9, 2]), bs), rows[[0, 2]])
    # every other byte (other slots, page padding rows) kept
    mask = torch.ones(out.numel(), dtype=torch.bool)
    mask[2 * p + ROW: 2 * p + 2 * ROW] = False
    mask[2 * ROW: 3 * ROW] = False
    assert out.view(-1)[mask].eq(0xAB).all()


def test_insert_slot_rules():
    c = _cache()
    rows = encode_v32_rows(_bf16_rows(1, 2, [0]))
    with pytest.raises(InputError, match="may hold -1 \\(skip\\) but no other negative"):
        insert_v32(c, rows, torch.tensor([0, -2]), 4)
    out = insert_v32(c, rows, torch.tensor([0, -2]), 4, slot_skip="all_negative")
    assert torch.equal(read_v32(out, torch.tensor([0]), 4), rows[:1])
    with pytest.raises(InputError, match=r"must lie in \[0, num_blocks\*block_size = 12\)"):
        insert_v32(c, rows, torch.tensor([0, 12]), 4)
    with pytest.raises(InputError, match="must be unique"):
        insert_v32(c, rows, torch.tensor([5, 5]), 4)
    with pytest.raises(InputError, match="read_v32: argument 'slots' must lie in"):
        read_v32(c, torch.tensor([-1]), 4)


def test_dequantize_cache_rows_are_slots():
    bs = 4
    k = _bf16_rows(5, 2, [-2])
    out = insert_v32(_cache(bs=bs, fill=0), encode_v32_rows(k), torch.tensor([6, 11]), bs)
    d = dequantize_v32_cache(out, bs)
    assert d.shape == (12, 576)
    assert torch.equal(d[6], dequantize_v32(encode_v32_rows(k))[0])
    assert torch.equal(d[11], dequantize_v32(encode_v32_rows(k))[1])
    assert d[0].eq(0).all()  # a zero row (codes 0, scales 0.0) dequantises to 0
