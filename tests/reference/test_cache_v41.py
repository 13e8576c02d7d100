"""The V4.1 528-byte MXFP8 and 288-byte NVFP4 paged records in both byte orders (reference/caches/v41.py).

MXFP8 bytes are checked against an independent model (numpy fp32 for the scale ratio, exact
``ceil(log2)`` from ``math.frexp``, torch's float8_e4m3fn cast for the codes); addresses against
the layouts' definitions written out by hand.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4_numerics.strategies.v41 import (
    e2m1_saturation_groups,
    e2m1_tie_groups,
    subnormal_scale_groups,
    v41_geometries,
    v41_mixed_caches,
    zero_groups,
)
from dsv4_numerics.reference.caches import v41 as c
from dsv4_numerics.reference.errors import InputError
from dsv4_numerics.reference.formats.fp8 import decode_e4m3fn
from dsv4_numerics.reference.policies import NonFinite, Nvfp4NonFinite, ScaleRule, V41Layout, V41Record

MX, NV = V41Record.MXFP8, V41Record.NVFP4
IL, PF = V41Layout.INTERLEAVED, V41Layout.PAGE_FOOTER


def _ceil_log2(r: float) -> int:
    f, e = math.frexp(r)  # r = f * 2**e, f in [0.5, 1)
    return e - 1 if f == 0.5 else e


def _np_exponent(amax: float, rule: ScaleRule) -> int:
    a, floor = np.float32(amax), np.float32(1e-4)
    if rule is ScaleRule.AMAX_CLAMP:  # vLLM: max(amax, 1e-4) * fl32(1/448) (== the division, H16)
        r = max(a, floor) * np.float32(1 / 448)
    else:  # FlashInfer: max(fl32(max(amax, 1e-4) / 448), 1e-4)
        r = max(max(a, floor) / np.float32(448), floor)
    return _ceil_log2(float(r))


def _rows(n: int, seed: int, top: int = 4) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    mags = torch.logspace(-9, top, n).unsqueeze(1)  # tiny rows reach the 1e-4 floor and subnormal codes
    return (torch.randn(n, 512, generator=g) * mags).to(torch.bfloat16)


@pytest.mark.parametrize("rule", [ScaleRule.AMAX_CLAMP, ScaleRule.SCALE_CLAMP])
def test_mxfp8_bytes_match_an_independent_model(rule):
    k = _rows(8, 1)
    k[0, 32:64] = 0  # an all-zero group
    data, scales = c.encode_records(k, MX, mxfp8_rule=rule)
    x = k.float().reshape(8, 16, 32)
    for n in range(8):
        for g in range(16):
            e = _np_exponent(float(x[n, g].abs().max()), rule)
            assert int(scales[n, g]) == e + 127, (n, g)
            want = (x[n, g].double() * 2.0**-e).float().to(torch.float8_e4m3fn).view(torch.uint8)
            assert torch.equal(data[n, g * 32:(g + 1) * 32], want), (n, g)


def test_zero_groups_write_the_floor_exponent_of_each_producer():
    k = torch.zeros(1, 512, dtype=torch.bfloat16)
    k[0, 1] = -0.0
    for rule, byte in ((ScaleRule.AMAX_CLAMP, 127 + _ceil_log2(float(np.float32(1e-4) * np.float32(1 / 448)))),
                       (ScaleRule.SCALE_CLAMP, 127 + _ceil_log2(float(np.float32(1e-4))))):
        data, scales = c.encode_records(k, MX, mxfp8_rule=rule)
        assert scales.unique().tolist() == [byte]
        assert data[0, 1] == 0x80 and int(data.sum()) == 0x80
    assert (105, 114) == (127 - 22, 127 - 13)  # the two floors: 2**-22 (vLLM), 2**-13 (FlashInfer)


def test_mxfp8_round_trip_error_is_within_the_e4m3_bound():
    # |x| * 2**-e <= 448; RNE error <= 2**-4 relative above 2**-6, <= 2**-10 * 2**e absolute below;
    # the bf16 result adds <= 2**-9 relative. Bound: 2**-4 |x| + 2**-10 * 2**e + 2**-9 |out|.
    k = _rows(16, 2)
    data, scales = c.encode_records(k, MX)
    out = c.decode_records(data, scales, MX).double()
    x = k.double()
    scale = (2.0 ** (scales.double() - 127)).repeat_interleave(32, dim=1)
    bound = 2.0**-4 * x.abs() + 2.0**-10 * scale + 2.0**-9 * out.abs()
    assert bool(((out - x).abs() <= bound).all())


def test_nvfp4_round_trip_error_is_within_the_e2m1_bound():
    # Scale s = e4m3(amax / 6): s >= amax/6 * (1 - 2**-4) for a normal scale, s >= amax/6 - 2**-10
    # for a subnormal one. Unsaturated values: error <= half the E2M1 step, <= 1 * s (step 2 in
    # [4, 6]). Saturated ones (|x| > 6 s): error <= amax - 6 s <= 6 s * 2**-4 / (1 - 2**-4) (< s)
    # or 6 * 2**-10. The bf16 result adds 2**-9 |out|. Bound: s + 6 * 2**-10 + 2**-9 |out|, while
    # amax <= 6 * 448 (larger groups clamp the scale at 448): rows of sigma <= 100.
    k = _rows(16, 3, top=2)
    data, scales = c.encode_records(k, NV)
    out = c.decode_records(data, scales, NV).double()
    s = decode_e4m3fn(scales).double().repeat_interleave(16, dim=1)
    assert bool(((out - k.double()).abs() <= s + 6 * 2.0**-10 + 2.0**-9 * out.abs()).all())


def _addresses_by_hand(slot, bs, p, record, layout):
    d, sc = (512, 16) if record is MX else (256, 32)
    page, e = divmod(slot, bs)
    if layout is IL:
        return page * p + e * (d + sc), page * p + e * (d + sc) + d
    return page * p + e * d, page * p + bs * d + e * sc


@settings(max_examples=25, deadline=None)
@given(geom=v41_geometries())
def test_insert_writes_exactly_the_predicted_bytes(geom):
    nb, bs, p, record, layout = geom
    record, layout = V41Record(record), V41Layout(layout)  # the strategy's enums come via dsv4_numerics.reference
    n = min(3, nb * bs)
    slots = torch.randperm(nb * bs, generator=torch.Generator().manual_seed(nb * 97 + bs))[:n]
    k = _rows(n, 4)
    cache = c.empty_cache(nb, bs, record, page_stride=p, fill=0xA5)
    out = c.insert(cache, k, slots, bs, record, layout)
    assert torch.equal(cache, torch.full_like(cache, 0xA5))  # the input is not modified
    data, scales = c.encode_records(k, record)
    flat = out.flatten()
    written = torch.zeros_like(flat, dtype=torch.bool)
    for t, s in enumerate(slots.tolist()):
        da, sa = _addresses_by_hand(s, bs, p, record, layout)
        assert torch.equal(flat[da:da + data.shape[1]], data[t])
        assert torch.equal(flat[sa:sa + scales.shape[1]], scales[t])
        written[da:da + data.shape[1]] = True
        written[sa:sa + scales.shape[1]] = True
    assert bool((flat[~written] == 0xA5).all())
    assert torch.equal(c.defined_byte_mask(out, slots, bs, record, layout).flatten(), written)
    assert torch.equal(c.read_records(out, slots, bs, record, layout)[1], scales)


@pytest.mark.parametrize("record", list(V41Record))
def test_a_reader_in_the_other_byte_order_misreads(record):
    k = _rows(4, 5)
    slots = torch.tensor([0, 1, 2, 3])
    for w, r in ((IL, PF), (PF, IL)):
        cache = c.insert(c.empty_cache(1, 4, record), k, slots, 4, record, w)
        right = c.dequantize_slots(cache, slots, 4, record, w)
        wrong = c.dequantize_slots(cache, slots, 4, record, r)
        assert torch.equal(right, c.decode_records(*c.encode_records(k, record), record))
        assert not torch.equal(right, wrong)
        # slot 0's data bytes sit at the page start in both orders; its scale bytes do not
        (d_w, s_w), (d_r, s_r) = (c.read_records(cache, slots[:1], 4, record, x) for x in (w, r))
        assert torch.equal(d_w, d_r) and not torch.equal(s_w, s_r)
    # with one entry per page the two byte orders coincide
    one = c.insert(c.empty_cache(4, 1, record), k, slots, 1, record, IL)
    assert torch.equal(c.dequantize_all(one, 1, record, PF), c.dequantize_all(one, 1, record, IL))


def test_kernel_view_is_accepted_and_reads_the_same():
    cache = c.insert(c.empty_cache(2, 4, MX), _rows(2, 6), torch.tensor([1, 6]), 4, MX, IL)
    view = cache.view(2, 4, 528)
    assert torch.equal(c.dequantize_all(view, 4, MX, IL), c.dequantize_all(cache, 4, MX, IL))


def test_nonfinite_policies_of_each_producer():
    k = torch.ones(1, 512, dtype=torch.bfloat16)
    k[0, 0] = float("nan")  # group 0 (MXFP8) / group 0 (NVFP4)
    k[0, 40] = float("inf")  # MXFP8 group 1, NVFP4 group 2
    # FlashInfer MXFP8 (torch trajectory): NaN group -> 0xFF + 0x7F codes; Inf group -> 0xFF,
    # 0x7F for the Inf, +0 elsewhere (FI cake_dsv41_fp8_cache_ops.cu:147-158)
    data, scales = c.encode_records(k, MX, ScaleRule.SCALE_CLAMP, NonFinite.TORCH)
    assert scales[0, :2].tolist() == [255, 255] and scales[0, 2] == 127 - 8
    assert bool((data[0, :32] == 0x7F).all())
    assert data[0, 40] == 0x7F and int(data[0, 32:64].sum()) == 0x7F
    # FlashInfer NVFP4: poisoned groups -> scale 0x7F, zero codes; they read back NaN
    data, scales = c.encode_records(k, NV, nonfinite=Nvfp4NonFinite.POISON, nvfp4_rule="div_rn")
    assert scales[0, 0] == 0x7F and scales[0, 2] == 0x7F and int(data[0, :8].sum()) == 0
    out = c.decode_records(data, scales, NV)
    assert bool(out[0, :16].isnan().all()) and bool(out[0, 32:48].isnan().all())
    assert not bool(out[0, 16:32].isnan().any())
    # vLLM MXFP8 (Triton): NaN ignored by the max, NaN -> 0x7E; Inf group -> 255, Inf -> 0x7E
    data, scales = c.encode_records(k, MX, ScaleRule.AMAX_CLAMP, NonFinite.TRITON)
    assert scales[0, 1] == 255 and data[0, 40] == 0x7E and data[0, 0] == 0x7E


def test_bad_input_is_named():
    cache = c.empty_cache(1, 4, MX)
    k = _rows(2, 8)
    with pytest.raises(InputError, match="'record'"):
        c.encode_records(k, "fp6")
    with pytest.raises(InputError, match="'layout'"):
        c.insert(cache, k, torch.tensor([0, 1]), 4, MX, "footer")
    with pytest.raises(InputError, match="'k'.*512"):
        c.encode_records(k[:, :448], MX)
    with pytest.raises(InputError, match="'slot_mapping'.*twice"):
        c.insert(cache, k, torch.tensor([1, 1]), 4, MX, IL)
    with pytest.raises(InputError, match="'slot_mapping'.*out of range"):
        c.insert(cache, k, torch.tensor([0, 4]), 4, MX, IL)
    with pytest.raises(InputError, match="'cache'"):
        c.insert(c.empty_cache(1, 4, NV), k, torch.tensor([0]), 4, MX, IL)  # 288-byte pages for 528 records
    with pytest.raises(InputError, match="'slot_mapping'.*MINUS1_ONLY"):
        c.insert(cache, k, torch.tensor([0, -2]), 4, MX, IL, slot_skip="minus1_only")
    assert torch.equal(c.insert(cache, k, torch.tensor([0, -2]), 4, MX, IL),
                       c.insert(cache, k[:1], torch.tensor([0]), 4, MX, IL))  # ALL_NEGATIVE skips -2
    with pytest.raises(InputError, match="'nonfinite'"):
        c.encode_records(k, NV, nonfinite=NonFinite.TORCH)  # an MXFP8-only trajectory
    bad = k.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(InputError, match="'k'.*finite"):
        c.encode_records(bad, NV)


@settings(max_examples=10, deadline=None)
@given(mixed=v41_mixed_caches())
def test_mixed_mxfp8_main_and_nvfp4_extra_caches_round_trip_in_one_byte_order(mixed):
    layout = V41Layout(mixed["layout"])
    for record, key in ((MX, "main"), (NV, "extra")):
        nb, bs, p = mixed[key]
        n = min(4, nb * bs)
        k = _rows(n, 9, top=2)
        slots = torch.arange(nb * bs - n, nb * bs)  # the last slots: the far end of the last page
        cache = c.insert(c.empty_cache(nb, bs, record, page_stride=p), k, slots, bs, record, layout)
        assert torch.equal(c.dequantize_slots(cache, slots, bs, record, layout),
                           c.decode_records(*c.encode_records(k, record), record))
        assert int(c.defined_byte_mask(cache, slots, bs, record, layout).sum()) == n * c.record_bytes(record)


def test_vllm_reciprocal_multiply_equals_the_amax_clamp_division():
    # vLLM's V4.1 MXFP8 writers form fl32(max(amax, 1e-4) * fl32(1/448)); the reference models them
    # with ScaleRule.AMAX_CLAMP (the division). Every non-negative finite bf16 amax, and 20000
    # random fp32 amax near powers of two times 448 (where a one-ulp difference would show).
    from dsv4_numerics.reference.formats.quant import tile_exponent

    bf = torch.arange(0, 0x7F80, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    g = torch.Generator().manual_seed(11)
    near = (448 * 2.0 ** torch.randint(-30, 30, (20000,), generator=g).double()
            * (1 + (torch.rand(20000, generator=g, dtype=torch.float64) - 0.5) * 2**-20)).float()
    for amax in (bf, near):
        a = amax.numpy()
        r = np.maximum(a, np.float32(1e-4)) * np.float32(1 / 448)  # numpy float32: correctly rounded
        want = torch.tensor([_ceil_log2(float(v)) for v in r], dtype=torch.int32)
        assert torch.equal(tile_exponent(amax, ScaleRule.AMAX_CLAMP), want)


def test_vllm_nvfp4_nonfinite_rule_by_hand():
    """Nvfp4NonFinite.TRITON, every byte derived by hand (E4M3 0.5 = 0x30, 448 = 0x7E; E2M1 codes
    2 = 1.0, 4 = 2.0, 7 = 6.0, sign bit 0x8)."""
    k = torch.zeros(1, 512, dtype=torch.bfloat16)
    k[0, 0:3] = torch.tensor([float("nan"), 3.0, 1.0])  # group 0: NaN ignored, amax 3 -> scale 0.5
    k[0, 16:19] = torch.tensor([float("inf"), 448.0, float("-inf")])  # group 1: amax Inf -> scale 448
    data, scales = c.encode_records(k, NV, nonfinite=Nvfp4NonFinite.TRITON, nvfp4_rule="recip_mul")
    assert scales[0, 0] == 0x30 and scales[0, 1] == 0x7E and scales[0, 2] == 0x01  # zero group: 2**-9
    # group 0: NaN -> +6 (0x7), 3/0.5 = 6 -> 0x7 | 1/0.5 = 2 -> 0x4; then zeros
    assert data[0, 0] == 0x7 | 0x7 << 4 and data[0, 1] == 0x4
    # group 1: +Inf -> 6 (0x7), 448/448 = 1 -> 0x2 | -Inf -> -6 (0xF)
    assert data[0, 8] == 0x7 | 0x2 << 4 and data[0, 9] == 0xF
    # the finite policies refuse the same row; an all-NaN group is out of contract for TRITON too
    with pytest.raises(InputError, match="'k'"):
        c.encode_records(k, NV, nonfinite=Nvfp4NonFinite.FINITE)
    k[0, 32:48] = float("nan")
    with pytest.raises(InputError, match="all-NaN"):
        c.encode_records(k, NV, nonfinite=Nvfp4NonFinite.TRITON)
    assert c.PRODUCERS["vllm_0.33.0"].nvfp4_nonfinite is Nvfp4NonFinite.TRITON


@pytest.mark.parametrize("record,layout", [(MX, IL), (NV, PF)])
def test_gather_reads_positions_through_the_block_table(record, layout):
    """Rows ``offset + i`` read position ``L - g + i``: with bs 2, table [[1, 0]], L 3, g 2,
    offset 1, rows 1 and 2 read slots 1*2 + 1 = 3 and 0*2 + 0 = 0; row 0 stays unwritten."""
    g = torch.Generator().manual_seed(7)
    cache = torch.randint(0, 256, (2, 2 * c.record_bytes(record)), generator=g, dtype=torch.uint8)
    k = (torch.randn(4, 512, generator=g)).to(torch.bfloat16)
    cache = c.insert(cache, k, torch.tensor([0, 1, 2, 3]), 2, record, layout)
    out, valid = c.gather(cache, torch.tensor([[1, 0]], dtype=torch.int32), torch.tensor([3]), 2, record, layout,
                          gather_lens=torch.tensor([2]), offset=1)
    assert out.shape == (1, 3, 512) and valid.tolist() == [[False, True, True]]
    want = c.dequantize_slots(cache, torch.tensor([3, 0]), 2, record, layout)
    assert torch.equal(out[0, 1:].view(torch.int16), want.view(torch.int16))
    assert not bool(out[0, 0].any())
    with pytest.raises(InputError, match="'block_table'"):
        c.gather(cache, torch.tensor([[5, 0]]), torch.tensor([3]), 2, record, layout)
    with pytest.raises(InputError, match="'gather_lens'"):
        c.gather(cache, torch.tensor([[1, 0]]), torch.tensor([3]), 2, record, layout, gather_lens=torch.tensor([4]))


_NVFP4_GROUPS = st.one_of(e2m1_tie_groups(), e2m1_saturation_groups(), subnormal_scale_groups(), zero_groups())


@settings(max_examples=15, deadline=None)
@given(groups=st.lists(_NVFP4_GROUPS, min_size=32, max_size=32), geom=v41_geometries(block_sizes=(1, 2, 3, 16)),
       data=st.data())
def test_gather_of_drawn_nvfp4_groups_reads_back_their_scales(groups, geom, data):
    """E2M1 ties, saturation, subnormal E4M3 scales and zero groups, written by the vLLM producer
    at a drawn slot of a drawn geometry and gathered back as the last row of one request: every
    group's scale byte is the one the strategy constructed it for, and the gathered row is
    ``code * scale`` of the written record (both byte orders)."""
    nb, bs, page, record, layout = geom
    k = torch.cat([g for g, _ in groups]).reshape(1, 512)
    slot = data.draw(st.integers(0, nb * bs - 1))
    cache = c.insert(c.empty_cache(nb, bs, record, page_stride=page, fill=0xA5), k, torch.tensor([slot]), bs, record,
                     layout, nonfinite="triton")
    table = torch.arange(nb, dtype=torch.int32).reshape(1, nb)
    out, valid = c.gather(cache, table, torch.tensor([slot + 1]), bs, record, layout, gather_lens=torch.tensor([1]),
                          consumer="triton")
    assert valid.tolist() == [[True]]
    data_b, scales = c.read_records(cache, torch.tensor([slot]), bs, record, layout)
    assert torch.equal(out[0].view(torch.int16), c.decode_records(data_b, scales, record, "triton").view(torch.int16))
    if record is NV:
        assert scales[0].tolist() == [b for _, b in groups]
