"""The policies vLLM's CPU writer needed (``Fp8Subnormals.FLUSH``, ``NonFinite.VLLM_CPU``): their
definitions checked exhaustively against the OCP encoder, no CPU library needed."""

from __future__ import annotations

import torch

from dsv4_numerics.oracles import bytes_diff as bd
from dsv4_numerics.reference.formats import quant
from dsv4_numerics.reference.formats.fp8 import decode_e4m3fn
from dsv4_numerics.reference.policies import Fp8Subnormals, NonFinite

MIN_NORMAL = 2.0**-6


def _all_bf16_tiles() -> torch.Tensor:
    """Every finite bf16 value below 2**1, in 64-wide tiles each led by 448 (so the tile exponent
    is 0 and the scaled value is the value itself)."""
    v = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    v = v[torch.isfinite(v) & (v.abs() < 2.0)]
    pad = (-v.numel()) % 63
    v = torch.cat((v, torch.zeros(pad, dtype=torch.bfloat16))).reshape(-1, 63)
    return torch.cat((torch.full((v.shape[0], 1), 448.0, dtype=torch.bfloat16), v), dim=1)


def test_flush_is_keep_except_below_min_normal_where_it_is_signed_zero():
    x = _all_bf16_tiles()
    keep, sk = quant.quantize_tiles(x, "scale_clamp")
    flush, sf = quant.quantize_tiles(x, "scale_clamp", subnormals=Fp8Subnormals.FLUSH)
    assert torch.equal(sk, sf) and bool((sk == 127).all())
    tiny = x.to(torch.float64).abs() < MIN_NORMAL
    assert torch.equal(flush[~tiny], keep[~tiny])
    assert torch.equal(flush[tiny], (keep[tiny] & 0x80) | 0)  # signed zero, sign of the input
    sign = torch.signbit(x.to(torch.float32))[tiny]
    assert torch.equal(flush[tiny] == 0x80, sign)
    # the values RNE rounds up to the smallest normal (0x08) are flushed too
    up = tiny & ((keep & 0x7F) == 0x08)
    assert bool(up.any()) and bool(((flush[up] & 0x7F) == 0).all())
    assert float(decode_e4m3fn(torch.tensor([0x08], dtype=torch.uint8))) == MIN_NORMAL


def test_vllm_cpu_nan_position_decides_the_tile():
    x = torch.ones(64, 64, dtype=torch.bfloat16)
    x[torch.arange(64), torch.arange(64)] = float("nan")  # tile i: one NaN at element i
    codes, sbytes = quant.quantize_tiles(x, "scale_clamp", nonfinite=NonFinite.VLLM_CPU)
    poisoned = (sbytes.flatten() == 127).nonzero().flatten().tolist()
    assert poisoned == [quant.VLLM_CPU_NAN_LANE]
    assert bool((codes[quant.VLLM_CPU_NAN_LANE] == 0x7E).all())
    others = [i for i in range(64) if i != quant.VLLM_CPU_NAN_LANE]
    e = quant.tile_exponent(torch.tensor([1.0]), "scale_clamp").item() + 127
    assert bool((sbytes.flatten()[others] == e).all())


def test_vllm_cpu_nan_in_a_second_operand_drops_its_partner():
    """maxps(a, NaN) = NaN at the first level (offset 16), then maxps(NaN, b) = b at offset 32:
    element 3's large value is lost with the NaN at 19 -- the scale follows the smaller rest."""
    x = torch.ones(1, 64, dtype=torch.bfloat16)
    x[0, 3], x[0, 19] = 448.0 * 2**4, float("nan")
    _, s = quant.quantize_tiles(x, "scale_clamp", nonfinite=NonFinite.VLLM_CPU)
    assert int(s[0, 0]) == int(quant.tile_exponent(torch.tensor([1.0]), "scale_clamp")) + 127
    _, t = quant.quantize_tiles(x, "scale_clamp", nonfinite=NonFinite.TRITON)
    assert int(t[0, 0]) == 127 + 4  # the NaN-ignoring max keeps 448 * 2**4


