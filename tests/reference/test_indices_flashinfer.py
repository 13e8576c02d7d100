"""FlashInfer trtllm-gen mixed table (datapath 4.6, attention 1.4 / 2.4). Expected values worked
out by hand in the comments; ``M1`` = -1."""

from __future__ import annotations

import pytest
import torch

from dsv4_numerics.reference.cases import default_cases
from dsv4_numerics.reference.errors import InputError
from dsv4_numerics.reference.indices.flashinfer import (
    build_flashinfer_mixed_sparse_indices,
    remap_flashinfer_index,
)

M1 = -1


def _case(name: str):
    return next(c for c in default_cases("flashinfer_mixed") if c.name == name)


def test_remap_page_span():
    # bs 8, span 10: v -> (v//8)*10 + v%8: 0 -> 0, 7 -> 7, 8 -> 10, 17 -> 21; negatives -> -1
    out = remap_flashinfer_index(torch.tensor([0, 7, 8, 17, -1, -3]), 8, 10)
    assert out.tolist() == [0, 7, 10, 21, M1, M1]


def test_c4_local_decode_and_prefill():
    idx, lens = build_flashinfer_mixed_sparse_indices(**_case("c4-local-decode-prefill-permuted-padding").inputs)
    # SW = 4 (window 4), Pk = ceil4(max(topk 6, DC 6)) = 8 -> width 12. compressed bs = 64//8 = 8
    # decode token 0 (req 0, compressed table [2, 6, 4]): SWA copied 200..203;
    #   local 0 -> 2*8 = 16, 16 -> col 2: 4*8 = 32, 5 -> 2*8+5 = 21; count 3 -> len 4+3 = 7
    # decode token 1 (padding, req 1 table [0, 0, 0]): 1 -> 1, 2 -> 2 still mapped; not counted -> 4
    # prefill req 2 (seq 9, query 3): positions 6, 7, 8; SWA table [5, 7] bs 8; compressed [3, 1, 0]
    #   p = 6: window 3..6 -> 43..46; topk_len = 7//4 = 1: 0 -> 3*8 = 24; len 4+1
    #   p = 7: window 4..7 -> 44..47; topk_len 2: 0, 1 -> 24, 25; len 6
    #   p = 8: window 5..8 -> 45, 46, 47, 7*8 = 56; topk_len 9//4 = 2: 1, 0 -> 25, 24; len 6
    assert idx.dtype == lens.dtype == torch.int32
    assert idx.tolist() == [
        [200, 201, 202, 203, 16, 32, M1, 21, M1, M1, M1, M1],
        [M1, M1, M1, M1, 1, 2, M1, M1, M1, M1, M1, M1],
        [43, 44, 45, 46, 24, M1, M1, M1, M1, M1, M1, M1],
        [44, 45, 46, 47, 24, 25, M1, M1, M1, M1, M1, M1],
        [45, 46, 47, 56, 25, 24, M1, M1, M1, M1, M1, M1],
    ]
    assert lens.tolist() == [7, 4, 5, 6, 6]


def test_c4_packed_page_span():
    idx, lens = build_flashinfer_mixed_sparse_indices(**_case("c4-packed-page-span").inputs)
    # same table as above, remapped: SWA span 10 (bs 8): 200 = 25*8 -> 250.., 43 = 5*8+3 -> 53,
    #   56 = 7*8 -> 70; compressed span 9 (bs 8): 16 = 2*8 -> 18, 32 -> 36, 21 -> 2*9+5 = 23,
    #   24 -> 27, 25 -> 28; values below one page (1, 2) unchanged
    assert idx.tolist() == [
        [250, 251, 252, 253, 18, 36, M1, 23, M1, M1, M1, M1],
        [M1, M1, M1, M1, 1, 2, M1, M1, M1, M1, M1, M1],
        [53, 54, 55, 56, 27, M1, M1, M1, M1, M1, M1, M1],
        [54, 55, 56, 57, 27, 28, M1, M1, M1, M1, M1, M1],
        [55, 56, 57, 70, 28, 27, M1, M1, M1, M1, M1, M1],
    ]
    assert lens.tolist() == [7, 4, 5, 6, 6]


def test_c128_global_decode_with_lens():
    idx, lens = build_flashinfer_mixed_sparse_indices(**_case("c128-global-with-lens-bs2").inputs)
    # Pk = ceil4(max(5, 5)) = 8, width 12. decode: global values copied, len = 4 + lens[0] = 7
    # prefill req 1 (seq 512, query 2): p = 510, 511; SWA bs 64, table [7, 6, ..., 0]:
    #   window 507..510 -> col 7 -> page 0: 59..62; p = 511: 60..63
    #   topk_len = 511//128 = 3, 512//128 = 4; compressed table [2, 0, 1] bs 2: 0 -> 4, 1 -> 5,
    #   2 -> 0, 3 -> 1
    assert idx.tolist() == [
        [10, 11, 12, M1, 6, 7, 2, M1, M1, M1, M1, M1],
        [59, 60, 61, 62, 4, 5, 0, M1, M1, M1, M1, M1],
        [60, 61, 62, 63, 4, 5, 0, 1, M1, M1, M1, M1],
    ]
    assert lens.tolist() == [7, 7, 8]


