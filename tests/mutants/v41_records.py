"""Mutants of the DeepSeek-V4.1 MXFP8 / NVFP4 records: their writer and their gather."""

from __future__ import annotations

from typing import Callable

import torch

from dsv4_numerics.reference.caches import v41 as cache_v41
from dsv4_numerics.reference.formats import fp4
from dsv4_numerics.reference.cases import Case
from dsv4_numerics.reference.caches.gather_plan import gather_plan

from .machinery import MutantEntry, mutant


def _v41_kept(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    inp = case.inputs
    slots = inp["slot_mapping"]
    keep = slots >= 0
    return inp["k"][: slots.shape[0]][keep], slots[keep]


def _v41_records(case: Case, data: torch.Tensor, scales: torch.Tensor) -> dict:
    """Write record parts of the kept tokens into a copy of the case's cache, interleaved order."""
    inp = case.inputs
    _, slots = _v41_kept(case)
    out = inp["cache"].clone()
    flat = out.view(-1)
    da, sa = cache_v41.slot_addresses(slots, inp["block_size"], inp["page_stride"], inp["record"], "interleaved")
    flat[(da.unsqueeze(1) + torch.arange(data.shape[1])).flatten()] = data.flatten()
    flat[(sa.unsqueeze(1) + torch.arange(scales.shape[1])).flatten()] = scales.flatten()
    return {"cache": out}


def _v41_insert_with(**kw: str) -> Callable[[Case], dict]:
    def call(case: Case) -> dict:
        inp = case.inputs
        layout = kw.get("layout", "interleaved")
        rest = {k: v for k, v in kw.items() if k != "layout"}
        return {"cache": cache_v41.insert(inp["cache"], inp["k"], inp["slot_mapping"], inp["block_size"],
                                          inp["record"], layout, **rest)}
    return call


def _v41_nvfp4(case: Case, *, swap_nibbles: bool = False, unrounded_divisor: bool = False,
               ties_away: bool = False) -> dict:
    """The NVFP4 writer with one defect; MXFP8 cases are written correctly."""
    if case.inputs["record"] != "nvfp4_288":
        return _v41_insert_with()(case)
    k, _ = _v41_kept(case)
    x = k.float().reshape(k.shape[0], -1, 16)
    amax = x.abs().amax(dim=-1)
    sbytes = fp4.nvfp4_scale_bytes(amax, "recip_mul")
    div = (amax / 6).clamp(2.0**-9, 448.0) if unrounded_divisor else fp4.decode_nvfp4_scales(sbytes)
    y = fp4.div_rn_f32(x, div.unsqueeze(-1))
    if ties_away:  # nudge exact ties outwards so RNE rounds them away from zero
        tie = torch.isin(y.abs(), torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]))
        y = torch.where(tie, y * (1 + 2.0**-20), y)
    codes = fp4.encode_e2m1(y).reshape(k.shape[0], -1)
    if swap_nibbles:
        codes = codes.reshape(k.shape[0], -1, 2).flip(-1).reshape(k.shape[0], -1)
    return _v41_records(case, fp4.pack_e2m1(codes), sbytes)


def _v41_gather_with(layout: str = "interleaved", swap_nibbles: bool = False, window_from_start: bool = False,
                     scale_bias: int = 127) -> Callable[[Case], dict]:
    """A V4.1 gather with one defect: the wrong byte order (H13), the odd element read from the
    low nibble, the first ``g`` positions instead of the last ``g`` (window start ``L - g``
    dropped), or UE8M0 bytes decoded with the wrong bias."""

    def call(case: Case) -> dict:
        inp = case.inputs
        seq, gl = inp["seq_lens"], inp.get("gather_lens")
        if window_from_start and gl is not None:
            seq = gl  # position L - g + i read as i
        out, valid = cache_v41.gather(inp["cache"], inp["block_table"], seq, inp["block_size"], inp["record"], layout,
                                      gl, consumer="triton", offset=inp.get("offset", 0))
        if swap_nibbles or scale_bias != 127:
            nb, bs, _ = cache_v41.cache_geometry("mutant", inp["cache"], inp["block_size"], cache_v41.as_record("m", inp["record"]))
            plan = gather_plan("mutant", inp["block_table"], inp["seq_lens"], bs, nb, gl, inp.get("offset", 0))
            data, scales = cache_v41.read_records(inp["cache"], plan.slot, bs, inp["record"], layout)
            if swap_nibbles and inp["record"] == "nvfp4_288":
                data = (data >> 4) | (data << 4)
            if scale_bias != 127 and inp["record"] == "mxfp8_528":
                scales = (scales.to(torch.int64) + 127 - scale_bias).clamp(0, 255).to(torch.uint8)
            out[plan.req, plan.row] = cache_v41.decode_records(data, scales, inp["record"], "triton")
        return {"out": out}

    return call


MUTANTS: list[MutantEntry] = [
    mutant("v41_page_footer_for_interleaved", "v41_write", "V4.1 record written in FlashInfer 0.7.2's page-footer order "
           "where vLLM 0.33.0 / FlashMLA read interleaved records (vFMLA :122-128 BREAKING CHANGE, H13)",
           _v41_insert_with(layout="page_footer")),
    mutant("v41_mxfp8_scale_rule_swapped", "v41_write", "FlashInfer's Q_S (floor 2**-13) where the vLLM MXFP8 writer uses "
           "Q_A (floor 2**-22): tiny and zero groups (cache_utils.py:225-226 vs FI cake_dsv41_fp8_cache_ops.cu:161-165)",
           _v41_insert_with(mxfp8_rule="scale_clamp")),
    mutant("v41_nvfp4_nibbles_swapped", "v41_write", "even element in the HIGH nibble (cvt.e2m1x2 operand order, "
           "fused_indexer_q.py:40 'NOTE: $1 is high nibble')", lambda c: _v41_nvfp4(c, swap_nibbles=True)),
    mutant("v41_nvfp4_unrounded_divisor", "v41_write", "values divided by amax/6 instead of the stored E4M3-rounded scale "
           "(dsv41_fp4_cache_ops.cu:129 'The stored (E4M3-rounded) scale is what the values are divided by')",
           lambda c: _v41_nvfp4(c, unrounded_divisor=True)),
    mutant("v41_e2m1_ties_away", "v41_write", "E2M1 ties rounded away from zero (approximate division, fused_compress_"
           "quant_cache.py:522-524 'div.full misplaces values that land exactly on an e2m1 tie')",
           lambda c: _v41_nvfp4(c, ties_away=True)),
    mutant("v41_gather_page_footer", "v41_gather", "V4.1 cache read in the page-footer order it was not written in "
           "(vFMLA :122-128 'a cache written in the old layout is NOT rejected, it is misread', H13)",
           _v41_gather_with(layout="page_footer"), ue8m0="triton"),
    mutant("v41_gather_nibbles_swapped", "v41_gather", "NVFP4 even element read from the HIGH nibble (cache_utils.py:625 "
           "'Even element in the low nibble')", _v41_gather_with(swap_nibbles=True), ue8m0="triton"),
    mutant("v41_gather_window_start_dropped", "v41_gather", "positions i instead of L - g + i (start_pos = seq_len - "
           "gather_len dropped, cache_utils.py:552-559)", _v41_gather_with(window_from_start=True), ue8m0="triton"),
    mutant("v41_gather_ue8m0_bias_128", "v41_gather", "MXFP8 scale decoded as exp2(b - 128) (off-by-one bias)",
           _v41_gather_with(scale_bias=128), ue8m0="triton"),
]