def test_vllm_cpu_inf_tile_scale_byte_127():
    x = torch.ones(1, 64, dtype=torch.bfloat16)
    x[0, 5] = float("-inf")
    codes, s = quant.quantize_tiles(x, "scale_clamp", nonfinite=NonFinite.VLLM_CPU)
    _, t = quant.quantize_tiles(x, "scale_clamp", nonfinite=NonFinite.TRITON)
    assert int(s[0, 0]) == 127 and int(t[0, 0]) == 255
    assert int(codes[0, 5]) == 0x7E and bool((codes[0, torch.arange(64) != 5] == 0).all())


def test_bytes_diff_names_the_flush_policy():
    x = torch.full((1, 64), 0.01, dtype=torch.bfloat16)
    x[0, 0] = 448.0
    codes, s = quant.quantize_tiles(x, "amax_clamp", subnormals="flush")
    why = bd.explain_tile(x[0], codes[0], int(s[0, 0]), {"scale_rule": "amax_clamp"})
    assert "fp8_subnormals=flush" in why and "reference used fp8_subnormals=keep" in why


def test_exp0_as_normal_decode_table():
    import pytest

    from dsv4_numerics.reference.errors import InputError
    from dsv4_numerics.reference.formats.fp8 import decode_fp8

    codes = torch.arange(256, dtype=torch.int64).to(torch.uint8)
    for flavour, bias in (("e4m3fn", 7), ("e4m3fnuz", 8)):
        exact, odd = decode_fp8(codes, flavour), decode_fp8(codes, flavour, read="exp0_as_normal")
        exp0 = (codes & 0x78) == 0
        if flavour == "e4m3fnuz":
            exp0 &= codes != 0x80  # FNUZ's NaN stays NaN
        same = torch.equal(torch.nan_to_num(exact[~exp0], nan=7.0), torch.nan_to_num(odd[~exp0], nan=7.0))
        assert same
        m = (codes[exp0] & 7).to(torch.float32)
        sign = torch.where((codes[exp0] & 0x80) != 0, -1.0, 1.0)
        assert torch.equal(odd[exp0], sign * (1 + m / 8) * 2.0**-bias)
    assert float(decode_fp8(torch.tensor([0], dtype=torch.uint8), read="exp0_as_normal")) == 2.0**-7
    with pytest.raises(InputError, match="read"):
        decode_fp8(codes, read="bogus")


def test_missing_lengths_count_as_prefix_drops_valid_indices_past_the_count():
    """ROCm Triton prefill's wrapper reads an absent topk_length as the count of non-negative
    indices, used as a prefix (MissingLengths.COUNT_AS_PREFIX): in the row [0, -1, 2] the count 2
    keeps columns 0..1, so row 2 is dropped; the canonical reading keeps it."""
    from dsv4_numerics.oracles import stages as st
    from dsv4_numerics.reference.cases import Case

    g = torch.Generator().manual_seed(3)
    kv = torch.randn(3, 512, generator=g).to(torch.bfloat16)
    q = torch.randn(1, 4, 512, generator=g).to(torch.bfloat16)
    case = Case("holes", "prefill", {"q": q, "kv": kv, "indices": torch.tensor([[0, -1, 2]], dtype=torch.int32),
                                      "scale": 0.05, "sink": None}, {})
    spec = st.get("prefill")
    canonical = spec.expected(case, spec.policies({}))["out"]
    counted = spec.expected(case, spec.policies({"missing_lengths": "count_as_prefix"}))["out"]
    only_first = spec.expected(Case("first", "prefill", dict(case.inputs, indices=torch.tensor([[0, -1, -1]], dtype=torch.int32)),
                                    {}), spec.policies({}))["out"]
    assert torch.equal(counted, only_first) and not torch.equal(counted, canonical)
    # a given length is read as given under either policy
    with_len = dict(case.inputs, topk_length=torch.tensor([3], dtype=torch.int32))
    c2 = Case("len", "prefill", with_len, {})
    assert torch.equal(spec.expected(c2, spec.policies({"missing_lengths": "count_as_prefix"}))["out"],
                       spec.expected(c2, spec.policies({}))["out"])
