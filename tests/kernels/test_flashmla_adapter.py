"""The FlashMLA adapters' plumbing on CPU, against a stand-in interface that enforces the real
argument checks and answers in FlashMLA's own conventions (tests/kernels/fake_flashmla.py).

The expected values come from the reference oracle run directly on the *canonical* inputs
(unpadded heads and tables, canonical ``-inf`` LSE), so these tests pin: head padding and
slicing, -1 padding of the index tables, per-token lengths (b = T, s_q = 1), the transposed LSE
view, the ``+inf`` -> ``-inf`` lonely-row conversion, and the UnsupportedCase guards."""

from __future__ import annotations

import math

import pytest
import torch

import tests.kernels.fake_flashmla as FAKE
from dsv4_numerics.kernels.flashmla import sparse as flashmla
from dsv4_numerics.reference.attention.ordered import Segment, sparse_attention
from dsv4_numerics.reference.caches.model1 import dequantize_all
from dsv4_numerics.reference.cases import default_cases
from dsv4_numerics.reference.cases.attention import decode_case
from dsv4_numerics.reference.errors import UnsupportedCase
from dsv4_numerics.reference.policies import IndexRule, Ue8m0Consumer


@pytest.fixture(autouse=True)
def fake_interface(monkeypatch):
    FAKE.CALLS.clear()
    monkeypatch.setattr(flashmla, "flashmla_interface", lambda: FAKE)


def _oracle_decode(case):
    i = case.inputs
    segs = [Segment(dequantize_all(i["swa_cache"], i["swa_block_size"], consumer=Ue8m0Consumer.FLASHMLA),
                    i["swa_indices"], i["swa_lens"], IndexRule.MINUS1_ONLY)]
    if "extra_cache" in i:
        segs.append(Segment(dequantize_all(i["extra_cache"], i["extra_block_size"], consumer=Ue8m0Consumer.FLASHMLA),
                            i["extra_indices"], i["extra_lens"], IndexRule.MINUS1_ONLY))
    return sparse_attention(i["q"], segs, i["scale"], sink=i["sink"])


_CASES: dict[str, list] = {}


def _by_name(stage, name):
    if stage not in _CASES:  # building the attention cases takes seconds: once per stage
        _CASES[stage] = default_cases(stage)
    return next(c for c in _CASES[stage] if c.name == name)


@pytest.mark.parametrize("name", ["h64-c4a-lonely-and-empty-extra", "h64-c128a-bs2"])
def test_decode_matches_the_oracle_on_canonical_inputs(name):
    case = _by_name("decode", name)
    got = flashmla.sparse_decode_call(case)
    ref = _oracle_decode(case)
    assert torch.equal(got["out"], ref.out.to(torch.bfloat16))
    assert torch.equal(got["lse"], ref.lse.float())  # -inf for the lonely (padding) token
    if "lonely" in name:
        assert bool((got["lse"][1] == -math.inf).all())
    call = FAKE.CALLS[-1]
    assert call["h_q"] == 64 and call["topk"] == 128  # SWA width 128 is already a multiple of 64


def test_decode_pads_heads_and_extra_topk():
    # 16 heads -> padded to 64 with zero q / -inf sink; C4A top-k 96 -> padded to 128 with -1
    case = decode_case("h16-c4a-top96", "c4a", 16, [400, 90], topk=96, seed=77)
    got = flashmla.sparse_decode_call(case)
    ref = _oracle_decode(case)
    assert got["out"].shape == (2, 16, 512)
    assert torch.equal(got["out"], ref.out.to(torch.bfloat16))
    assert torch.equal(got["lse"], ref.lse.float())
    assert FAKE.CALLS[-1] == {"fn": "decode", "h_q": 64, "topk": 128, "extra_topk": 128}