def test_swa_only():
    idx, lens = build_flashinfer_mixed_sparse_indices(**_case("swa-only-no-compressed").inputs)
    # no compressed part: Pk = 0, width 4. The decode row is copied, len = SW = 4 even with two -1
    # prefill req 1 (seq 6, query 2): p = 4: window 1..4, table [1, 3, 5] bs 2 -> 3, 6, 7, 10;
    #   p = 5: 2..5 -> 6, 7, 10, 11
    assert idx.tolist() == [[3, 4, M1, M1], [3, 6, 7, 10], [6, 7, 10, 11]]
    assert lens.tolist() == [4, 4, 4]


def test_dspark_noncausal_decode_rows():
    idx, lens = build_flashinfer_mixed_sparse_indices(**_case("dspark-noncausal-decode").inputs)
    # window 4, SWA width 6 > 4 -> non-causal. req 0: seq 5, query 2 -> context 3
    #   token 0: window_len = min(3+0+1, 4) = 4, spill_len = min(3, 4) + 2 - 4 = 1
    #     -> columns 0..3 = entries 0..3, column 4 = entry 4 - 4 + 4 = 4, compressed from column 5
    #     (empty), column 5 = -1; len = 4 + 1 + 0 = 5
    #   token 1: window_len = min(5, 4) = 4, spill 1 -> same row
    #   token 2: request 1 has no query tokens (CUDA-graph pad): window 0, spill 0 -> all -1, len 4
    assert idx.tolist() == [[100, 101, 102, 103, 104, M1]] * 2 + [[M1] * 6]
    assert lens.tolist() == [5, 5, 4]


def test_local_decode_requires_validity_flags():
    args = dict(_case("c4-local-decode-prefill-permuted-padding").inputs)
    args["decode_is_valid_token"] = None
    with pytest.raises(InputError, match="decode_is_valid_token"):
        build_flashinfer_mixed_sparse_indices(**args)


def test_narrow_swa_table_names_the_table():
    args = dict(_case("swa-only-no-compressed").inputs)
    args["swa_block_table"] = torch.tensor([[2, 0], [1, 3]], dtype=torch.int32)
    with pytest.raises(InputError, match="swa_block_table.*narrower"):
        build_flashinfer_mixed_sparse_indices(**args)


def test_v41_replay_start_bounds_prefill_windows():
    inp = _case("v41-replay-start-c4").inputs
    idx, lens = build_flashinfer_mixed_sparse_indices(**inp)
    # SW = 8 (window 8), swa bs 4. req 1 (seq 20, query 4: positions 16..19), replay 14, table [6, 2, 9, 4, 11]:
    #   p = 16: window max(9, 14) = 14..16 -> 14 = blk 3 -> 4*4+2 = 18, 19, 16 = blk 4 -> 11*4 = 44; rest -1
    #   p = 19: 14..19 -> 18, 19, 44, 45, 46, 47
    assert idx[1, :8].tolist() == [18, 19, 44, M1, M1, M1, M1, M1]
    assert idx[4, :8].tolist() == [18, 19, 44, 45, 46, 47, M1, M1]
    # req 2 (seq 6, positions 3..5), replay 3, table [7, 5]: p = 3 reads itself only: 7*4+3 = 31
    assert idx[5, :8].tolist() == [31] + [M1] * 7
    # req 3 (positions 38, 39), replay 5 < 38-7: the V4 window 31..38 (31 = blk 7 -> 19*4+3 = 79)
    assert idx[8, 0] == 79
    # lens = SW + min((p+1)//4, 6): the replay start leaves the top-k length alone
    assert lens[1:5].tolist() == [12, 12, 12, 13]
    v4 = {k: v for k, v in inp.items() if k != "replay_start"}
    v4_idx, _ = build_flashinfer_mixed_sparse_indices(**v4)
    assert torch.equal(v4_idx[8:], idx[8:]) and not torch.equal(v4_idx[1:8], idx[1:8])
    with pytest.raises(InputError, match="replay_start.*>= 0"):
        build_flashinfer_mixed_sparse_indices(**dict(inp, replay_start=torch.tensor([0, -1, 0, 0])))
    with pytest.raises(InputError, match="replay_start"):
        build_flashinfer_mixed_sparse_indices(**dict(inp, replay_start=torch.tensor([0, 1])))
