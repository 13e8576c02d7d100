"""FlashInfer (SM100 / SM120) and CuTe-DSL adapters on CPU, against stand-ins that enforce the
real argument contracts and answer in the kernels' own conventions
(tests/kernels/fake_flashinfer.py). These kernels cannot run on the project's H200; these tests
pin the conversions the adapters make: the mixed table, the SWA window carried by ``seq_lens``,
head padding to FlashInfer's set, the SM120 base-2 sink-merged LSE back to natural units, and the
CuTe gather's 32-byte page repack. Expected values: the reference on the canonical inputs."""

from __future__ import annotations

import math

import pytest
import torch

import tests.kernels.fake_flashinfer as FAKE
from dsv4_numerics.kernels.vllm import cutedsl
from dsv4_numerics.kernels.flashinfer import mla as flashinfer
from dsv4_numerics.reference.attention.ordered import Segment, sparse_attention
from dsv4_numerics.reference.caches.model1 import dequantize_all, gather
from dsv4_numerics.reference.cases import default_cases
from dsv4_numerics.reference.cases.attention import decode_case
from dsv4_numerics.reference.errors import UnsupportedCase
from dsv4_numerics.reference.policies import IndexRule, Ue8m0Consumer

_CASES: dict[str, list] = {}


def _by_name(stage, name):
    if stage not in _CASES:
        _CASES[stage] = default_cases(stage)
    return next(c for c in _CASES[stage] if c.name == name)


@pytest.fixture(autouse=True)
def fakes(monkeypatch):
    FAKE.CALLS.clear()
    monkeypatch.setattr(flashinfer, "mla_module", lambda: FAKE.MLA)
    monkeypatch.setattr(cutedsl, "cute_module", lambda name: FAKE.CUTE_GATHER_MODULE)


def _oracle(case, consumer):
    i = case.inputs
    segs = [Segment(dequantize_all(i["swa_cache"], i["swa_block_size"], consumer=consumer), i["swa_indices"],
                    i["swa_lens"], IndexRule.MINUS1_ONLY)]
    if "extra_cache" in i:
        segs.append(Segment(dequantize_all(i["extra_cache"], i["extra_block_size"], consumer=consumer),
                            i["extra_indices"], i["extra_lens"], IndexRule.MINUS1_ONLY))
    return sparse_attention(i["q"], segs, i["scale"], sink=i["sink"])


@pytest.mark.parametrize("call", [flashinfer.trtllm_gen_call, flashinfer.cake_call], ids=["trtllm_gen", "cake"])
def test_trtllm_gen_and_cake_match_the_oracle(call):
    # 24 heads -> FlashInfer pads to 32; C4A top-k 96: compressed columns 128..223 of the table
    case = decode_case("h24-c4a-top96", "c4a", 24, [400, 90, 1000], topk=96, seed=78)
    got = call(case)
    ref = _oracle(case, Ue8m0Consumer.EXACT)
    assert got["out"].shape == (3, 24, 512)
    assert torch.equal(got["out"], ref.out.to(torch.bfloat16))
    c = FAKE.CALLS[-1]
    assert c["h"] == 32
    # one query token per request: seq_len = the SWA length, or position + 1 for a full window
    swa, pos = case.inputs["swa_lens"].tolist(), case.inputs["positions"].tolist()
    assert c["seq_lens"] == [p + 1 if s == 128 else s for s, p in zip(swa, pos)]


def test_trtllm_gen_swa_only_and_the_empty_window_rule():
    case = _by_name("decode", "h128-swa-bs256")  # contains a first token (window of 1)
    got = flashinfer.trtllm_gen_call(case)
    assert torch.equal(got["out"], _oracle(case, Ue8m0Consumer.EXACT).out.to(torch.bfloat16))
    assert FAKE.CALLS[-1]["width"] == 128  # SWA pool doubles as the compressed pool, 128 columns
    lonely = _by_name("decode", "h64-c4a-lonely-and-empty-extra")  # a padding token: swa_len 0
    with pytest.raises(UnsupportedCase, match="empty SWA window"):
        flashinfer.trtllm_gen_call(lonely)


def test_sm120_returns_natural_lse_with_sink():
    case = _by_name("decode", "h64-c4a-lonely-and-empty-extra")
    got = flashinfer.sm120_call(case)
    ref = _oracle(case, Ue8m0Consumer.SM120)
    assert torch.equal(got["out"], ref.out.to(torch.bfloat16))
    # kernel LSE = lse_with_sink * log2(e) in fp32; back to natural units in float64: within
    # 2 fp32 ulps relative (one rounding to fp32, two correctly rounded float64 scalings)
    lws = ref.lse_with_sink
    finite = torch.isfinite(lws)
    rel = ((got["lse_with_sink"][finite] - lws[finite]).abs() / lws[finite].abs()).max().item()
    assert rel <= 2 * 2.0**-24
    assert torch.equal(torch.isinf(got["lse_with_sink"]), torch.isinf(lws))
    # the lonely token (1): LSE = the sink itself (head 1 +inf, head 2 -inf, others finite)
    assert got["lse_with_sink"][1, 1].item() == math.inf and got["lse_with_sink"][1, 2].item() == -math.inf


def test_rope_quant_needs_positions_table_and_128_heads():
    case = _by_name("decode", "h64-swa-bs64-nanpoison")
    with pytest.raises(UnsupportedCase, match="cos_sin_cache"):
        flashinfer.trtllm_gen_rope_quant_call(case)


def test_cute_gather_repacks_odd_strides_and_matches_the_reference():
    case = _by_name("gather", "bs53-s30952-odd-partial")  # page stride 53*584 = 30952, not % 32
    got = cutedsl.gather_call(case)
    i = case.inputs
    ref, valid = gather(i["cache"], i["block_table"], i["seq_lens"], i["block_size"], i["gather_lens"],
                        consumer=Ue8m0Consumer.CUTE)
    assert torch.equal(got["out"][valid], ref[valid])
    assert bool((got["out"][~valid] == 0).all())
    assert FAKE.CALLS[-1]["stride"] == 30976  # round_up(30952, 32)
