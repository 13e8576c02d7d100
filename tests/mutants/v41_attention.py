"""Mutants of DeepSeek-V4.1 attention readers and the query quantiser."""

from __future__ import annotations

from typing import Callable

import torch

from dsv4_numerics.reference.caches import v41 as cache_v41
from dsv4_numerics.reference.formats import fp4
from dsv4_numerics.reference.pipeline import query_quant
from dsv4_numerics.reference.attention.ordered import Segment
from dsv4_numerics.reference.cases import Case
from dsv4_numerics.reference.constants import E4M3_MAX
from dsv4_numerics.reference.formats.fp8 import decode_fp8, decode_ue8m0, encode_fp8, pow2_f64
from dsv4_numerics.reference.policies import Fp8Flavour, IndexRule

from .machinery import MutantEntry, attn_out, mutant, run_oracle


def _v41_rows(cache: torch.Tensor, bs: int, record: str, layout: str, *, scales_per_64: bool = False,
              nibbles_swapped: bool = False, nvfp4_scale_ue8m0: bool = False) -> torch.Tensor:
    """Every slot of a V4.1 cache decoded by a wrong reader (one deviation per flag)."""
    nb = cache_v41.cache_geometry("mutant", cache, bs, cache_v41.V41Record(record))[0]
    data, scales = cache_v41.read_records(cache, torch.arange(nb * bs), bs, record, layout)
    if record == "mxfp8_528":
        vals = decode_fp8(data, Fp8Flavour.E4M3FN).to(torch.float64)
        mult = decode_ue8m0(scales).to(torch.float64)
        width = 64 if scales_per_64 else 32  # V4's 64-wide tile: byte j read for dims [64j, 64j + 64)
        mult = mult[:, torch.arange(512) // width]
    else:
        codes = fp4.unpack_e2m1(data)
        if nibbles_swapped:
            codes = codes.reshape(-1, 256, 2).flip(-1).reshape(-1, 512)
        vals = fp4.decode_e2m1(codes).to(torch.float64)
        mult = (decode_ue8m0(scales) if nvfp4_scale_ue8m0 else fp4.decode_nvfp4_scales(scales)).to(torch.float64)
        mult = mult[:, torch.arange(512) // 16]
    return (vals * mult).to(torch.bfloat16)


def _v41_reader(main: dict | None = None, extra: dict | None = None, extra_layout: str | None = None,
                prefill_swapped: bool = False) -> Callable[[Case], dict]:
    """A V4.1 attention whose cache reader deviates (``_v41_rows`` flags per cache); ``extra_layout``:
    the extra cache always read in that byte order; ``prefill_swapped``: the workspace regions
    concatenated SWA first (the extra region's offset 0 lost)."""

    def call(case: Case) -> dict:
        inp = case.inputs
        lay = inp["v41_layout"]
        rows = [_v41_rows(inp["swa_cache"], inp["swa_block_size"], inp["swa_record"], lay, **(main or {}))]
        if "extra_cache" in inp:
            rows.append(_v41_rows(inp["extra_cache"], inp["extra_block_size"], inp["extra_record"],
                                  extra_layout or lay, **(extra or {})))
        rule = IndexRule(case.params["index_rule"])
        if case.stage == "v41_sparse_decode":
            segs = [Segment(rows[0], inp["swa_indices"], inp["swa_lens"], rule)]
            if len(rows) > 1:
                segs.append(Segment(rows[1], inp["extra_indices"], inp["extra_lens"], rule))
        else:
            ws = torch.cat(rows if prefill_swapped else rows[::-1])
            segs = [Segment(ws, inp["indices"], inp["topk_length"], rule)]
        return attn_out(run_oracle(case, segs))

    return call


def _query_quant(case: Case, *, exponent_rne: bool = False, zero_inverse_kept: bool = False,
                 row_major_scales: bool = False) -> dict:
    """The V4.1 query quantiser with one wrong step (``reference.pipeline.query_quant`` otherwise)."""
    inp = case.inputs
    ref = query_quant.fused_q_kv_rmsnorm_quant(inp["qr"], inp["kv"], inp["q_weight"], inp["kv_weight"], inp["eps"])
    if row_major_scales:
        sf = ref["q_sf"]
        flat = torch.zeros_like(ref["q_scales"])
        flat[: sf.numel()] = sf.reshape(-1)
        return dict(ref, q_scales=flat)
    y = query_quant.rms_norm_rows(inp["qr"], inp["q_weight"], inp["eps"]).to(torch.bfloat16)
    t, q = y.shape
    groups = y.to(torch.float64).reshape(t, q // 32, 32)
    sf = ref["q_sf"].to(torch.int64)
    if exponent_rne:  # round(log2 r) instead of its ceiling: amax/2**e may exceed 448 (saturates)
        r = groups.abs().amax(dim=-1).to(torch.float32).to(torch.float64) * float(torch.tensor(1 / 448, dtype=torch.float32))
        sf = torch.where(r > 0, (torch.round(torch.log2(r)) + 127).clamp(0, 254), torch.zeros_like(r)).to(torch.int64)
    inv = pow2_f64(127 - sf)
    if not zero_inverse_kept:
        inv = torch.where((sf >= 1) & (sf <= 253), inv, torch.zeros_like(inv))
    codes = encode_fp8((groups * inv.unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX), Fp8Flavour.E4M3FN)
    sfb = sf.to(torch.uint8)
    return dict(ref, q_codes=codes.reshape(t, q), q_scales=query_quant.swizzle_f8_128x4(sfb), q_sf=sfb)


MUTANTS: list[MutantEntry] = [
    mutant("v41_mxfp8_scales_per_64_dims", "v41_sparse_decode", "MXFP8 UE8M0 byte j applied to dims [64j, 64j+64): V4's "
           "tile width kept for the 32-wide V4.1 groups (cache_utils.py:44-45 'one UE8M0 scale per 32 dims')",
           _v41_reader(main={"scales_per_64": True})),
    mutant("v41_nvfp4_nibbles_swapped_on_read", "v41_sparse_decode", "NVFP4 extra cache read with the even element in the "
           "HIGH nibble (flash_mla_interface.py 'the even-indexed one in the low nibble')",
           _v41_reader(extra={"nibbles_swapped": True})),
    mutant("v41_nvfp4_scales_read_as_ue8m0", "v41_sparse_decode", "NVFP4 E4M3 group scales decoded as UE8M0 powers of two "
           "(the MXFP8 record's scale format)", _v41_reader(extra={"nvfp4_scale_ue8m0": True})),
    mutant("v41_extra_read_interleaved_when_page_footer", "v41_sparse_decode", "the compressed (extra) cache read in the "
           "interleaved order while its writer used FlashInfer 0.7.2's page footer (H13; only the SWA reader followed "
           "the layout)", _v41_reader(extra_layout="interleaved")),
    mutant("v41_prefill_workspace_regions_swapped", "v41_sparse_prefill", "SWA region gathered at offset 0 and the "
           "compressed region after it (vLLM gathers the compressed rows first, offset=0, then SWA at offset=N)",
           _v41_reader(prefill_swapped=True)),
    mutant("v41_query_scale_exponent_rounded", "v41_query_quant", "UE8M0 exponent rounded to nearest instead of the "
           "ceiling (query_quant.py:71-75 'bump' when the mantissa is non-zero)",
           lambda c: _query_quant(c, exponent_rne=True)),
    mutant("v41_query_zero_byte_inverse_kept", "v41_query_quant", "groups with UE8M0 byte 0 scaled by 2**127 instead of "
           "the zero inverse (query_quant.py:77-78 inv_bits = 0 when sf == 0)",
           lambda c: _query_quant(c, zero_inverse_kept=True)),
    mutant("v41_query_scales_row_major", "v41_query_quant", "scale bytes row-major [T, G] instead of F8_128x4 "
           "(query_quant.py:26-29 mxfp8_scale_offset)", lambda c: _query_quant(c, row_major_scales=True)),
]
