"""Mutants of the sweep dimensions, each caught only by the default cases of its dimension."""

from __future__ import annotations

import math

import torch

from dsv4_numerics.reference.attention.ordered import Segment
from dsv4_numerics.reference.cases import Case

from .machinery import MutantEntry, attn_out, case_segments, mutant, run_oracle


def _oob_clamped(case: Case) -> dict:
    """An any-out-of-range consumer that clamps out-of-range indices into ``[0, N)`` instead of
    masking them (FlashMLA#184 class: positive OOB indices must be masked)."""
    s = case_segments(case)[0]
    n = s.rows.shape[0]
    idx = s.idx.to(torch.int64)
    ln = s.length.to(torch.int64) if s.length is not None else torch.full((idx.shape[0],), idx.shape[1])
    inpre = torch.arange(idx.shape[1])[None, :] < ln[:, None]
    clamped = torch.where(inpre & (idx != -1), idx.clamp(0, n - 1), idx)
    return attn_out(run_oracle(case, [Segment(s.rows, clamped, s.length, s.rule)]))


def _with_idx(segs: list, idxs: list) -> list:
    return [Segment(s.rows, i, s.length, s.rule) for s, i in zip(segs, idxs)]


def _pow2_page_addressing(case: Case) -> dict:
    """Page and offset by shift and mask, ``slot >> log2(bs)`` / ``slot & (bs - 1)`` with
    ``log2`` floored: right for power-of-two pages (2, 64, 256), wrong for 53, 61, 69, 576."""
    inp = case.inputs
    segs = case_segments(case)
    sizes = [inp["swa_block_size"], inp.get("extra_block_size")]
    idxs = []
    for s, bs in zip(segs, sizes):
        sh = int(bs).bit_length() - 1
        i = s.idx.to(torch.int64)
        moved = ((i >> sh) * bs + (i & ((1 << sh) - 1))) % s.rows.shape[0]
        idxs.append(torch.where(i >= 0, moved, i).to(s.idx.dtype))
    return attn_out(run_oracle(case, _with_idx(segs, idxs)))


TOPK_LOOP_MAX = 512  # the production DSv4 top-k (attention 1.1): a loop bound compiled for it


def _topk_tail_dropped(case: Case) -> dict:
    """Only the first 512 columns of a segment attended (a loop bound sized for the production
    top-k); columns past it are ignored."""
    segs = case_segments(case)
    idxs = []
    for s in segs:
        i = s.idx.clone()
        i[:, TOPK_LOOP_MAX:] = -1
        idxs.append(i)
    return attn_out(run_oracle(case, _with_idx(segs, idxs)))


def _empty_main_row_skipped(case: Case) -> dict:
    """A token whose main segment has no valid entry exits early as a lonely query (out 0, LSE
    -inf), never reading its extra segment (an early return on the main ``topk_length``)."""
    from dsv4_numerics.reference.attention.ordered import segment_validity

    segs = case_segments(case)
    if len(segs) == 1:
        return attn_out(run_oracle(case, segs))
    T = segs[0].idx.shape[0]
    empty = ~segment_validity(segs[:1], T).any(dim=1)
    extra = segs[1].idx.masked_fill(empty[:, None], -1)
    return attn_out(run_oracle(case, _with_idx(segs, [segs[0].idx, extra])))


def _dequant_fp16(case: Case) -> dict:
    """K/V dequantised into float16 (FP8 code x scale in a 5-bit-exponent type): exact for the
    simulated magnitudes, overflowing above 65504 and losing bits below 2**-14."""
    segs = [Segment(s.rows.to(torch.float16).to(torch.float64), s.idx, s.length, s.rule) for s in case_segments(case)]
    return attn_out(run_oracle(case, segs))


FP32_EXP_OVERFLOW = math.log(torch.finfo(torch.float32).max)  # 88.72: exp overflows to inf above it


def _softmax_without_max(case: Case) -> dict:
    """``exp(logit)`` in float32 without subtracting the running max: a row whose largest logit
    exceeds ``ln(FLT_MAX)`` (~88.7) overflows, ``inf / inf`` gives NaN output and LSE."""
    r = run_oracle(case, case_segments(case))
    over = r.max_logits > FP32_EXP_OVERFLOW
    out = r.out.masked_fill(over[..., None], math.nan)
    return {"out": out.to(torch.bfloat16), "lse": r.lse.masked_fill(over, math.nan).to(torch.float32),
            "max_logits": r.max_logits.to(torch.float32)}


def _compressor_masked_rows_scored(case: Case) -> dict:
    """Window rows before position 0 kept with score 0 (kv 0) instead of score -inf: they still
    take softmax weight (datapath 5.1 step 3 masks them)."""
    from dsv4_numerics.reference.pipeline.compressor import compress_windows, state_windows

    inp = case.inputs
    kv, score, valid = state_windows(inp["state"], inp["positions"], inp["ratio"])
    score = torch.where(valid[..., None], score, torch.zeros_like(score))
    normed = compress_windows(kv, score, torch.ones_like(valid), inp["norm_weight"], inp["eps"])
    return {"normed": normed}


def _compressor_bf16_normed(case: Case) -> dict:
    """``normed`` rounded to bf16 before it leaves the compressor (the RoPE lanes must see the
    unrounded fp32 values, H9)."""
    from dsv4_numerics.reference.pipeline.compressor import compressor_boundary

    inp = case.inputs
    b = compressor_boundary(inp["state"], inp["positions"], inp["ratio"], inp["norm_weight"], inp["eps"], inp["cos_sin"])
    return {"normed": b.normed.to(torch.bfloat16).to(torch.float32)}


MUTANTS: list[MutantEntry] = [
    mutant("page_size_pow2_addressing", "decode", "page/offset by shift and mask: power-of-two page sizes only",
           _pow2_page_addressing, dimension="odd_page_size"),
    mutant("topk_tail_dropped", "decode", "top-k loop bounded at the production 512: longer rows truncated",
           _topk_tail_dropped, dimension="long_topk"),
    mutant("empty_main_row_skipped", "decode", "early exit on an empty main segment skips the extra segment",
           _empty_main_row_skipped, dimension="empty_main"),
    mutant("cache_dequant_fp16", "decode", "K/V dequantised into float16 (narrower exponent range than the cache)",
           _dequant_fp16, dimension="kv_magnitude"),
    mutant("softmax_without_max_fp32", "decode", "fp32 exp of unshifted logits (no running max): overflow",
           _softmax_without_max, dimension="q_magnitude"),
    mutant("oob_index_clamped", "prefill", "out-of-range index clamped into range instead of masked (FlashMLA#184 class)",
           _oob_clamped, index_rule="any_out_of_range_invalid"),
    mutant("compressor_masked_rows_scored", "compressor", "rows before position 0 keep softmax weight (datapath 5.1 step 3)",
           _compressor_masked_rows_scored),
    mutant("compressor_normed_rounded_bf16", "compressor", "normed rounded to bf16 in the producer (H9)",
           _compressor_bf16_normed),
]