def test_decode_refuses_indices_flashmla_would_use_as_addresses():
    case = _by_name("decode", "h64-swa-bs64-nanpoison")
    i = dict(case.inputs)
    idx = i["swa_indices"].clone()
    idx[0, 0] = -2  # inside token 0's prefix (swa_lens[0] = 5 > 0)
    i["swa_indices"] = idx
    bad = type(case)(case.name, case.stage, i, case.params)
    with pytest.raises(UnsupportedCase, match="only -1 as an invalid index"):
        flashmla.sparse_decode_call(bad)
    assert FAKE.CALLS == []  # nothing was launched


def test_prefill_matches_the_oracle_including_out_of_range_values():
    case = _by_name("prefill", "h64-c128a-oob-mix")
    got = flashmla.sparse_prefill_call(case)
    i = case.inputs
    ref = sparse_attention(i["q"], [Segment(i["kv"], i["indices"], i["topk_length"],
                                            IndexRule.ANY_OUT_OF_RANGE_INVALID)], i["scale"], sink=i["sink"])
    assert torch.equal(got["out"], ref.out.to(torch.bfloat16))
    assert torch.equal(got["lse"], ref.lse.float())
    assert torch.equal(got["max_logits"], ref.max_logits.float())
    assert FAKE.CALLS[-1]["topk"] % 128 == 0


def test_prefill_refuses_the_documented_nan_leak():
    case = _by_name("prefill", "h128-swa-only")
    i = dict(case.inputs)
    kv = i["kv"].clone()
    idx = i["indices"].clone()
    ln = i["topk_length"]
    t = int(torch.nonzero(ln < idx.shape[1])[0])  # a token with a column after its length
    col = int(ln[t])
    idx[t, col] = 0  # a *valid* index after topk_length ...
    kv[0, 3] = float("nan")  # ... pointing at a row with NaN
    i.update(kv=kv, indices=idx)
    bad = type(case)(case.name, case.stage, i, case.params)
    with pytest.raises(UnsupportedCase, match="NaN"):
        flashmla.sparse_prefill_call(bad)


@pytest.mark.parametrize("name", ["h64-c4a-stale-past-len", "sweep-odd-pages-53-69", "sweep-empty-main"])
def test_decode_sq3_groups_tokens_and_matches_the_oracle(name, monkeypatch):
    # s_q = 3 tokens per batch row: T = 5 -> b = 2 (one lonely padding token); per-token lengths
    # become -1 past each token's length (stale valid ids there must not be attended) and the
    # row's largest length; lengths absent stay absent
    case = _by_name("decode", name)
    seen = []
    real = FAKE.flash_mla_with_kvcache

    def spy(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata, *args, **kw):
        seen.append((tuple(q.shape), kw["indices"].shape, kw.get("topk_length"), kw.get("extra_topk_length")))
        return real(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata, *args, **kw)

    monkeypatch.setattr(FAKE, "flash_mla_with_kvcache", spy)
    got = flashmla.sparse_decode_sq_call(case)
    i = case.inputs
    segs = [Segment(dequantize_all(i["swa_cache"], i["swa_block_size"], consumer=Ue8m0Consumer.FLASHMLA),
                    i["swa_indices"], i.get("swa_lens"), IndexRule.MINUS1_ONLY),
            Segment(dequantize_all(i["extra_cache"], i["extra_block_size"], consumer=Ue8m0Consumer.FLASHMLA),
                    i["extra_indices"], i.get("extra_lens"), IndexRule.MINUS1_ONLY)]
    ref = sparse_attention(i["q"], segs, i["scale"], sink=i.get("sink"))
    assert torch.equal(got["out"], ref.out.to(torch.bfloat16))
    assert torch.equal(got["lse"], ref.lse.float())
    t = i["q"].shape[0]
    (qs, ishape, ln, eln), = seen
    assert qs[:2] == (-(-t // 3), 3) and tuple(ishape[:2]) == qs[:2]
    for lens, key in ((ln, "swa_lens"), (eln, "extra_lens")):
        if key in i:
            want = torch.cat([i[key], torch.zeros(qs[0] * 3 - t, dtype=i[key].dtype)]).reshape(-1, 3).amax(1)
            assert torch.equal(lens.long(), want.long())
        else:
            assert lens is None
