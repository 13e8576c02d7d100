"""Known-answer tests of the pure conversions between canonical forms and kernel forms
(kernels/convert.py), and of the FlashInfer table builders (kernels/flashinfer/mla.py)."""

from __future__ import annotations

import math

import pytest
import torch

from dsv4_numerics.kernels import convert as C
from dsv4_numerics.kernels.flashinfer import mla as FI
from dsv4_numerics.kernels.canonical import DecodeInputs, PagedSegment
from dsv4_numerics.reference.errors import InputError, UnsupportedCase

INF = math.inf


def test_padded_heads_follow_vllm():
    # FlashMLA: 64 if h <= 64 else 128 (vLLM nvidia/flashmla.py:77-85)
    assert [C.padded_heads(h, C.FLASHMLA_HEADS, "k") for h in (1, 64, 65, 128)] == [64, 64, 128, 128]
    # FlashInfer: the next of 8, 16, 32, 64, 128 (vLLM flashinfer_sparse.py:78-89)
    assert [C.padded_heads(h, C.FLASHINFER_HEADS, "k") for h in (1, 8, 9, 33, 100)] == [8, 8, 16, 64, 128]
    with pytest.raises(UnsupportedCase, match="at most 128 query heads"):
        C.padded_heads(129, C.FLASHMLA_HEADS, "k")


def test_pad_heads_zero_q_and_minus_inf_sink():
    q = torch.arange(2 * 3 * 4, dtype=torch.float32).reshape(2, 3, 4).to(torch.bfloat16)
    sink = torch.tensor([0.5, INF, -1.0])
    qp, sp = C.pad_heads(q, sink, 8)
    assert qp.shape == (2, 8, 4) and qp.is_contiguous()
    assert torch.equal(qp[:, :3], q)
    assert torch.equal(qp[:, 3:], torch.zeros(2, 5, 4, dtype=torch.bfloat16))
    assert sp.dtype == torch.float32
    assert sp.tolist() == [0.5, INF, -1.0, -INF, -INF, -INF, -INF, -INF]
    qp2, sp2 = C.pad_heads(q, None, 3)
    assert sp2 is None and torch.equal(qp2, q)
    with pytest.raises(InputError, match="sink"):
        C.pad_heads(q, torch.zeros(2), 8)


def test_pad_topk_minus_one_to_the_block_multiple():
    idx = torch.tensor([[5, -1, 7], [0, 1, 2]], dtype=torch.int64)
    out = C.pad_topk(idx, 4)
    assert out.dtype == torch.int32
    assert out.tolist() == [[5, -1, 7, -1], [0, 1, 2, -1]]
    # already a multiple: unchanged width; minimum widens
    assert C.pad_topk(idx[:, :2], 2).tolist() == [[5, -1], [0, 1]]
    assert C.pad_topk(idx[:, :1], 1, minimum=3).tolist() == [[5, -1, -1], [0, -1, -1]]
    with pytest.raises(InputError, match="int32"):
        C.pad_topk(torch.tensor([[2**31]]), 1)


def test_lse_sentinel_conversion():
    lse = torch.tensor([1.5, INF, -INF, float("nan")])
    got = C.lse_plus_inf_to_minus_inf(lse)
    assert got[:3].tolist() == [1.5, -INF, -INF] and math.isnan(got[3].item())


def test_aligned_pages_repacks_only_misaligned_strides():
    bs = 3
    rec = bs * 584  # 1752 = 16 * 109.5 -> not 16-byte aligned when used as the page stride
    flat = torch.arange(2 * rec, dtype=torch.int64).remainder(251).to(torch.uint8).reshape(2, rec)
    view = flat.as_strided((2, bs, 1, 584), (rec, 584, 584, 1))
    out = C.aligned_pages(view)
    assert out.stride() == (1760, 584, 584, 1)  # round_up(1752, 16) = 1760
    assert torch.equal(out, view)  # every record byte identical
    good = torch.zeros(2, 1760, dtype=torch.uint8).as_strided((2, bs, 1, 584), (1760, 584, 584, 1))
    assert C.aligned_pages(good).data_ptr() == good.data_ptr()


