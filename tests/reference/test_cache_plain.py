"""Plain bf16 rows and per-tensor FP8 rows (datapath 1.6, 2.7; H15)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given

from dsv4_numerics.reference.caches.plain import (
    decode_fp8_rows,
    dequantize_fp8_rows,
    empty_plain_cache,
    encode_fp8_rows,
    insert_bf16_rows,
    insert_fp8_rows,
    read_bf16_rows,
    read_fp8_rows,
)
from dsv4_numerics.reference.errors import InputError
from dsv4_numerics.reference.policies import NonFinite, SlotSkip
from dsv4_numerics.strategies.cache import bf16_rows, slot_mappings


def row(values: dict[int, float]) -> torch.Tensor:
    r = torch.zeros(1, 512)
    for i, v in values.items():
        r[0, i] = v
    return r


def test_bf16_rows_rne_from_fp32_by_hand():
    # 1 + 2**-8 is the midpoint of bf16 1.0 (mantissa 0) and 1.0078125 (mantissa 1) -> even -> 1.0;
    # 1 + 3 * 2**-8 is the midpoint of 1.0078125 (odd) and 1.015625 (even) -> 1.015625.
    k = row({0: 1 + 2.0**-8, 1: 1 + 3 * 2.0**-8, 2: -0.0})
    cache = empty_plain_cache(2, 4, fill=5.0)
    out = insert_bf16_rows(cache, k, torch.tensor([6]))
    got = read_bf16_rows(out, torch.tensor([6]))[0]
    assert got[:2].tolist() == [1.0, 1.015625] and torch.signbit(got[2])
    assert cache.eq(5.0).all()
    others = torch.ones(2, 4, dtype=torch.bool)
    others[1, 2] = False  # slot 6 = page 1, entry 2
    assert out[others].eq(5.0).all()


def test_fp8_rows_by_hand():
    # kv_scale 1: 500 -> clamp 448 -> 0x7E; -1000 -> 0xFE; 464 -> 0x7E; 1.0 -> 0x38; -0.0 -> 0x80;
    # 2**-10 -> tie -> 0x00
    x = row({0: 500.0, 1: -1000.0, 2: 464.0, 3: 1.0, 4: -0.0, 5: 2.0**-10})
    assert encode_fp8_rows(x)[0, :7].tolist() == [0x7E, 0xFE, 0x7E, 0x38, 0x80, 0x00, 0x00]
    # kv_scale 2: inv = 0.5; 3 * 0.5 = 1.5 = 1.1000 * 2**0 -> 0x3C; decode 0x3C * 2 = 3.0
    c = encode_fp8_rows(row({0: 3.0}), kv_scale=2.0)
    assert c[0, 0].item() == 0x3C and decode_fp8_rows(c, 2.0)[0, 0].item() == 3.0
    # kv_scale 3: inv = fl32(1/3) = 11184811 * 2**-25; 3 * 11184811 = 2**25 + 1, so 3 * inv = 1 + 2**-25
    # exactly, which rounds to fp32 1.0 -> 0x38 (the kernel's fp32 multiply, then the FP8 cast)
    assert encode_fp8_rows(row({0: 3.0}), kv_scale=3.0)[0, 0].item() == 0x38


def test_h15_rounding_point():
    # fp32 x = 1.0625 + 2**-12. bf16 first: the bits below 2**-8 are dropped -> 1.0625, the midpoint
    # of E4M3 1.0 and 1.125 -> even -> 1.0 = 0x38. Quantising the fp32 value directly: above the
    # midpoint -> 1.125 = 0x39.
    x = row({0: 1.0625 + 2.0**-12})
    assert encode_fp8_rows(x, round_to_bf16_first=True)[0, 0].item() == 0x38
    assert encode_fp8_rows(x, round_to_bf16_first=False)[0, 0].item() == 0x39


def test_fp8_nonfinite():
    x = row({0: float("nan"), 1: float("inf")})
    with pytest.raises(InputError, match="encode_fp8_rows.*'x'.*finite"):
        encode_fp8_rows(x)
    assert encode_fp8_rows(x, nonfinite=NonFinite.CUDA_SATFINITE)[0, :2].tolist() == [0xFE, 0x7E]
    # a tiny kv_scale overflows the fp32 product; the writer's clamp still saturates it
    assert encode_fp8_rows(row({0: 1e38}), kv_scale=2.0**-100)[0, 0].item() == 0x7E


@given(slot_mappings(3, 4))
def test_insert_fp8_rows_roundtrip(slot_mapping):
    n = slot_mapping.shape[0]
    x = torch.randn(n, 512, generator=torch.Generator().manual_seed(n)) * 100
    for dtype in (torch.uint8, torch.float8_e4m3fn):
        cache = empty_plain_cache(3, 4, dtype=dtype, fill=0x11)
        out = insert_fp8_rows(cache, x, slot_mapping)
        assert out.dtype == dtype
        keep = slot_mapping >= 0
        got = read_fp8_rows(out, slot_mapping[keep])
        # oracle: torch's own RNE cast of the bf16-rounded, +-448-clamped value
        want = x[keep].to(torch.bfloat16).float().clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
        assert torch.equal(got, want)
        assert torch.equal(dequantize_fp8_rows(out, slot_mapping[keep]), want.view(torch.float8_e4m3fn).float())
        untouched = torch.ones(12, dtype=torch.bool)
        untouched[slot_mapping[keep]] = False
        assert out.view(torch.uint8).reshape(12, 512)[untouched].eq(0x11).all()


@given(bf16_rows(max_rows=8))
def test_insert_bf16_rows_verbatim(k):
    n = k.shape[0]
    slots = torch.randperm(16, generator=torch.Generator().manual_seed(n))[:n]
    out = insert_bf16_rows(empty_plain_cache(4, 4), k, slots)
    assert torch.equal(read_bf16_rows(out, slots).view(torch.int16), k.view(torch.int16))


def test_plain_input_errors():
    bc = empty_plain_cache(2, 4)
    fc = empty_plain_cache(2, 4, dtype=torch.uint8)
    x = torch.zeros(2, 512)
    cases = [
        (lambda: insert_bf16_rows(fc, x, torch.tensor([0, 1])), "'cache'.*bfloat16"),
        (lambda: insert_fp8_rows(bc, x, torch.tensor([0, 1])), "'cache'.*uint8"),
        (lambda: insert_bf16_rows(bc, torch.zeros(2, 500), torch.tensor([0, 1])), "'k'.*512"),
        (lambda: insert_fp8_rows(fc, x, torch.tensor([0, 8])), "'slot_mapping'.*out of range"),
        (lambda: insert_fp8_rows(fc, x, torch.tensor([-3, 1]), slot_skip=SlotSkip.MINUS1_ONLY), "'slot_mapping'"),
        (lambda: encode_fp8_rows(x, kv_scale=0.0), "'kv_scale'"),
        (lambda: encode_fp8_rows(x, kv_scale=0.1), "'kv_scale'.*float32"),
        (lambda: read_fp8_rows(fc, torch.tensor([9])), "'slots'"),
    ]
    for fn, pattern in cases:
        with pytest.raises(InputError, match=pattern):
            fn()


def test_requantize_e4m3_rounds_saturates_and_keeps_nan():
    """Unit-scale E4M3FN by hand: 1.0625 is the tie between 1 and 1.125 (even mantissa: 1), 1.1875 the
    tie between 1.125 and 1.25 (even: 1.25); 2**-10 the tie between 0 and the smallest subnormal
    2**-9 (even: 0); 3 * 2**-10 the tie between the subnormals 1 * 2**-9 and 2 * 2**-9 (even: 2**-8);
    460 rounds to 448, 500 and +-Inf saturate."""
    from dsv4_numerics.reference.caches.plain import requantize_e4m3

    inf, nan = float("inf"), float("nan")
    x = torch.zeros(1, 512)  # a 512-wide row, the rest zeros
    x[0, :10] = torch.tensor([1.0625, 1.1875, 2.0**-10, 3 * 2.0**-10, 460.0, 500.0, -500.0, inf, -inf, nan])
    got = requantize_e4m3(x)[:, :10]
    assert got.dtype == torch.bfloat16
    want = torch.tensor([[1.0, 1.25, 0.0, 2.0**-8, 448.0, 448.0, -448.0, 448.0, -448.0]], dtype=torch.float32)
    assert torch.equal(got[:, :-1].float(), want) and bool(torch.isnan(got[0, -1]))
