"""The V4.1 query quantiser reference (``reference.pipeline.query_quant``): the UE8M0 ceiling rule against an
independent formulation, the zero inverse, the F8_128x4 offsets, exact-norm rows, input errors."""

from __future__ import annotations

import math
import struct

import pytest
import torch

from dsv4_numerics.reference.pipeline import query_quant as qq
from dsv4_numerics.reference.cases import default_cases
from dsv4_numerics.reference.errors import InputError
from dsv4_numerics.reference.formats.fp8 import decode_e4m3fn


def _f32(x: float) -> float:
    return struct.unpack("<f", struct.pack("<f", x))[0]


def _byte_by_bits(amax: float) -> int:
    """The rule from the fp32 bit pattern of ``r`` (exponent field, mantissa), written independently
    of the frexp formulation: round the biased exponent up unless ``r`` is a power of two; a
    subnormal ``r <= 2**-127`` (mantissa <= 2**22) gives 0."""
    r = _f32(_f32(amax) * _f32(1 / 448))
    if r <= 0:
        return 0
    bits = struct.unpack("<I", struct.pack("<f", r))[0]
    e, m = (bits >> 23) & 0xFF, bits & 0x7FFFFF
    if e == 0:
        return 0 if m <= 1 << 22 else 1
    return min(e + (m != 0), 254)


def test_ue8m0_ceiling_matches_the_bit_formulation_at_every_boundary():
    vals = [0.0, 1.0, 448.0, 449.0, 447.99997]
    for k in range(-150, 120, 7):
        p = 448.0 * 2.0**k
        vals += [p, math.nextafter(p, math.inf), math.nextafter(p, 0.0), 2.0**k]
    a = torch.tensor([_f32(v) for v in vals], dtype=torch.float32)
    got = qq.ue8m0_ceil_bytes(a).tolist()
    assert got == [_byte_by_bits(float(x)) for x in a]


def test_zero_byte_groups_quantise_to_signed_zeros_and_codes_stay_in_range():
    y = torch.zeros(2, 64, dtype=torch.float64)
    y[0, :32] = 2.0**-120  # amax * fl32(1/448) <= 2**-127: byte 0, inverse 0
    y[0, 5] = -(2.0**-121)
    y[1, :32] = torch.linspace(-3, 3, 32, dtype=torch.float64)
    yb = y.to(torch.bfloat16)
    codes, sf = qq.quantize_query_groups(yb)
    assert sf[0, 0] == 0 and sf[0, 1] == 0  # the tiny group and the all-zero group
    assert set(codes[0, :32].tolist()) == {0x00, 0x80} and codes[0, 5] == 0x80
    deq = decode_e4m3fn(codes[1, :32]).double() * 2.0 ** (int(sf[1, 0]) - 127)
    # RNE onto E4M3 after exact power-of-two scaling: within half the top E4M3 step (32 / 2) of the scale
    assert float((deq - yb[1, :32].double()).abs().max()) <= 16 * 2.0 ** (int(sf[1, 0]) - 127)


def test_f8_128x4_offsets_follow_the_swizzle_formula_and_cover_the_buffer():
    t, g = 130, 48
    n = qq.f8_128x4_bytes(t, g)
    assert n == 256 * 48
    # row 130 = tile 1, sub-row 2 of sub-block 0; group 5 = group tile 1, lane 1 (12 group tiles per row tile)
    assert int(qq.f8_128x4_offsets(torch.tensor(130), torch.tensor(5), g)) == (1 * 12 + 1) * 512 + 2 * 16 + 0 * 4 + 1
    # row 97 = sub-row 1 of sub-block 3
    assert int(qq.f8_128x4_offsets(torch.tensor(97), torch.tensor(0), g)) == 1 * 16 + 3 * 4
    off = qq.f8_128x4_offsets(torch.arange(256)[:, None], torch.arange(48)[None, :], g)
    assert torch.equal(torch.sort(off.reshape(-1)).values, torch.arange(n))  # a bijection onto the buffer
    sf = torch.randint(0, 255, (t, g), dtype=torch.uint8)
    buf = qq.swizzle_f8_128x4(sf)
    assert torch.equal(qq.unswizzle_f8_128x4(buf, t, g), sf)
    pad = torch.ones(n, dtype=torch.bool)
    pad[qq.f8_128x4_offsets(torch.arange(t)[:, None], torch.arange(g)[None, :], g).reshape(-1)] = False
    assert int(buf[pad].max()) == 0  # padding rows hold byte 0


def test_exact_norm_rows_normalise_to_the_weights_exactly():
    case = default_cases("v41_query_quant")[0]
    inp = case.inputs
    assert bool(qq.is_exact_norm_row(inp["qr"]).all()) and bool(qq.is_exact_norm_row(inp["kv"]).all())
    y = qq.rms_norm_rows(inp["qr"], inp["q_weight"], inp["eps"])
    assert torch.equal(y.double(), inp["qr"].double() * inp["q_weight"].double())
    out = qq.fused_q_kv_rmsnorm_quant(inp["qr"], inp["kv"], inp["q_weight"], inp["kv_weight"], inp["eps"])
    assert {0} < set(out["q_sf"].unique().tolist())  # the tiny weight groups reach byte 0 (zero inverse)
    assert out["q_scales"].numel() == qq.f8_128x4_bytes(3, 48)


def test_bad_inputs_name_the_argument():
    with pytest.raises(InputError, match="quantize_query_groups.*y.*multiple of 32"):
        qq.quantize_query_groups(torch.zeros(2, 40, dtype=torch.bfloat16))
    with pytest.raises(InputError, match="y.*finite"):
        qq.quantize_query_groups(torch.full((1, 32), float("nan"), dtype=torch.bfloat16))
    with pytest.raises(InputError, match="rms_norm_rows.*weight"):
        qq.rms_norm_rows(torch.ones(1, 32, dtype=torch.bfloat16), torch.ones(16, dtype=torch.bfloat16), 0.0)
    with pytest.raises(InputError, match="all-zero row"):
        qq.rms_norm_rows(torch.zeros(1, 32, dtype=torch.bfloat16), torch.ones(32, dtype=torch.bfloat16), 0.0)
    with pytest.raises(InputError, match="unswizzle_f8_128x4.*buf"):
        qq.unswizzle_f8_128x4(torch.zeros(10, dtype=torch.uint8), 3, 48)