def test_out_of_contract_indices_counts_inside_the_prefix_only():
    idx = torch.tensor([[0, -1, -2, 5], [4, 5, -1, -1]], dtype=torch.int32)
    lens = torch.tensor([3, 2])
    # row 0 prefix [0, -1, -2]: -2 is bad; 5 (column 3) is outside the prefix
    # row 1 prefix [4, 5]: 5 >= n = 5 is bad
    assert C.out_of_contract_indices(idx, lens, 5, allow_minus1_only=True) == 2
    assert C.out_of_contract_indices(idx, None, 5, allow_minus1_only=True) == 3
    assert C.out_of_contract_indices(idx, lens, 5, allow_minus1_only=False) == 0


def _decode_inputs(swa_idx, swa_len, extra_idx=None, extra_len=None, positions=None):
    cache = torch.zeros(1, 64 * 584, dtype=torch.uint8)
    main = PagedSegment(cache, 64, swa_idx, swa_len)
    extra = None if extra_idx is None else PagedSegment(cache, 64, extra_idx, extra_len)
    t = swa_idx.shape[0]
    return DecodeInputs(torch.zeros(t, 8, 512, dtype=torch.bfloat16), 0.1, None, main, extra, positions)


def test_flashinfer_combined_table_and_lengths():
    swa = torch.tensor([[3, 4, -1], [7, -1, -1]], dtype=torch.int32)
    ext = torch.tensor([[10, 11, 12, -1, -1], [20, -1, -1, -1, -1]], dtype=torch.int32)
    d = _decode_inputs(swa, torch.tensor([2, 1], dtype=torch.int32), ext, torch.tensor([3, 1], dtype=torch.int32))
    table, lens = FI.combined_table(d)
    # 128 SWA columns (3 given, 125 of -1), then the 5 compressed columns padded to 8 (multiple of 4)
    assert table.shape == (2, 136) and table.dtype == torch.int32
    assert table[0, :4].tolist() == [3, 4, -1, -1] and table[0, 128:].tolist() == [10, 11, 12, -1, -1, -1, -1, -1]
    assert bool((table[:, 3:128] == -1).all())
    # lengths include the 128 SWA columns: 128 + 3, 128 + 1
    assert lens.tolist() == [131, 129]
    # SWA-only: exactly 128 columns, length 128 (no compressed column is active)
    t2, l2 = FI.combined_table(_decode_inputs(swa, torch.tensor([2, 1], dtype=torch.int32)))
    assert t2.shape == (2, 128) and l2.tolist() == [128, 128]


def test_flashinfer_swa_window_from_seq_lens():
    swa = torch.full((3, 128), -1, dtype=torch.int32)
    lens = torch.tensor([5, 128, 128], dtype=torch.int32)
    pos = torch.tensor([4, 500, 127])
    # one token per request: window = clamp(seq_len, 0, 128), so seq_len = swa_len, or position + 1
    # when the window is full (position 500 -> 501; position 127 -> 128)
    assert FI.swa_seq_lens(_decode_inputs(swa, lens, positions=pos), "k").tolist() == [5, 501, 128]
    assert FI.swa_seq_lens(_decode_inputs(swa, lens), "k").tolist() == [5, 128, 128]
    with pytest.raises(UnsupportedCase, match="empty SWA window"):
        FI.swa_seq_lens(_decode_inputs(swa, torch.tensor([0, 1, 1], dtype=torch.int32)), "k")
    with pytest.raises(UnsupportedCase, match="exactly 128 SWA columns"):
        FI.swa_seq_lens(_decode_inputs(torch.zeros(1, 129, dtype=torch.int32), None), "k")
