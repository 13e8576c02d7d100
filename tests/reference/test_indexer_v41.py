"""DeepSeek-V4.1 indexer K store (``reference.caches.indexer_v41``): hand-derived records."""

from __future__ import annotations

import struct

import pytest
import torch

from dsv4_numerics.reference.caches.indexer_v41 import encode_indexer_records, indexer_row_bytes, insert_indexer_k
from dsv4_numerics.reference.cases import default_cases
from dsv4_numerics.reference.errors import InputError
from dsv4_numerics.reference.pipeline.rope import cos_sin_cache


def test_row_bytes():
    assert indexer_row_bytes("fp8") == 128 + 4 and indexer_row_bytes("mxfp4") == 64 + 4


def test_fp8_record_by_hand():
    # amax 3 -> fl32(3 * fl32(1/448)) ~ 2**-7.22 -> e = -7: codes of y * 2**7; scale fp32 2**-7 = 0x3C000000
    y = torch.zeros(1, 128)
    y[0, 0], y[0, 1], y[0, 5] = 3.0, -1.0, 2.0**-9
    codes, scale = encode_indexer_records(y.to(torch.bfloat16), "fp8")
    # 384 = 1.5 * 2**8 -> 0 1111 100; -128 = -2**7 -> 1 1110 000; 0.25 = 2**-2 -> 0 0101 000 (bias 7)
    assert codes[0, 0] == 0x7C and codes[0, 1] == 0xF0 and codes[0, 5] == 0x28
    assert struct.unpack("<f", bytes(scale[0].tolist()))[0] == 2.0**-7
    # an all-zero key: amax floored at 1e-4 -> e = ceil(log2(1e-4/448)) = -22; codes 0
    codes, scale = encode_indexer_records(torch.zeros(1, 128, dtype=torch.bfloat16), "fp8")
    assert int(codes.max()) == 0 and struct.unpack("<f", bytes(scale[0].tolist()))[0] == 2.0**-22


def test_mxfp4_record_by_hand():
    # group 0: amax 6 -> l = ceil(log2(fl32(6 * fl32(1/6)))) = 0 (6 * fl32(1/6) = 1 + 2**-25.4 rounds to 1):
    # byte 127; 6 -> code 7, -0.75 a tie of 0.5 (code 1) and 1.0 (code 2): the even code, -1.0 = 0xA
    y = torch.zeros(1, 128)
    y[0, 0], y[0, 1] = 6.0, -0.75
    y[0, 32] = 1.0  # group 1: amax 1 -> l = ceil(log2(1/6)) = -2, 1.0 * 4 = 4 -> code 6
    vals, scales = encode_indexer_records(y.to(torch.bfloat16), "mxfp4")
    assert vals[0, 0] == (0x7 | (0xA << 4))  # the even element in the low nibble
    # groups 2, 3 are empty: amax floored at 6 * 2**-126 -> fl32(.. * fl32(1/6)) = 2**-126 -> byte 1
    assert vals[0, 16] == 0x6 and scales[0].tolist() == [127, 125, 1, 1]


def test_store_places_values_then_scales_and_skips():
    case = next(c for c in default_cases("v41_indexer_k_store") if c.name == "fp8-cr2-bs4-realistic")
    i = case.inputs
    out = insert_indexer_k(i["cache"], i["k_pre"], i["positions"], i["cos_sin"], i["weight"], i["eps"], i["slots"],
                           i["compress_ratio"], i["record"])
    nb, bs, rb = out.shape
    pages, before = out.reshape(nb, -1), i["cache"].reshape(nb, -1)
    for t in range(i["slots"].shape[0]):
        s, p = int(i["slots"][t]), int(i["positions"][t])
        b, o = divmod(s, bs) if s >= 0 else (0, 0)
        vals = slice(o * 128, o * 128 + 128)
        written = s >= 0 and (p + 1) % 2 == 0
        if s >= 0:
            assert torch.equal(pages[b, vals], before[b, vals]) != written, t
            sc = bytes(pages[b, bs * 128 + 4 * o: bs * 128 + 4 * o + 4].tolist())
            if written:  # a power of two
                v = struct.unpack("<f", sc)[0]
                assert v > 0 and v == 2.0 ** round(torch.log2(torch.tensor(v)).item())


def test_bad_inputs_name_the_argument():
    case = default_cases("v41_indexer_k_store")[0]
    i = dict(case.inputs)
    args = lambda **kw: {**{k: i[k] for k in ("cache", "k_pre", "positions", "cos_sin", "weight", "eps", "slots",  # noqa: E731
                                             "compress_ratio", "record")}, **kw}
    with pytest.raises(InputError, match="compress_ratio"):
        insert_indexer_k(**args(compress_ratio=4))
    with pytest.raises(InputError, match="cache"):
        insert_indexer_k(**args(cache=i["cache"][..., :100].contiguous()))
    with pytest.raises(InputError, match="slots"):
        insert_indexer_k(**args(slots=torch.full_like(i["slots"], 10**6)))
    with pytest.raises(InputError, match="record"):
        insert_indexer_k(**args(record="nvfp4"))
    with pytest.raises(InputError, match="positions"):
        insert_indexer_k(**args(cos_sin=cos_sin_cache(2)))
