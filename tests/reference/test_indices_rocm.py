"""ROCm ragged streams: positional vs compacting builders, prefill top-k ragged, indptr
(datapath 4.7, H10). Expected values worked out by hand in the comments."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dsv4_numerics.reference.cases import default_cases
from dsv4_numerics.reference.errors import InputError
from dsv4_numerics.reference.indices.rocm import (
    build_indptr_from_lengths,
    build_prefill_topk_ragged_indices,
    build_ragged_indices_from_dense,
    compute_global_topk_ragged_indices_and_indptr,
)
from dsv4_numerics.reference.indices.slots import compute_global_topk_indices_and_lens
from dsv4_numerics.strategies.index import batches, is_prefix_row, topk_rows

M1 = -1


def _case(name: str):
    return next(c for c in default_cases("rocm_ragged") if c.name == name)


def test_positional_keeps_interior_minus1_and_drops_tail():
    ragged, indptr, lens = compute_global_topk_ragged_indices_and_indptr(
        **_case("positional-interior-minus1-bs64").inputs)
    # row 0 (req 0 [6, 2]): [3, -1, 70, -1] count 2 -> the first 2 columns BY POSITION:
    #   3 -> 387, -1 stays; 70 (-> 134) is dropped
    # row 1 (req 1 [1, 4]): [1, 2, 3] -> 65, 66, 67. row 2: invalid token -> length 0
    assert ragged.tolist() == [387, M1, 65, 66, 67]
    assert indptr.tolist() == [0, 2, 5, 5]
    assert lens.tolist() == [2, 3, 0]
    assert ragged.dtype == indptr.dtype == lens.dtype == torch.int32


def test_compacting_from_dense_with_num_rows():
    flat, indptr = build_ragged_indices_from_dense(**_case("compacting-from-dense-num-rows").inputs)
    # row 0 len 5: 7 kept, -1 dropped, 3 kept, 12 >= num_rows 10 dropped, 5 kept
    # row 1 len 4: -1, -1 dropped, 0, 1 kept; 2 is at column 4 >= len. row 2: len 0
    assert flat.tolist() == [7, 3, 5, 0, 1]
    assert indptr.tolist() == [0, 3, 5, 5]


def test_compacting_without_num_rows_keeps_large_values():
    flat, indptr = build_ragged_indices_from_dense(torch.tensor([[12, -1, 3]]), torch.tensor([3]))
    assert flat.tolist() == [12, 3] and indptr.tolist() == [0, 2]


def test_prefill_topk_ragged_token_offset():
    flat, indptr = build_prefill_topk_ragged_indices(**_case("prefill-topk-ragged-token-offset").inputs)
    # rows are batch tokens 2, 3, 4 of req 1 (query tokens 1..4, seq 12): positions 9, 10, 11
    # token 2: row_len = min(10//4, 4) = 2: [0, 1] -> table [5, 2] bs 2: 10, 11
    # token 3: invalid -> 0
    # token 4: row_len = 12//4 = 3: [1, 0, 9]: 1 -> 11, 0 -> 10, 9 >= num_compressed 3 -> dropped
    assert flat.tolist() == [10, 11, 11, 10]
    assert indptr.tolist() == [0, 2, 2, 4]


def test_indptr_from_lengths():
    assert build_indptr_from_lengths(**_case("indptr-from-lengths").inputs).tolist() == [0, 3, 3, 5, 10]
    with pytest.raises(InputError, match="lengths.*non-negative"):
        build_indptr_from_lengths(torch.tensor([1, -1]))


def test_dense_values_outside_int32_raise():
    with pytest.raises(InputError, match="indices.*int32"):
        build_ragged_indices_from_dense(torch.tensor([[2**31]], dtype=torch.int64), torch.tensor([1]))


@given(st.data())
def test_compacting_and_positional_agree_iff_prefix(data):
    b = data.draw(batches())
    visible = [b.seq_lens[int(r)] for r in b.token_to_req]
    topk = data.draw(topk_rows(visible, 6))
    valid_tok = torch.tensor(data.draw(st.lists(st.booleans(), min_size=b.num_tokens,
                                                max_size=b.num_tokens)), dtype=torch.bool)
    g, lens = compute_global_topk_indices_and_lens(topk, b.token_to_req, b.block_table,
                                                   b.block_size, valid_tok)
    pos_flat, pos_indptr, pos_lens = compute_global_topk_ragged_indices_and_indptr(
        topk, b.token_to_req, b.block_table, b.block_size, valid_tok)
    cmp_flat, cmp_indptr = build_ragged_indices_from_dense(g, lens)
    assert pos_lens.tolist() == lens.tolist()
    all_prefix = all(is_prefix_row(topk[t].tolist()) for t in range(b.num_tokens) if bool(valid_tok[t]))
    agree = pos_flat.tolist() == cmp_flat.tolist() and pos_indptr.tolist() == cmp_indptr.tolist()
    assert agree == all_prefix
