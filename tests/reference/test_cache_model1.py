"""584-byte MODEL1 paged cache (datapath 1.1-1.3, 4.5; H5, H12): byte addresses by hand, a mixed
page written byte for byte, insert/gather properties over strides and permutations, input errors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dsv4_numerics.reference.caches.model1 import (
    dequantize_all,
    dequantize_slots,
    defined_byte_mask,
    empty_cache,
    encode_records,
    gather,
    insert,
    kernel_view,
    page_bytes,
    read_records,
    slot_addresses,
)
from dsv4_numerics.reference.errors import InputError
from dsv4_numerics.reference.policies import Fp8Flavour, NonFinite, ScaleRule, SlotSkip
from dsv4_numerics.reference.formats.quant import dequantize_tiles, quantize_tiles
from dsv4_numerics.strategies.cache import bf16_rows, cache_geometries, slot_mappings

QA, QS = ScaleRule.AMAX_CLAMP, ScaleRule.SCALE_CLAMP


def test_empty_cache_production_strides():
    # round_up(64*584 = 37376, 576) = 65*576 = 37440; round_up(2*584 = 1168, 576) = 3*576 = 1728
    assert empty_cache(2, 64).shape == (2, 37440)
    assert empty_cache(3, 2).shape == (3, 1728)
    assert empty_cache(1, 16, page_stride=16 * 584, fill=7).eq(7).all()


def test_slot_addresses_by_hand():
    # bs=64, P=37440: slot 65 -> page 1, entry 1: data 37440 + 576 = 38016;
    # scales 37440 + 64*576 (36864) + 8 = 74312. slot 0 -> 0 and 36864. slot 127 -> page 1, entry 63:
    # data 37440 + 63*576 = 73728; scale 37440 + 36864 + 504 = 74808.
    d, s = slot_addresses(torch.tensor([65, 0, 127]), 64, 37440)
    assert d.tolist() == [38016, 0, 73728] and s.tolist() == [74312, 36864, 74808]
    # bs=2, P=1728: slot 3 -> page 1, entry 1: data 1728 + 576 = 2304; scale 1728 + 1152 + 8 = 2888
    d, s = slot_addresses(torch.tensor([3]), 2, 1728)
    assert d.tolist() == [2304] and s.tolist() == [2888]


def _mixed_page_rows() -> torch.Tensor:
    k = torch.zeros(2, 512)
    k[0, 0] = 1.0  # tile 0 amax 1.0
    k[0, 64] = -0.0  # tile 1 all zero, one -0.0
    k[0, 448] = 1.0  # RoPE bf16 0x3F80 -> bytes 0x80 0x3F
    k[0, 449] = -2.0  # bf16 0xC000 -> bytes 0x00 0xC0
    k[1, 3] = -448.0 * 2.0**-3  # tile 0 amax 56 = 1.75 * 2**5
    k[1, 510] = -0.0  # bf16 0x8000 -> bytes 0x00 0x80
    return k.to(torch.bfloat16)


def test_mixed_page_two_slots_by_hand():
    """bs=2, stride 1728, 2 pages filled with 0xAA; write token 0 -> slot 3 and token 1 -> slot 0."""
    cache = empty_cache(2, 2, fill=0xAA)
    k = _mixed_page_rows()
    new = insert(cache, k, torch.tensor([3, 0]), 2, QA)
    assert cache.eq(0xAA).all()  # input untouched
    flat = new.flatten()
    # --- token 0 at slot 3: data at 2304, scales at 2888 (test_slot_addresses_by_hand)
    # tile 0: amax 1 -> r = fl32(1/448) = 2.23e-3 in (2**-9, 2**-8] -> e = -8 -> byte 119;
    #   y = 1 * 2**8 = 256 = 1.0 * 2**8 -> field 15, mantissa 0 -> 0x78
    # tiles 1..6: amax 0 -> Q_A byte 105; dim 64 is -0.0 -> 0x80, the rest 0x00
    data = flat[2304 : 2304 + 576]
    assert data[0].item() == 0x78 and data[1:64].eq(0).all()
    assert data[64].item() == 0x80 and data[65:448].eq(0).all()
    assert data[448:452].tolist() == [0x80, 0x3F, 0x00, 0xC0] and data[452:576].eq(0).all()
    assert flat[2888 : 2888 + 8].tolist() == [119, 105, 105, 105, 105, 105, 105, 0]  # pad byte 0
    # --- token 1 at slot 0: data at 0, scales at 1152
    # tile 0: amax 56 = 1.75 * 2**5 -> 56/448 = 2**-3 exactly -> e = -3 -> byte 124;
    #   -56 * 2**3 = -448 -> 0xFE at dim 3
    data = flat[0:576]
    assert data[3].item() == 0xFE and data[:3].eq(0).all() and data[4:448].eq(0).all()
    assert data[448 + 2 * 62 : 448 + 2 * 63].tolist() == [0x00, 0x80]  # dim 510 = -0.0
    assert flat[1152:1160].tolist() == [124, 105, 105, 105, 105, 105, 105, 0]
    # --- everything else untouched: 2 pages * 1728 - 2 slots * 584 = 2288 bytes of 0xAA
    mask = defined_byte_mask(new, torch.tensor([3, 0]), 2, include_pad=True).flatten()
    assert mask.sum().item() == 2 * 584
    assert flat[~mask].eq(0xAA).all() and (~mask).sum().item() == 2288
    # SCALE_CLAMP changes only the zero tiles' bytes (105 -> 114): tile amaxes 1 and 56 are > 0.0273
    new_s = insert(cache, k, torch.tensor([3, 0]), 2, QS)
    assert new_s.flatten()[2888 : 2888 + 8].tolist() == [119, 114, 114, 114, 114, 114, 114, 0]
    # reading back: exact dequantised rows
    rows = dequantize_slots(new, torch.tensor([3, 0]), 2)
    assert torch.equal(rows.view(torch.int16), k.view(torch.int16))  # every value is exact in E4M3


def test_views_share_geometry_and_results():
    g = torch.Generator().manual_seed(5)
    k = torch.randn(5, 512, generator=g).to(torch.bfloat16)
    slots = torch.tensor([7, -1, 0, 12, 3])
    base = empty_cache(4, 4, page_stride=4 * 584 + 100, fill=3)
    v3 = kernel_view(base, 4)
    assert v3.shape == (4, 4, 584) and v3.stride() == (4 * 584 + 100, 584, 1)
    v4 = v3.unsqueeze(2)
    out2, out3, out4 = (insert(c, k, slots, 4, QA) for c in (base, v3, v4))
    assert out3.stride() == v3.stride() and out4.shape == v4.shape
    assert torch.equal(page_bytes(out2, 4), page_bytes(out3, 4))
    assert torch.equal(page_bytes(out2, 4), page_bytes(out4, 4))
    assert base.eq(3).all()


def test_slot_skip_policies():
    k = torch.ones(3, 512, dtype=torch.bfloat16)
    cache = empty_cache(1, 4, fill=1)
    out = insert(cache, k, torch.tensor([-2, 1, -1]), 4, QA, slot_skip=SlotSkip.ALL_NEGATIVE)
    assert defined_byte_mask(out, torch.tensor([1]), 4, include_pad=True).sum() == 584
    diff = page_bytes(out, 4) != page_bytes(cache, 4)
    assert not (diff & ~defined_byte_mask(out, torch.tensor([1]), 4, include_pad=True)).any()
    with pytest.raises(InputError, match="'slot_mapping'.*MINUS1_ONLY.*out of bounds"):
        insert(cache, k, torch.tensor([-2, 1, -1]), 4, QA, slot_skip=SlotSkip.MINUS1_ONLY)
    # DP padding: rows of k beyond len(slot_mapping) are ignored
    out2 = insert(cache, k, torch.tensor([1]), 4, QA)
    assert torch.equal(out2, out)


def test_input_errors_name_the_argument():
    cache = empty_cache(2, 4)
    k = torch.zeros(2, 512, dtype=torch.bfloat16)
    s = torch.tensor([0, 1])
    cases = [
        (lambda: insert(cache, k.float(), s, 4, QA), "'k'.*bfloat16"),
        (lambda: insert(cache, torch.zeros(2, 511, dtype=torch.bfloat16), s, 4, QA), "'k'.*512"),
        (lambda: insert(cache.to(torch.int8), k, s, 4, QA), "'cache'.*uint8"),
        (lambda: insert(torch.zeros(2, 4 * 584 - 1, dtype=torch.uint8), k, s, 4, QA), "'cache'.*block_size\\*584"),
        (lambda: insert(cache, k, torch.tensor([0, 8]), 4, QA), "'slot_mapping'.*< num_blocks\\*block_size = 8"),
        (lambda: insert(cache, k, torch.tensor([1, 1]), 4, QA), "'slot_mapping'.*twice"),
        (lambda: insert(cache, k, torch.tensor([0, 1, 2]), 4, QA), "'slot_mapping'.*longer than k"),
        (lambda: insert(cache, k, s.float(), 4, QA), "'slot_mapping'.*int"),
        (lambda: insert(cache, k, s, 4, "nope"), "'rule'"),
        (lambda: insert(kernel_view(cache, 4), k, s, 5, QA), "'cache'.*block_size=5"),
        (lambda: gather(cache, torch.tensor([[0]]), torch.tensor([5]), 4), "'block_table'.*too short"),
        (lambda: gather(cache, torch.tensor([[0, 9]]), torch.tensor([5]), 4), "'block_table'.*num_blocks"),
        (lambda: gather(cache, torch.tensor([[0, 1]]), torch.tensor([5]), 4, gather_lens=torch.tensor([6])),
         "'gather_lens'"),
        (lambda: insert(cache, torch.full((2, 512), float("nan"), dtype=torch.bfloat16), s, 4, QA), "'k'.*finite"),
    ]
    for fn, pattern in cases:
        with pytest.raises(InputError, match=pattern):
            fn()


def test_nonfinite_rope_copied_under_producer_policy():
    k = torch.zeros(1, 512)
    k[0, 0], k[0, 448] = float("nan"), float("inf")
    k = k.to(torch.bfloat16)
    data, scales = encode_records(k, QA, nonfinite=NonFinite.CUDA_SATFINITE)
    assert data[0, 0].item() == 0xFE and data[0, 448:450].tolist() == [0x80, 0x7F]  # +inf bf16 0x7F80
    assert scales[0].tolist() == [105] * 7 + [0]  # NaN ignored by the amax: zero tile


def test_gather_by_hand_positions():
    """Two requests, bs=2: request 0 has pages [2, 0], L=3, gather_len 2 -> positions 1, 2 ->
    slots 2*2+1 = 5 and 0*2+0 = 0; request 1 has page [1], L=1 -> position 0 -> slot 2."""
    g = torch.Generator().manual_seed(1)
    k = (torch.randn(3, 512, generator=g)).to(torch.bfloat16)
    cache = insert(empty_cache(3, 2, fill=0xFF), k, torch.tensor([5, 0, 2]), 2, QA)
    out, valid = gather(cache, torch.tensor([[2, 0], [1, 1]]), torch.tensor([3, 1]), 2,
                        gather_lens=torch.tensor([2, 1]), offset=1)
    assert out.shape == (2, 3, 512) and valid.tolist() == [[False, True, True], [False, True, False]]
    want = dequantize_slots(cache, torch.tensor([5, 0, 2]), 2)
    assert torch.equal(out[0, 1:3].view(torch.int16), want[:2].view(torch.int16))
    assert torch.equal(out[1, 1].view(torch.int16), want[2].view(torch.int16))


@given(cache_geometries(), st.data())
def test_insert_gather_roundtrip_and_untouched_bytes(geom, data):
    nb, bs, stride = geom
    cap = nb * bs
    table = torch.tensor(data.draw(st.permutations(range(nb))), dtype=torch.int64).unsqueeze(0)
    L = data.draw(st.integers(1, cap))
    pos_slots = [int(table[0, p // bs]) * bs + p % bs for p in range(L)]
    order = data.draw(st.permutations(range(L)))
    n_pad = data.draw(st.integers(0, 3))
    slot_list = [pos_slots[i] for i in order]
    for _ in range(n_pad):
        slot_list.insert(data.draw(st.integers(0, len(slot_list))), -1)
    slot_mapping = torch.tensor(slot_list, dtype=torch.int64)
    k = data.draw(bf16_rows(n=len(slot_list)))
    rule = data.draw(st.sampled_from([QA, QS]))
    seed = data.draw(st.integers(0, 2**16))
    before = torch.randint(0, 256, (nb, stride), generator=torch.Generator().manual_seed(seed), dtype=torch.int64).to(torch.uint8)
    after = insert(before, k, slot_mapping, bs, rule)
    # bytes outside written slots never change; the written slots' pad byte is 0
    written = slot_mapping[slot_mapping >= 0]
    mask = defined_byte_mask(after, written, bs, include_pad=True)
    assert torch.equal(after[~mask], before[~mask])
    assert defined_byte_mask(after, written, bs).sum().item() == 583 * written.numel()
    # gather returns exactly the dequantised rows (computed here from quantize_tiles directly)
    g = data.draw(st.integers(0, L))
    out, valid = gather(after, table, torch.tensor([L]), bs, gather_lens=torch.tensor([g]))
    tok_of_slot = {int(s): t for t, s in enumerate(slot_mapping.tolist()) if s >= 0}
    toks = [tok_of_slot[pos_slots[p]] for p in range(L - g, L)]
    if toks:
        kk = k[toks]
        codes, sb = quantize_tiles(kk[:, :448], rule)
        nope = dequantize_tiles(codes, sb).to(torch.bfloat16)
        want = torch.cat([nope, kk[:, 448:]], dim=1)
        assert torch.equal(out[0, :g].view(torch.int16), want.view(torch.int16))
    assert valid.sum().item() == g
    # the whole-cache view agrees on written slots
    allrows = dequantize_all(after, bs)
    assert torch.equal(allrows[written].view(torch.int16), dequantize_slots(after, written, bs).view(torch.int16))


@given(slot_mappings(3, 5), st.sampled_from([Fp8Flavour.E4M3FN, Fp8Flavour.E4M3FNUZ]))
def test_read_records_matches_encode_records(slot_mapping, flavour):
    n = slot_mapping.shape[0]
    k = torch.randn(n, 512, generator=torch.Generator().manual_seed(n)).to(torch.bfloat16)
    clamp = 224.0 if flavour is Fp8Flavour.E4M3FNUZ else None
    out = insert(empty_cache(3, 5), k, slot_mapping, 5, QA, flavour=flavour, clamp=clamp)
    keep = slot_mapping >= 0
    d, s = read_records(out, slot_mapping[keep], 5)
    d2, s2 = encode_records(k[keep], QA, flavour=flavour, clamp=clamp)
    assert torch.equal(d, d2) and torch.equal(s, s2)
