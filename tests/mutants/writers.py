"""Mutants of the MODEL1 (584-byte) cache writers: layout, page stride, skipped slots, scale rules."""

from __future__ import annotations

import math

import torch

from dsv4_numerics.reference.caches import model1 as cache_model1
from dsv4_numerics.reference.cases import Case
from dsv4_numerics.reference.constants import E4M3_MAX, NOPE_DIM, SCALE_FLOOR_F32, TILE
from dsv4_numerics.reference.formats.fp8 import encode_fp8, pow2_f64
from dsv4_numerics.reference.policies import Fp8Flavour, ScaleRule

from .machinery import MutantEntry, kept_rows, layout_mutant, mutant, write_records


def _insert_with(rule: str, **kw):
    def call(case: Case) -> dict:
        inp = case.inputs
        return {"cache": cache_model1.insert(inp["cache"], inp["k"], inp["slot_mapping"], inp["block_size"], rule, **kw)}
    return call


def _minus1_as_slot0(case: Case) -> dict:
    """Every ``-1`` token written to slot 0 (a writer that clamps the sentinel to 0 instead of
    skipping it; datapath 2.1 step 1 / 2.2: only ``slot >= 0`` may be written)."""
    inp = case.inputs
    out = cache_model1.insert(inp["cache"], inp["k"], inp["slot_mapping"], inp["block_size"], ScaleRule.AMAX_CLAMP)
    s = inp["slot_mapping"].to(torch.int64)
    for t in (s == -1).nonzero().reshape(-1).tolist():
        data, scales = cache_model1.encode_records(inp["k"][t:t + 1], ScaleRule.AMAX_CLAMP)
        out = write_records(Case(case.name, case.stage, {**inp, "cache": out}), data, scales, torch.tensor([0]))["cache"]
    return {"cache": out}


def _approx_log2_writer(case: Case) -> dict:
    """Q_A with ``log2`` computed approximately in float32 (``ln(r) * fl32(1/ln 2)``) before the ceil:
    the fast-math bug class of datapath 2.8 / H2 (exact ties ``amax = 1.75 * 2**m`` go to m - 7)."""
    k, slots = kept_rows(case)
    x = k[:, :NOPE_DIM].to(torch.float32).reshape(-1, NOPE_DIM // TILE, TILE)
    a = x.abs().amax(-1)
    r = torch.maximum(a, torch.tensor(SCALE_FLOOR_F32, dtype=torch.float32)) / torch.tensor(E4M3_MAX, dtype=torch.float32)
    e = torch.ceil(torch.log(r) * torch.tensor(1.0 / math.log(2.0), dtype=torch.float32)).to(torch.int64)
    y = x.to(torch.float64) * pow2_f64(-e).unsqueeze(-1)
    codes = encode_fp8(y, Fp8Flavour.E4M3FN, clamp=E4M3_MAX).reshape(-1, NOPE_DIM)
    data, scales = cache_model1.encode_records(k, ScaleRule.AMAX_CLAMP)
    data[:, :NOPE_DIM] = codes
    scales[:, : NOPE_DIM // TILE] = torch.clamp(e + 127, 0, 255).to(torch.uint8)
    return write_records(case, data, scales, slots)


MUTANTS: list[MutantEntry] = [
    mutant("planar_as_interleaved", "swa_write", "per-token interleaved data+scales instead of the V4 planar page "
           "(V4.1 layout switch, vFMLA :119-131, H10)", layout_mutant("interleaved")),
    mutant("page_stride_ignored", "swa_write", "page base bs*584 instead of cache.stride(0) (H12)", layout_mutant("packed")),
    mutant("minus1_written_to_slot0", "swa_write", "-1 slot clamped to slot 0 instead of skipped (datapath 2.1/2.2)",
           _minus1_as_slot0),
    mutant("swa_scale_rule_swapped", "swa_write", "Q_S where the SWA writer uses Q_A (H1)", _insert_with(ScaleRule.SCALE_CLAMP.value)),
    mutant("approx_log2", "swa_write", "float32 ln(r)/ln 2 then ceil instead of the exact exponent (fast-math, H2/H16)",
           _approx_log2_writer),
    mutant("fnuz_clamp_240_not_224", "swa_write", "gfx942 FNUZ writer dividing/clamping by 240 (older source) instead of "
           "224 (H8)", _insert_with(ScaleRule.AMAX_CLAMP.value, flavour=Fp8Flavour.E4M3FNUZ.value),
           fp8=Fp8Flavour.E4M3FNUZ.value, fp8_clamp="224.0"),
    mutant("compressed_scale_rule_swapped", "compressed_write", "Q_A where the CuTe compressor uses Q_S (H1)",
           _insert_with(ScaleRule.AMAX_CLAMP.value)),
]
