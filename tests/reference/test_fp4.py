"""E2M1 codes, nibble packing and the V4.1 NVFP4 E4M3 scale rules (reference/formats/fp4.py).

Expected values come from independent sources: the E2M1 bit-field formula, numpy's IEEE float32
arithmetic (correctly rounded multiply / divide), torch's float8_e4m3fn cast (RNE), and a
brute-force nearest-grid search -- never from the code under test.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings

from dsv4_numerics.strategies.v41 import (
    E2M1_TIES,
    e2m1_saturation_groups,
    e2m1_tie_groups,
    subnormal_scale_groups,
    zero_groups,
)
from dsv4_numerics.reference.caches.v41 import decode_records, encode_records
from dsv4_numerics.reference.errors import InputError
from dsv4_numerics.reference.formats.fp4 import decode_e2m1, encode_e2m1, nvfp4_scale_bytes, pack_e2m1, unpack_e2m1
from dsv4_numerics.reference.policies import Nvfp4ScaleRule, V41Record


def _e2m1_formula(code: int) -> float:
    """E2M1 by its fields: sign s, exponent e (bias 1), mantissa m (1 bit); e == 0 is subnormal."""
    s, e, m = code >> 3, (code >> 1) & 3, code & 1
    mag = m * 0.5 if e == 0 else (1 + m / 2) * 2.0 ** (e - 1)
    return -mag if s else mag


def _brute_e2m1(v: float) -> int:
    """Nearest of the 8 magnitudes, ties to the even code, saturating; sign from the sign bit."""
    a = min(abs(v), 6.0)
    dist = [abs(a - _e2m1_formula(c)) for c in range(8)]
    best = min(dist)
    code = min(c for c in range(8) if dist[c] == best and (dist.count(best) == 1 or c % 2 == 0))
    return code | (8 if np.signbit(v) else 0)


def test_all_16_codes_decode_by_the_formula_and_round_trip():
    codes = torch.arange(16, dtype=torch.uint8)
    got = decode_e2m1(codes)
    for c in range(16):
        want = _e2m1_formula(c)
        assert float(got[c]) == want and np.signbit(float(got[c])) == np.signbit(want), c
    assert torch.equal(encode_e2m1(got), codes)  # -0.0 -> 0x8 included


def test_encoder_matches_brute_force_on_every_quarter_step_and_its_neighbours():
    base = np.arange(-32, 33, dtype=np.float32) / 4  # every tie, every grid point, saturating values
    vals = np.concatenate([base, np.nextafter(base, np.float32(np.inf)), np.nextafter(base, np.float32(-np.inf))])
    got = encode_e2m1(torch.from_numpy(vals))
    want = torch.tensor([_brute_e2m1(float(v)) for v in vals], dtype=torch.uint8)
    assert torch.equal(got, want)


def test_ties_go_to_the_even_code():
    got = encode_e2m1(torch.tensor(E2M1_TIES, dtype=torch.float32))
    assert got.tolist() == [0, 2, 2, 4, 4, 6, 6]  # 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4


def test_pack_puts_the_even_element_in_the_low_nibble():
    codes = torch.tensor([0x1, 0x2, 0xF, 0x8], dtype=torch.uint8)
    packed = pack_e2m1(codes)
    assert packed.tolist() == [0x21, 0x8F]
    assert torch.equal(unpack_e2m1(packed), codes)


def _e4m3_value(b: int) -> float:
    s, e, m = b >> 7, (b >> 3) & 0xF, b & 7
    mag = m * 2.0**-9 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
    return -mag if s else mag


def test_all_256_scale_bytes_decode_as_e4m3_in_a_record():
    # one NVFP4 record per scale byte: every code 0x1 (0.5) -> each dim decodes to 0.5 * scale
    data = torch.full((256, 256), 0x11, dtype=torch.uint8)
    scales = torch.arange(256, dtype=torch.uint8).unsqueeze(1).repeat(1, 32)
    out = decode_records(data, scales, V41Record.NVFP4).float()
    for b in range(256):
        if b & 0x7F == 0x7F:
            assert torch.isnan(out[b]).all(), b
        else:
            want = torch.tensor(0.5 * _e4m3_value(b)).to(torch.bfloat16).float()
            assert torch.equal(out[b], want.expand(512)), b


@pytest.mark.parametrize("rule", list(Nvfp4ScaleRule))
def test_every_positive_scale_byte_round_trips_from_six_times_its_value(rule):
    bytes_ = torch.arange(1, 0x7F, dtype=torch.uint8)  # 0x01..0x7E: subnormal and normal scales
    amax = torch.tensor([6 * _e4m3_value(int(b)) for b in bytes_], dtype=torch.float32)
    assert torch.equal(nvfp4_scale_bytes(amax, rule), bytes_)


def _np_scale_byte(amax: np.float32, rule: Nvfp4ScaleRule) -> int:
    r = amax * np.float32(1 / 6) if rule is Nvfp4ScaleRule.RECIP_MUL else amax / np.float32(6)
    r = np.float32(min(max(r, np.float32(2.0**-9)), np.float32(448)))
    return int(torch.tensor(float(r), dtype=torch.float32).to(torch.float8_e4m3fn).view(torch.uint8))


def test_scale_rules_agree_on_every_bf16_amax_and_match_numpy():
    bits = torch.arange(0, 0x7F80, dtype=torch.int32).to(torch.int16)  # every non-negative finite bf16
    amax = bits.view(torch.bfloat16).float()
    a = nvfp4_scale_bytes(amax, Nvfp4ScaleRule.RECIP_MUL)
    assert torch.equal(a, nvfp4_scale_bytes(amax, Nvfp4ScaleRule.DIV_RN))
    idx = torch.randint(0, amax.numel(), (300,), generator=torch.Generator().manual_seed(3))
    for i in idx.tolist():
        assert int(a[i]) == _np_scale_byte(np.float32(amax[i]), Nvfp4ScaleRule.RECIP_MUL), float(amax[i])


def test_scale_rules_disagree_on_some_fp32_amax_as_numpy_says():
    # fp32 amax next to 6 * (an E4M3 midpoint): one ulp of difference between fl32(a*fl32(1/6))
    # and fl32(a/6) can straddle the midpoint. Search a few midpoints, check each result by numpy.
    found = 0
    for mid in (1.0625, 1.1875, 3.375, 0.3125, 13.5, 100.0):
        six = np.float32(6 * mid)
        cands = [six]
        for _ in range(3):
            cands += [np.nextafter(cands[-1], np.float32(np.inf))]
        lo = [six]
        for _ in range(3):
            lo += [np.nextafter(lo[-1], np.float32(0))]
        for a in sorted(set(cands + lo)):
            t = torch.tensor([float(a)], dtype=torch.float32)
            r1 = int(nvfp4_scale_bytes(t, Nvfp4ScaleRule.RECIP_MUL)[0])
            r2 = int(nvfp4_scale_bytes(t, Nvfp4ScaleRule.DIV_RN)[0])
            assert r1 == _np_scale_byte(a, Nvfp4ScaleRule.RECIP_MUL)
            assert r2 == _np_scale_byte(a, Nvfp4ScaleRule.DIV_RN)
            found += r1 != r2
    assert found > 0, "the two NVFP4 scale rules should differ on some fp32 amax"


def test_nvfp4_encode_matches_an_independent_model_on_random_rows():
    g = torch.Generator().manual_seed(7)
    k = (torch.randn(6, 512, generator=g) * torch.logspace(-4, 3, 6).unsqueeze(1)).to(torch.bfloat16)
    for rule in Nvfp4ScaleRule:
        data, scales = encode_records(k, V41Record.NVFP4, nvfp4_rule=rule)
        x = k.float().numpy().reshape(6, 32, 16)
        for n in range(6):
            for grp in range(32):
                amax = np.float32(np.abs(x[n, grp]).max())
                sb = _np_scale_byte(amax, rule)
                assert int(scales[n, grp]) == sb
                s = np.float32(_e4m3_value(sb))
                codes = [_brute_e2m1(float(np.float32(v) / s)) for v in x[n, grp]]
                got = unpack_e2m1(data[n, grp * 8:(grp + 1) * 8]).tolist()
                assert got == codes, (n, grp)


def _encode_group(group: torch.Tensor) -> tuple[list[int], int]:
    k = torch.zeros(1, 512, dtype=torch.bfloat16)
    k[0, :16] = group
    data, scales = encode_records(k, V41Record.NVFP4)
    return unpack_e2m1(data[0, :8]).tolist(), int(scales[0, 0])


@settings(max_examples=40)
@given(gb=e2m1_tie_groups())
def test_tie_groups_round_half_to_even(gb):
    group, byte = gb
    codes, sb = _encode_group(group)
    assert sb == byte
    s = _e4m3_value(byte)
    for v, c in zip(group.float().tolist(), codes):
        q = abs(v) / s
        if q in E2M1_TIES:
            assert c & 1 == 0 and abs(abs(_e2m1_formula(c)) - q) == min(abs(_e2m1_formula(x) - q) for x in range(8))
        else:
            assert abs(_e2m1_formula(c & 7) - q) == 0.0  # the amax element: exactly 6


@settings(max_examples=30)
@given(gb=e2m1_saturation_groups())
def test_saturation_groups_clip_the_amax_element_to_six(gb):
    group, byte = gb
    codes, sb = _encode_group(group)
    assert sb == byte
    i = int(group.float().abs().argmax())
    assert abs(float(group[i])) / _e4m3_value(byte) > 6 and codes[i] & 7 == 7


@settings(max_examples=30)
@given(gb=subnormal_scale_groups())
def test_subnormal_scales_are_written_and_read_exactly(gb):
    group, byte = gb
    codes, sb = _encode_group(group)
    assert sb == byte
    s = _e4m3_value(byte)
    assert [_brute_e2m1(v / s) for v in group.float().tolist()] == codes


@settings(max_examples=10)
@given(gb=zero_groups())
def test_zero_groups_write_scale_one_and_signed_zero_codes(gb):
    group, byte = gb
    codes, sb = _encode_group(group)
    assert sb == byte == 0x01
    assert codes == [8 if np.signbit(v) else 0 for v in group.float().tolist()]


def test_bad_input_is_named():
    with pytest.raises(InputError, match="'codes'"):
        decode_e2m1(torch.tensor([16], dtype=torch.uint8))
    with pytest.raises(InputError, match="'y'.*finite"):
        encode_e2m1(torch.tensor([float("nan")]))
    with pytest.raises(InputError, match="'rule'"):
        nvfp4_scale_bytes(torch.tensor([1.0]), "half")
    with pytest.raises(InputError, match="even last dimension"):
        pack_e2m1(torch.tensor([1], dtype=torch.uint8))
