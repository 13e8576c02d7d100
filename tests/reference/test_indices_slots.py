"""Block-table map, compute_global_topk_indices_and_lens, FlashMLA helper form, inverse map and
compressed write slots (datapath 1.3, 4.1, 4.8). Expected values are worked out by hand in the
comments: slot = block_table[req, L // bs] * bs + L % bs."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dsv4_numerics.reference.cases import default_cases
from dsv4_numerics.reference.errors import InputError
from dsv4_numerics.reference.indices.slots import (
    abs_indices2indices_in_kvcache,
    compute_global_topk_indices_and_lens,
    get_compressed_slot_mapping,
    local_to_global_slots,
    slots_to_request_positions,
)
from dsv4_numerics.strategies.index import batches, topk_rows

M1 = -1


def _case(stage: str, name: str):
    return next(c for c in default_cases(stage) if c.name == name)


def _eq(t: torch.Tensor, expected, dtype=torch.int32) -> None:
    assert t.dtype == dtype
    assert t.tolist() == expected


# --------------------------------------------------------------------------- known answers


def test_topk_global_c4_bs64_permuted_padding():
    c = _case("topk_global", "c4-bs64-permuted-3req-padding")
    g, lens = compute_global_topk_indices_and_lens(**c.inputs)
    # req 0, table [7, 2, 9, 0]: 0 -> 7*64+0 = 448; 63 -> 7*64+63 = 511; 64 -> col 1: 2*64 = 128;
    #   130 -> col 2: 9*64+2 = 578
    # req 1, table [4, 11, 1, 0]: 65 -> col 1: 11*64+1 = 705; 1 -> 4*64+1 = 257
    # req 2, table [5, 3, 8, 6]: 200 -> col 3: 6*64+8 = 392; 191 -> col 2: 8*64+63 = 575;
    #   128 -> 8*64 = 512; 0 -> 5*64 = 320; 255 -> 6*64+63 = 447
    # token 3 is padding (req 0): still mapped, 1 -> 449, 2 -> 450; its length is 0
    _eq(g, [[448, 511, 128, 578, M1, M1, M1, M1],
            [705, 257, M1, M1, M1, M1, M1, M1],
            [392, 575, 512, 320, 447, M1, M1, M1],
            [449, 450, M1, M1, M1, M1, M1, M1]])
    _eq(lens, [4, 2, 5, 0])


def test_topk_global_c128_bs2_permuted():
    c = _case("topk_global", "c128-bs2-permuted")
    g, lens = compute_global_topk_indices_and_lens(**c.inputs)
    # token 0 -> req 1 [2, 7, 1, 4]: 0 -> 4, 1 -> 5, 2 -> 7*2 = 14, 3 -> 15
    # token 1 -> req 0 [5, 0, 3, 8]: 0 -> 10, 1 -> 11, 2 -> 0*2 = 0
    # token 2 -> req 1: 5 -> col 2: 1*2+1 = 3, 4 -> 2
    _eq(g, [[4, 5, 14, 15], [10, 11, 0, M1], [3, 2, M1, M1]])
    _eq(lens, [4, 3, 2])


@pytest.mark.parametrize("name,expected,lens", [
    # bs 53: req 0 [4, 0, 2, 1]: 52 -> 4*53+52 = 264; 53 -> col 1 -> 0; 105 -> col 1: 0*53+52 = 52;
    #   106 -> col 2: 2*53 = 106. req 1 [3, 6, 5, 7]: 0 -> 159; 159 = 3*53 -> col 3: 7*53 = 371
    ("bs53-odd-permuted", [[264, 0, 52, 106, M1, M1, M1, M1], [159, 371, M1, M1, M1, M1, M1, M1]], [4, 2]),
    # bs 61: req 0 [2, 5, 3]: 60 -> 2*61+60 = 182; 61 -> 5*61 = 305; 122 -> 3*61 = 183.
    #   req 1 [1, 0, 4]: 121 -> col 1: 0*61+60 = 60; 0 -> 61
    ("bs61-odd-permuted", [[182, 305, 183, M1], [60, 61, M1, M1]], [3, 2]),
    # bs 256: req 0 [3, 1]: 255 -> 3*256+255 = 1023; 256 -> 1*256 = 256; 511 -> 511; 0 -> 768.
    #   req 1 [0, 2]: 300 -> col 1: 2*256+44 = 556
    ("bs256-permuted", [[1023, 256, 511, 768], [556, M1, M1, M1]], [4, 1]),
    # interior -1: req 0 [6, 2]: 3 -> 387, 70 -> 2*64+6 = 134; 5 -> 389. req 1 [1, 4]: 9 -> 73, 10 -> 74
    # the length is a COUNT (2 and 1), not the prefix length (1 and 0)
    ("interior-minus1-count-not-prefix", [[387, M1, 134, M1], [M1, 389, M1, M1], [73, 74, M1, M1]], [2, 1, 2]),
    # -2 and -7 are empty like -1 (vLLM tests L >= 0): req 1 [2]: 4 -> 132, 5 -> 133
    ("negative-not-minus1-treated-empty", [[132, M1, 133, M1], [M1, M1, M1, M1]], [2, 0]),
])
def test_topk_global_known_answers(name, expected, lens):
    g, ln = compute_global_topk_indices_and_lens(**_case("topk_global", name).inputs)
    _eq(g, expected)
    _eq(ln, lens)


def test_flashmla_helper_form_bs61():
    c = _case("topk_global", "flashmla-helper-bs61-permuted")
    out = abs_indices2indices_in_kvcache(**c.inputs)
    # batch 0 [4, 1, 6]: 0 -> 244, 60 -> 4*61+60 = 304, 61 -> 61, 122 -> 6*61 = 366
    # batch 1 [0, 5, 2]: 5 -> 5, 70 -> 5*61+9 = 314
    _eq(out, [[[244, 304, 61, M1], [366, M1, M1, M1]], [[5, 314, M1, M1], [M1, M1, M1, M1]]])


def test_flashmla_helper_rejects_other_negatives():
    with pytest.raises(InputError, match="abs_indices.*only negative"):
        abs_indices2indices_in_kvcache(torch.tensor([[[0, -2]]]), torch.tensor([[1]]), 4)


def test_local_to_global_slots_1d():
    # 0 (req 1 [7, 1]) -> 28; 5 (req 0 [4, 2]) -> col 1: 2*4+1 = 9; -3 -> -1
    out = local_to_global_slots(torch.tensor([0, 5, -3]), torch.tensor([1, 0, 0]),
                                torch.tensor([[4, 2], [7, 1]]), 4)
    _eq(out, [28, 9, M1])


def test_inverse_map_known_answer():
    bt = torch.tensor([[3, 1, 0], [2, 5, 4]], dtype=torch.int32)
    slots = torch.tensor([13, 7, 21, 18, 2, -1])
    # seq_lens [5, 12], bs 4: req 0 owns cols 0..1 (pages 3, 1), req 1 owns pages 2, 5, 4
    # 13 = page 3 + 1 -> (0, 1); 7 = page 1 + 3 -> (0, 4+3 = 7) (owned page, past seq_len);
    # 21 = page 5 + 1 -> (1, 4+1 = 5); 18 = page 4 + 2 -> (1, 8+2 = 10); 2 = page 0: not owned
    req, pos = slots_to_request_positions(slots, bt, 4, seq_lens=torch.tensor([5, 12]))
    _eq(req, [0, 0, 1, 1, M1, M1])
    _eq(pos, [1, 7, 5, 10, M1, M1])
    # without seq_lens every non-negative cell is owned: page 0 is req 0's column 2 -> pos 8+2
    req, pos = slots_to_request_positions(slots, bt, 4)
    _eq(req, [0, 0, 1, 1, 0, M1])
    _eq(pos, [1, 7, 5, 10, 10, M1])


def test_inverse_map_rejects_ambiguous_table():
    with pytest.raises(InputError, match="block_table.*two owned cells"):
        slots_to_request_positions(torch.tensor([4]), torch.tensor([[1, 2], [2, 3]]), 4)


@pytest.mark.parametrize("name,expected", [
    # req 0: positions 0..9, boundaries p = 3 (slot 13, writes j = 0 -> 3*64 = 192) and
    #   p = 7 (own slot -1 -> skipped); req 1: p = 259 -> j = 64 -> col 1: 5*64+0 = 320
    ("c4-bs64-permuted-2req-padding-slot", [M1, M1, M1, 192, M1, M1, M1, M1, M1, M1, 320]),
    # dcp 2, interleave 4: boundaries p = 3, 7, 11, 15; local_pos = p//8*4 + p%4 = 3, 3, 7, 7
    #   -> j = 0, 0, 1, 1 -> table [3, 1], bs 2: 6, 6, 7, 7
    ("c4-dcp2-interleave4", [M1, M1, M1, 6, M1, M1, M1, 6, M1, M1, M1, 7, M1, M1, M1, 7]),
])
def test_compressed_slot_mapping_known_answers(name, expected):
    _eq(get_compressed_slot_mapping(**_case("compressed_slots", name).inputs), expected, torch.int64)


def test_compressed_slot_mapping_c128_boundaries():
    out = get_compressed_slot_mapping(**_case("compressed_slots", "c128-bs2-permuted-boundaries").inputs)
    # positions 124..259: p = 127 (token 3) -> j = 0 -> 4*2 = 8; p = 255 (token 131) -> j = 1 -> 9
    expected = [M1] * 136
    expected[3], expected[131] = 8, 9
    _eq(out, expected, torch.int64)


def test_compressed_slot_mapping_skips_only_minus1():
    # ratio 2, bs 2, positions 0..3: p = 1 has slot -5: production compares with -1 only, so it
    # writes j = 0 -> 7*2 = 14; p = 3 has slot -1 -> skipped
    out = get_compressed_slot_mapping(4, torch.tensor([0, -5, 2, -1]), torch.tensor([0, 4]),
                                      torch.tensor([4]), torch.tensor([[7, 9]]), 2, 2)
    _eq(out, [M1, 14, M1, M1], torch.int64)


# --------------------------------------------------------------------------- input errors


def test_narrow_block_table_raises_naming_token_and_column():
    with pytest.raises(InputError, match=r"block_table.*130 \(token 0, column 1\).*column 2.*2 columns"):
        compute_global_topk_indices_and_lens(torch.tensor([[0, 130]]), torch.tensor([0]),
                                             torch.tensor([[1, 2]]), 64, torch.tensor([True]))


@pytest.mark.parametrize("kwargs,match", [
    (dict(topk_indices=torch.zeros(2, 3)), "topk_indices.*dtype"),
    (dict(topk_indices=torch.zeros(3, dtype=torch.int32)), "topk_indices.*rank 2"),
    (dict(token_to_req_indices=torch.tensor([5, 0])), "token_to_req_indices.*row of block_table"),
    (dict(block_size=0), "block_size.*>= 1"),
    (dict(is_valid_token=torch.tensor([2, 1])), "is_valid_token.*bool"),
    (dict(block_table=torch.tensor([[2**30]])), "int32 range"),
])
def test_topk_global_bad_inputs(kwargs, match):
    args = dict(topk_indices=torch.tensor([[1, -1], [2, 3]], dtype=torch.int32),
                token_to_req_indices=torch.tensor([0, 0]), block_table=torch.tensor([[4]]),
                block_size=4, is_valid_token=torch.tensor([True, True]))
    args.update(kwargs)
    with pytest.raises(InputError, match=match):
        compute_global_topk_indices_and_lens(**args)


def test_compressed_slot_mapping_rejects_requests_past_num_tokens():
    with pytest.raises(InputError, match="query_start_loc.*num_tokens"):
        get_compressed_slot_mapping(2, torch.tensor([0, 1, 2]), torch.tensor([0, 3]),
                                    torch.tensor([3]), torch.tensor([[1]]), 4, 4)


# --------------------------------------------------------------------------- properties


@given(st.data())
def test_global_slots_lie_in_owned_pages_and_invert(data):
    b = data.draw(batches())
    visible = [b.seq_lens[int(r)] for r in b.token_to_req]
    topk = data.draw(topk_rows(visible, 8))
    valid_tok = torch.ones(b.num_tokens, dtype=torch.bool)
    g, lens = compute_global_topk_indices_and_lens(topk, b.token_to_req, b.block_table,
                                                   b.block_size, valid_tok)
    assert lens.tolist() == (topk >= 0).sum(1).tolist()
    req, pos = slots_to_request_positions(g, b.block_table, b.block_size,
                                          seq_lens=torch.tensor(b.seq_lens))
    for t in range(b.num_tokens):
        r = int(b.token_to_req[t])
        for k in range(8):
            local = int(topk[t, k])
            if local < 0:
                assert int(g[t, k]) == -1 and int(req[t, k]) == -1
                continue
            assert int(g[t, k]) // b.block_size in b.owned_pages(r)
            assert (int(req[t, k]), int(pos[t, k])) == (r, local)
