"""SWA window indices, C4 short-context fill, C128A width rule and table (datapath 4.2-4.4,
attention 1.4, 3.1). Expected values worked out by hand in the comments."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dsv4_numerics.reference.cases import default_cases
from dsv4_numerics.reference.errors import InputError
from dsv4_numerics.reference.indices.slots import slots_to_request_positions
from dsv4_numerics.reference.indices.window import (
    build_c128a_topk_metadata,
    c128a_topk_width,
    compute_swa_indices_and_lens,
    fill_short_context_topk_indices,
)
from dsv4_numerics.strategies.index import batches

M1 = -1


def _case(stage: str, name: str):
    return next(c for c in default_cases(stage) if c.name == name)


def _row(vals: list[int], width: int) -> list[int]:
    return vals + [M1] * (width - len(vals))


# --------------------------------------------------------------------------- SWA


def test_swa_window16_bs2_starts_at_0():
    idx, lens = compute_swa_indices_and_lens(**_case("swa_indices", "window16-bs2-starts-at-0").inputs)
    # req 0 (seq 3, query 3): positions 0, 1, 2; table [9, 4, ...], bs 2:
    #   pos 0 -> 18, pos 1 -> 19, pos 2 -> col 1: 4*2 = 8; the window starts at 0 (p < W-1)
    # req 1 (seq 20, decode): p = 19, start = 19 - 15 = 4, positions 4..19 through
    #   [3, 0, 8, 1, 6, 2, 7, 5, 10, 11]: (4,5)->8: 16,17; (6,7)->1: 2,3; (8,9)->6: 12,13;
    #   (10,11)->2: 4,5; (12,13)->7: 14,15; (14,15)->5: 10,11; (16,17)->10: 20,21; (18,19)->11: 22,23
    assert idx.dtype == torch.int32 and lens.dtype == torch.int32
    assert idx.tolist() == [_row([18], 16), _row([18, 19], 16), _row([18, 19, 8], 16),
                            [16, 17, 2, 3, 12, 13, 4, 5, 14, 15, 10, 11, 20, 21, 22, 23]]
    assert lens.tolist() == [1, 2, 3, 16]


def test_swa_decode_bs64_w128_padding():
    idx, lens = compute_swa_indices_and_lens(
        **_case("swa_indices", "decode-bs64-w128-window-starts-at-0-padding").inputs)
    # token 0: req 0 seq 5 -> p = 4, window 0..4 in page 3: 192..196
    assert idx[0].tolist() == _row([192, 193, 194, 195, 196], 128)
    # token 1: req 1 seq 200 -> p = 199, start 72: 72..127 in page 2 (2*64+8 = 136 .. 191),
    #   128..191 in page 9 (576 .. 639), 192..199 in page 0 (0 .. 7)
    assert idx[1].tolist() == list(range(136, 192)) + list(range(576, 640)) + list(range(0, 8))
    # token 2: req 2 seq 129 -> p = 128, start 1: 1..63 in page 1 (65..127), 64..127 in page 4
    #   (256..319), 128 in page 7 (448)
    assert idx[2].tolist() == list(range(65, 128)) + list(range(256, 320)) + [448]
    # token 3: padding (slot -1) -> all -1, length 0
    assert idx[3].tolist() == [M1] * 128
    assert lens.tolist() == [5, 128, 128, 0]


def test_swa_paged_prefill_token_offset_bs61():
    idx, lens = compute_swa_indices_and_lens(**_case("swa_indices", "prefill-paged-bs61-token-offset").inputs)
    # tokens 2..6 = req 2 (seq 130, query 5): positions 125..129; table [3, 8, 1], bs 61
    # p = 125: start 0, len 126: 0..60 -> 183..243, 61..121 -> 488..548, 122..125 -> 61..64
    page0, page1 = list(range(183, 244)), list(range(488, 549))
    assert idx[0].tolist() == page0 + page1 + [61, 62, 63, 64] + [M1, M1]
    # p = 127: start 0, len 128 (ends at 127 -> 66); p = 129: start 2 -> 185.., ends 129 -> 68
    assert idx[2].tolist() == page0 + page1 + [61, 62, 63, 64, 65, 66]
    assert idx[4].tolist() == page0[2:] + page1 + [61, 62, 63, 64, 65, 66, 67, 68]
    assert lens.tolist() == [126, 127, 128, 128, 128]


def test_swa_replay_start():
    idx, lens = compute_swa_indices_and_lens(**_case("swa_indices", "replay-start-v41-bs64").inputs)
    # p = 149, start = max(149-127, 0, replay 100) = 100, len 50: 100..127 in page 2 (164..191),
    # 128..149 in page 5 (320..341)
    assert idx[0].tolist() == _row(list(range(164, 192)) + list(range(320, 342)), 128)
    assert lens.tolist() == [50]


def test_swa_image_visibility_widens_window():
    # W = 4, one request seq 10, query 2 -> positions 8, 9; identity-ish table bs 4 [2, 0, 1]
    # token 0: left 5, right 1: left_add = 5-3 = 2, start = max(8-3-2, 0) = 3, end = 8+1+1 = 10,
    #   len 7: positions 3..9 -> 3 -> 2*4+3 = 11; 4..7 -> 0..3; 8, 9 -> 1*4 + 0, 1 = 4, 5
    # token 1: left 0, right 0: start 6, len 4: 6, 7 -> 2, 3; 8, 9 -> 4, 5
    idx, lens = compute_swa_indices_and_lens(
        torch.tensor([0, 2]), torch.tensor([10]), torch.tensor([0, 0]), torch.tensor([True, True]),
        torch.tensor([[2, 0, 1]]), 4, window_size=4, index_width=8,
        left_visible=torch.tensor([5, 0]), right_visible=torch.tensor([1, 0]))
    assert idx.tolist() == [[11, 0, 1, 2, 3, 4, 5, M1], [2, 3, 4, 5, M1, M1, M1, M1]]
    assert lens.tolist() == [7, 4]


def test_swa_valid_token_outside_its_request_raises():
    with pytest.raises(InputError, match="token_to_req_indices.*query range"):
        compute_swa_indices_and_lens(torch.tensor([0, 1, 2]), torch.tensor([3, 3]),
                                     torch.tensor([0, 0]), torch.tensor([True, True]),
                                     torch.tensor([[1], [2]]), 64)


@given(st.data())
def test_window_rows_ascending_length_min_p1_w(data):
    b = data.draw(batches())
    w = data.draw(st.sampled_from([1, 3, 16, 128]))
    valid = torch.ones(b.num_tokens, dtype=torch.bool)
    idx, lens = compute_swa_indices_and_lens(b.query_start_loc, torch.tensor(b.seq_lens),
                                             b.token_to_req, valid, b.block_table, b.block_size,
                                             window_size=w)
    req, pos = slots_to_request_positions(idx, b.block_table, b.block_size,
                                          seq_lens=torch.tensor(b.seq_lens))
    for t in range(b.num_tokens):
        p, r = int(b.positions[t]), int(b.token_to_req[t])
        n = min(p + 1, w)
        assert int(lens[t]) == n
        assert pos[t, :n].tolist() == list(range(p - n + 1, p + 1))  # ascending, ends at p
        assert req[t, :n].tolist() == [r] * n
        assert idx[t, n:].tolist() == [M1] * (w - n)


# --------------------------------------------------------------------------- C4 short fill


def test_short_context_fill():
    out = fill_short_context_topk_indices(**_case("c128a_indices", "c4-short-context-fill").inputs)
    # visible = (p+1)//4 for p = 0, 3, 4, 7, 8, 30 -> 0, 1, 1, 2, 2, 7
    assert out.dtype == torch.int32
    assert out.tolist() == [_row([], 8), _row([0], 8), _row([0], 8), _row([0, 1], 8),
                            _row([0, 1], 8), _row([0, 1, 2, 3, 4, 5, 6], 8)]


# --------------------------------------------------------------------------- C128A


@pytest.mark.parametrize("max_seq_len,max_model_len,expected", [
    (1000, 4096, 128),    # 1000//128 = 7 -> pow2 8 -> max(8, 128) = 128; cap ceil128(32) = 128
    (40000, 65536, 512),  # 312 -> 512; cap ceil128(512) = 512
    (20000, 20000, 256),  # 156 -> 256; cap ceil128(157) = 256
    (33000, 33000, 384),  # 257 -> 512; cap ceil128(258) = 384: a multiple of 128, not a power of 2
    (0, 100, 128),        # max(0, 1) = 1 -> 1 -> 128; cap ceil128(1) = 128
])
def test_c128a_width_rule(max_seq_len, max_model_len, expected):
    assert c128a_topk_width(max_seq_len, max_model_len) == expected


def test_c128a_width_too_small_raises():
    with pytest.raises(InputError, match="max_seq_len"):
        c128a_topk_width(50000, 1000)  # needs 390 entries, the cap is 128


def test_c128a_decode_prefill_bs2():
    g, lens, pre = build_c128a_topk_metadata(
        **_case("c128a_indices", "c128a-decode-prefill-bs2-permuted-padding").inputs)
    # decode: p = 127 -> n 1; 255 -> 2; 1000 -> 1001//128 = 7; 5 -> 0; 300 -> 2 (slot -1)
    # req 0 [6, 1]: k 0 -> 12. req 1 [3, 9]: 6, 7. req 2 [4, 8, 2, 7]: 8, 9, 16, 17, 4, 5, 14
    assert g.tolist() == [_row([12], 128), _row([6, 7], 128), _row([8, 9, 16, 17, 4, 5, 14], 128),
                          _row([], 128), _row([6, 7], 128)]
    assert lens.tolist() == [1, 2, 7, 0, 0]  # padding token (slot -1) has length 0
    # prefill: p = 126 -> 0 visible, 127 -> 1, 383 -> 3: local indices
    assert pre.tolist() == [_row([], 128), _row([0], 128), _row([0, 1, 2], 128)]
    assert g.dtype == lens.dtype == pre.dtype == torch.int32


def test_c128a_width_capped():
    g, lens, pre = build_c128a_topk_metadata(**_case("c128a_indices", "c128a-width-capped").inputs)
    # p = 128*130 - 1 -> 130 visible, capped at Wc = 128; table [63, 62, ..., 0], bs 2:
    # k -> (63 - k//2)*2 + k%2: 126, 127, 124, 125, ..., 0, 1
    expected = []
    for page in range(63, -1, -1):
        expected += [2 * page, 2 * page + 1]
    assert g.tolist() == [expected]
    assert lens.tolist() == [128]
    assert pre.shape == (0, 128)


def test_c128a_rejects_unaligned_width():
    with pytest.raises(InputError, match="max_compressed_tokens.*multiple of 128"):
        build_c128a_topk_metadata(torch.tensor([5]), 128, 1, torch.tensor([0]), torch.tensor([[0]]),
                                  2, torch.tensor([0]), max_compressed_tokens=100)
