"""Index validators: findings per consumer rule, count-vs-prefix lengths, the common combine's
-1 -> M*r-1 case, local top-k checks (datapath 4.1, 4.5, 4.9, H10/H11; attention 2.4-2.5)."""

from __future__ import annotations

import pytest
import torch

from dsv4_numerics.reference.cases import default_cases
from dsv4_numerics.reference.errors import InputError
from dsv4_numerics.reference.indices.validate import (
    Finding,
    find_combine_minus1,
    validate_indices,
    validate_local_topk,
)
from dsv4_numerics.reference.indices.prefill import combine_topk_swa_indices, combine_topk_swa_indices_rocm
from dsv4_numerics.reference.indices.slots import compute_global_topk_indices_and_lens
from dsv4_numerics.reference.policies import IndexRule


def _brief(findings: list[Finding]) -> list[tuple]:
    return [(f.kind, f.token, f.column, f.value) for f in findings]


IDX = torch.tensor([[5, -2, 7, 99], [-1, 3, -1, -1], [1, 2, -1, -1]], dtype=torch.int32)
LENS = torch.tensor([4, 2, 5], dtype=torch.int32)


def test_minus1_only_consumer():
    f = validate_indices(IDX, LENS, 50, IndexRule.MINUS1_ONLY)
    # row 0: -2 is not -1 -> read as an address; 99 >= 50 -> out-of-bounds read
    # row 1: -1 at column 0 with the valid 3 after it inside the length 2 -> interior hole
    # row 2: length 5 > width 4
    assert _brief(f) == [
        ("negative_address", 0, 1, -2),
        ("out_of_range_address", 0, 3, 99),
        ("interior_invalid", 1, 0, -1),
        ("length_out_of_range", 2, None, 5),
    ]
    assert all(isinstance(x.message, str) and f"token {x.token}" in x.message for x in f)


def test_any_out_of_range_invalid_consumer():
    f = validate_indices(IDX, LENS, 50, "any_out_of_range_invalid")
    # same entries, but silently dropped; -2 is now an empty entry followed by the valid 7 -> hole
    assert _brief(f) == [
        ("dropped_negative", 0, 1, -2),
        ("interior_invalid", 0, 1, -2),
        ("dropped_out_of_range", 0, 3, 99),
        ("interior_invalid", 1, 0, -1),
        ("length_out_of_range", 2, None, 5),
    ]


def test_count_lengths_flagged_on_global_topk_output():
    c = next(c for c in default_cases("topk_global") if c.name == "interior-minus1-count-not-prefix")
    g, lens = compute_global_topk_indices_and_lens(**c.inputs)
    # g = [[387, -1, 134, -1], [-1, 389, -1, -1], [73, 74, -1, -1]], lens (counts) = [2, 1, 2]
    # row 0 reads columns 0..1 and misses 134; row 1 reads column 0 (-1) and misses 389
    f = validate_indices(g, lens, None, IndexRule.MINUS1_ONLY)
    assert _brief(f) == [
        ("length_is_count", 0, None, 2),
        ("valid_beyond_length", 0, 2, 134),
        ("length_is_count", 1, None, 1),
        ("valid_beyond_length", 1, 1, 389),
    ]


def test_clean_table_and_row_mask():
    idx = torch.tensor([[4, 5, -1], [7, 8, -1]])
    assert validate_indices(idx, torch.tensor([2, 0]), 10, IndexRule.MINUS1_ONLY,
                            row_mask=torch.tensor([True, False])) == []
    # without the mask the padding row's mapped entries are valid keys the consumer never reads
    f = validate_indices(idx, torch.tensor([2, 0]), 10, IndexRule.MINUS1_ONLY)
    # (no length_is_count: the row's valid entries do form a prefix, the length is just 0)
    assert _brief(f) == [("valid_beyond_length", 1, 0, 7), ("valid_beyond_length", 1, 1, 8)]


