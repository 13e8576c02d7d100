"""Prefill workspace plan and combined prefill rows, common and ROCm forms (datapath 4.5, H10,
H11; attention 1.4). Expected values worked out by hand in the comments."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dsv4_numerics.reference.cases import default_cases
from dsv4_numerics.reference.errors import InputError
from dsv4_numerics.reference.indices.prefill import (
    combine_topk_swa_indices,
    combine_topk_swa_indices_rocm,
    compute_prefill_gather_lens,
    get_prefill_chunk_plan,
    prefill_workspace_rows,
)
from dsv4_numerics.strategies.index import batches

M1 = -1


def _case(stage: str, name: str):
    return next(c for c in default_cases(stage) if c.name == name)


def _row(vals: list[int], width: int) -> list[int]:
    return vals + [M1] * (width - len(vals))


# --------------------------------------------------------------------------- plan


def test_gather_lens_decodes_first_with_replay():
    out = compute_prefill_gather_lens(**_case("combine_prefill", "gather-lens-decodes-first-replay").inputs)
    # prefill requests are batch requests 1..3 (1 decode first):
    # req 1: seq 7, query 5-1 = 4, prefix 3 -> 4 + min(3, 127) = 7
    # req 2: seq 300, query 10, prefix 290, replay 250 -> 10 + min(40, 127) = 50
    # req 3: seq 140, query 4, prefix 136 -> 4 + min(136, 127) = 131
    assert out.dtype == torch.int32 and out.tolist() == [7, 50, 131]


def test_chunk_plan_greedy_split():
    plan = get_prefill_chunk_plan(**_case("combine_prefill", "chunk-plan-3req").inputs)
    # area = 1 * (cdiv(1024, 4) + 128 + 64) = 448
    # compressed = 20//4 = 5, 140//4 = 35, 1000//4 = 250; gather bound = 3+17 = 20, 4+127 = 131,
    #   900 + min(100, 127) = 1000
    # chunk 0: {0}: (5, 20); + req 1: 2 * (35 + 131) = 332 <= 448 -> (35, 131);
    #   + req 2: 3 * (250 + 1000) > 448 -> stop -> (0, 2, 35, 166)
    # chunk 1: {2} alone -> (2, 3, 250, 1250)
    assert plan == [(0, 2, 35, 166), (2, 3, 250, 1250)]


def test_workspace_rows_c4():
    comp, swa = prefill_workspace_rows(**_case("combine_prefill", "workspace-rows-c4").inputs)
    # req 0: 20//4 = 5 compressed rows 0..4; gather 20: rows N=35 .. 54 hold positions 0..19
    # req 1: 140//4 = 35 rows 0..34; gather 131: rows 35..165 hold positions 9..139
    assert comp[0].tolist() == _row(list(range(5)), 166)
    assert comp[1].tolist() == list(range(35)) + [M1] * 131
    assert swa[0].tolist() == [M1] * 35 + list(range(20)) + [M1] * 111
    assert swa[1].tolist() == [M1] * 35 + list(range(9, 140))


# --------------------------------------------------------------------------- combine


def _combine_expected_c4() -> list[list[int]]:
    # chunk base 5: req 0 = rows 0..2 (seq 20, positions 17, 18, 19), req 1 = rows 3..6
    # (seq 140, positions 136..139); N = 35, M = 166; gather_start = 20-20 = 0 and 140-131 = 9
    # req 0: topk_len = 18//4, 19//4, 20//4 = 4, 4, 5; swa_start 0, swa_len p+1;
    #   window row = N + q - 0 = 35 + q
    r0 = _row([0, 1, 2, 3] + [35 + q for q in range(18)], 256)
    r1 = _row([0, 1, 2, 3] + [35 + q for q in range(19)], 256)
    r2 = _row([4, 0, 1, 2, 3] + [35 + q for q in range(20)], 256)
    # req 1: topk_len = min(137//4, 8) = 8; + M*1 = 166; window p-127 .. p -> 166 + 35 + q - 9
    def win(p):
        return [166 + 35 + q - 9 for q in range(p - 127, p + 1)]
    r3 = _row([166, 171, 199, 168, 173, 175, 177, 167] + win(136), 256)
    # interior -1 of request 1 -> -1 + 166 = 165 = M*1 - 1: the last workspace row of request 0
    r4 = _row([166, 165, 199, 168, 173, 175, 177, 167] + win(137), 256)
    r5 = _row([200, 166, 167, 168, 169, 170, 171, 172] + win(138), 256)
    r6 = _row([166 + k for k in range(8)] + win(139), 256)
    return [r0, r1, r2, r3, r4, r5, r6]


def test_combine_common_reproduces_minus1_divergence():
    idx, lens = combine_topk_swa_indices(**_case("combine_prefill", "c4-common-base5-interior-minus1").inputs)
    assert idx.dtype == lens.dtype == torch.int32
    assert idx.tolist() == _combine_expected_c4()
    # lens = topk_len + swa_len: 4+18, 4+19, 5+20, then 8 + 128
    assert lens.tolist() == [22, 23, 25, 136, 136, 136, 136]


def test_combine_rocm_validates_topk():
    idx, lens = combine_topk_swa_indices_rocm(**_case("combine_prefill", "c4-rocm-base5-interior-minus1").inputs)
    expected = _combine_expected_c4()
    expected[4][1] = M1  # -1 stays -1 (outside [0, N)); still inside the counted prefix
    assert idx.tolist() == expected
    assert lens.tolist() == [22, 23, 25, 136, 136, 136, 136]


def test_combine_swa_only():
    idx, lens = combine_topk_swa_indices(**_case("combine_prefill", "swa-only-topk0-common").inputs)
    # width ceil128(0 + 128) = 128; req 0 seq 2: positions 0, 1 -> rows 0 / 0, 1 (N = 0);
    # req 1 seq 130, p = 129: window 2..129, gather_start 130-128 = 2 -> 130 + 0 + q - 2
    assert idx.tolist() == [_row([0], 128), _row([0, 1], 128), [130 + q - 2 for q in range(2, 130)]]
    assert lens.tolist() == [1, 2, 128]


def test_combine_c128_local_rows():
    idx, lens = combine_topk_swa_indices(**_case("combine_prefill", "c128-common-bs2-local-rows").inputs)
    # seq 256, positions 254, 255: topk_len = 255//128 = 1, 256//128 = 2; N = 2, M = 131,
    # gather_start = 256-129 = 127; window 127..254 -> 2 + q - 127 = 2..129; 128..255 -> 3..130
    assert idx.tolist() == [_row([0] + list(range(2, 130)), 256), _row([0, 1] + list(range(3, 131)), 256)]
    assert lens.tolist() == [129, 130]


def test_combine_replay_divergence_common_vs_rocm():
    # W = 4, ratio 4, topk 2; one request seq 10, query 2 (positions 8, 9), replay start 7:
    # gather_len = 2 + min(max(8-7, 0), 3) = 3 -> gather_start 7; N = 10//4 = 2, M = 5
    args = dict(topk_indices=torch.tensor([[0, 1], [1, 0]]), query_start_loc=torch.tensor([0, 2]),
                seq_lens=torch.tensor([10]), gather_lens=torch.tensor([3]), window_size=4,
                compress_ratio=4, topk=2, M=5, N=2)
    idx, lens = combine_topk_swa_indices(**args)
    # common: p = 8: swa_start 5, len 4 -> 2 + 5 + j - 7 = 0, 1, 2, 3: the window reaches below
    # the gathered rows into the compressed rows 0, 1 (replay is a V4.1 feature)
    assert idx[:, :6].tolist() == [[0, 1, 0, 1, 2, 3], [1, 0, 1, 2, 3, 4]]
    assert lens.tolist() == [6, 6]
    idx, lens = combine_topk_swa_indices_rocm(**args)
    # ROCm: swa_start = max(5, 7) = 7, swa_end = min(9, 10) -> 2 rows 2, 3; p = 9: 7..9 -> 2, 3, 4
    assert idx[:, :6].tolist() == [[0, 1, 2, 3, M1, M1], [1, 0, 2, 3, 4, M1]]
    assert lens.tolist() == [4, 5]


def test_combine_image_visibility_both_forms():
    # W = 4, max_image_tokens 4, one request seq 10, query 2 (p = 8, 9), gather 7 (start 3), N 0
    # p = 8, left 5, right 1: left_add 2, swa_start = 8-3-2 = 3, swa_len = 8+1-3+1 = 7 -> 0..6
    # p = 9, left 6, right 0: left_add 3, swa_start 3, swa_len 7 -> 0..6
    args = dict(topk_indices=torch.tensor([[-1], [-1]]), query_start_loc=torch.tensor([0, 2]),
                seq_lens=torch.tensor([10]), gather_lens=torch.tensor([7]), window_size=4,
                compress_ratio=1, topk=0, M=7, N=0, max_image_tokens=4,
                left_visible=torch.tensor([5, 6]), right_visible=torch.tensor([1, 0]))
    for fn in (combine_topk_swa_indices, combine_topk_swa_indices_rocm):
        idx, lens = fn(**args)
        assert idx.tolist() == [_row(list(range(7)), 128)] * 2
        assert lens.tolist() == [7, 7]


def test_combine_rejects_uncovered_rows():
    with pytest.raises(InputError, match="query_start_loc.*cover exactly"):
        combine_topk_swa_indices(torch.tensor([[0], [0], [0]]), torch.tensor([4, 6]),
                                 torch.tensor([6]), torch.tensor([6]), 128, 4, 1, 10, 1)


def test_combine_rejects_topk_wider_than_rows():
    # topk 4 but rows of width 2: p = 15 needs topk_len 4 columns; production reads the next row
    with pytest.raises(InputError, match="topk_indices.*topk_len = 4"):
        combine_topk_swa_indices(torch.tensor([[0, 1]]), torch.tensor([0, 1]), torch.tensor([16]),
                                 torch.tensor([16]), 128, 4, 4, 24, 4)


# --------------------------------------------------------------------------- property


@given(st.data())
def test_combined_row_addresses_visible_entries_and_window(data):
    b = data.draw(batches(max_seq=400))
    ratio = data.draw(st.sampled_from([1, 4, 128]))
    topk = 0 if ratio == 1 else data.draw(st.sampled_from([4, 8]))
    w = data.draw(st.sampled_from([4, 16, 128]))
    base = data.draw(st.integers(0, 5))
    num_reqs = len(b.seq_lens)
    seq = torch.tensor(b.seq_lens)
    gl = compute_prefill_gather_lens(seq, b.query_start_loc, None, num_reqs, 0, w)
    plan = get_prefill_chunk_plan(seq, torch.tensor(b.query_lens), ratio, 10**6,
                                  prefill_max_model_len=1000, prefill_window_size=w,
                                  prefill_max_num_batched_tokens=100)
    assert len(plan) == 1
    _, _, n, m = plan[0]
    # indexer rows that agree with H11: exactly min((p+1)//ratio, topk) distinct visible entries
    width = max(topk, 1)
    rows = []
    for t in range(b.num_tokens):
        p = int(b.positions[t])
        want = min((p + 1) // ratio, topk)
        vals = data.draw(st.permutations(list(range((p + 1) // ratio))))[:want] if want else []
        rows.append(vals + [-1] * (width - len(vals)))
    topk_idx = torch.tensor(rows, dtype=torch.int32)
    comp, swa = prefill_workspace_rows(seq, gl, ratio, n, m)
    args = (topk_idx, b.query_start_loc + base, seq, gl, w, ratio, topk, m, n)
    for out, lens in (combine_topk_swa_indices(*args), combine_topk_swa_indices_rocm(*args)):
        for t in range(b.num_tokens):
            r, p = int(b.token_to_req[t]), int(b.positions[t])
            ln = int(lens[t])
            got = set()
            for v in out[t, :ln].tolist():
                assert v // m == r  # inside its own request's workspace rows
                i = v % m
                got.add(("c", int(comp[r, i])) if int(comp[r, i]) >= 0 else ("s", int(swa[r, i])))
            want = {("c", x) for x in rows[t] if x >= 0}
            want |= {("s", q) for q in range(max(p - w + 1, 0), p + 1)}
            assert got == want and len(got) == ln
            assert out[t, ln:].tolist() == [M1] * (out.shape[1] - ln)
