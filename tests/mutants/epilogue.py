"""Mutants of RoPE and the output epilogue (inverse RoPE + FP8 quantisation)."""

from __future__ import annotations

import torch

from dsv4_numerics.oracles import stages as st
from dsv4_numerics.reference.cases import Case
from dsv4_numerics.reference.policies import RopeArithmetic

from .machinery import MutantEntry, mutant


def _rope_separate(case: Case) -> dict:
    """Separate fp32 multiplies instead of the FMA-contracted RoPE (datapath 2.1 step 3, H6)."""
    from dsv4_numerics.reference.pipeline.rope import apply_rope

    inp = case.inputs
    return {"out": apply_rope(inp["x"], inp["positions"], inp["cos_sin"], bool(inp.get("inverse", False)),
                              RopeArithmetic.SEPARATE)}


def _epilogue(case: Case, skip_inverse_rope: bool = False, token_major: bool = False) -> dict:
    from dsv4_numerics.reference.attention.epilogue import inv_rope_fp8_quant

    inp = case.inputs
    pos = inp["positions"]
    cs = inp["cos_sin"]
    if skip_inverse_rope:  # identity table row at position 0: cos = 1, sin = 0
        pos = torch.zeros_like(pos)
        cs = st.identity_cos_sin()
    r = inv_rope_fp8_quant(inp["o"], pos, cs, inp["heads_per_group"])
    codes = r.codes.reshape(r.codes_tgd.shape) if token_major else r.codes_tgd.contiguous()
    return {"codes": codes, "exponents": r.exponents, "deq": r.dequantized}


MUTANTS: list[MutantEntry] = [
    mutant("rope_separate_multiplies", "rope", "separate fp32 multiplies instead of the FMA contraction (H6)", _rope_separate),
    mutant("inverse_rope_skipped", "inv_rope_fp8", "output quantised without the inverse RoPE (attention 3.3)",
           lambda c: _epilogue(c, skip_inverse_rope=True)),
    mutant("group_major_read_as_token_major", "inv_rope_fp8", "group-major [G, T, D] codes reinterpreted as [T, G, D] "
           "(attention 3.3 layout)", lambda c: _epilogue(c, token_major=True)),
]