def test_max_findings_caps_the_list():
    f = validate_indices(IDX, LENS, 50, IndexRule.MINUS1_ONLY, max_findings=2)
    assert len(f) == 2


@pytest.mark.parametrize("args,match", [
    ((torch.zeros(2, 2), None, 4, "minus1_only"), "idx.*dtype"),
    ((torch.zeros(4, dtype=torch.int32), None, 4, "minus1_only"), "idx.*rank"),
    ((IDX, LENS, 50, "sometimes"), "rule.*must be one of"),
    ((IDX, torch.tensor([1, 2]), 50, "minus1_only"), "lengths.*one entry per row"),
    ((IDX, LENS, -1, "minus1_only"), "num_rows.*>= 0"),
])
def test_validate_indices_bad_arguments(args, match):
    with pytest.raises(InputError, match=match):
        validate_indices(*args)


def test_find_combine_minus1_common_vs_rocm():
    c = next(c for c in default_cases("combine_prefill") if c.name == "c4-common-base5-interior-minus1")
    out, _ = combine_topk_swa_indices(**c.inputs)
    keys = ("topk_indices", "query_start_loc", "seq_lens", "compress_ratio", "topk", "M", "N")
    args = {k: c.inputs[k] for k in keys}
    f = find_combine_minus1(combined_indices=out, **args)
    # token 4 (request 1), column 1: -1 + 166*1 = 165 = M*1 - 1, the last row of request 0
    assert _brief(f) == [("combine_minus1", 4, 1, 165)]
    rocm, _ = combine_topk_swa_indices_rocm(**c.inputs)
    assert find_combine_minus1(combined_indices=rocm, **args) == []


def test_find_combine_foreign_row():
    c = next(c for c in default_cases("combine_prefill") if c.name == "c4-common-base5-interior-minus1")
    inputs = dict(c.inputs)
    topk = inputs["topk_indices"].clone()
    topk[6, 2] = 40  # >= N = 35: 40 + 166 = 206 lands in request 1's window rows
    inputs["topk_indices"] = topk
    out, _ = combine_topk_swa_indices(**inputs)
    keys = ("topk_indices", "query_start_loc", "seq_lens", "compress_ratio", "topk", "M", "N")
    f = find_combine_minus1(combined_indices=out, **{k: inputs[k] for k in keys})
    assert _brief(f) == [("combine_minus1", 4, 1, 165), ("combine_foreign_row", 6, 2, 206)]


def test_validate_local_topk():
    topk = torch.tensor([[0, -1, 2, 2], [5, -3, -1, -1], [0, 1, -1, -1]], dtype=torch.int32)
    # positions 11, 11, 3, ratio 4 -> visible 3, 3, 1; K = 4
    # row 0: hole at column 1; 2 repeated at column 3; count 3 = min(3, 4) ok
    # row 1: 5 >= 3 not visible; -3 other negative; count 1 != 3
    # row 2: 1 >= 1 not visible; count 2 != min(1, 4) = 1
    f = validate_local_topk(topk, positions=torch.tensor([11, 11, 3]), compress_ratio=4)
    assert _brief(f) == [
        ("interior_invalid", 0, 1, -1),
        ("duplicate_entry", 0, 3, 2),
        ("prefill_len_mismatch", 1, None, 1),
        ("not_visible", 1, 0, 5),
        ("other_negative", 1, 1, -3),
        ("prefill_len_mismatch", 2, None, 2),
        ("not_visible", 2, 1, 1),
    ]


def test_validate_local_topk_narrow_block_table_raises():
    with pytest.raises(InputError, match="block_table.*narrower"):
        validate_local_topk(torch.tensor([[0, 64]]), torch.tensor([0]), torch.tensor([[3]]), 64)


def test_validate_local_topk_requires_table_arguments_together():
    with pytest.raises(InputError, match="block_table"):
        validate_local_topk(torch.tensor([[0]]), block_table=torch.tensor([[3]]))
