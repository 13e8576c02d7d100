"""Mutants of the MODEL1 gather (FP8 flavour of the decode)."""

from __future__ import annotations

from dsv4_numerics.reference.caches import model1 as cache_model1
from dsv4_numerics.reference.cases import Case
from dsv4_numerics.reference.policies import Fp8Flavour

from .machinery import MutantEntry, mutant


def _gather_as(flavour: str):
    def call(case: Case) -> dict:
        inp = case.inputs
        out, _ = cache_model1.gather(inp["cache"], inp["block_table"], inp["seq_lens"], inp["block_size"],
                                     inp.get("gather_lens"), flavour=flavour)
        return {"out": out}
    return call


MUTANTS: list[MutantEntry] = [
    mutant("fnuz_codes_read_as_ocp", "gather", "FNUZ cache decoded as OCP (vLLM#42893: dropped use_fnuz, H9)",
           _gather_as(Fp8Flavour.E4M3FN.value), fp8=Fp8Flavour.E4M3FNUZ.value),
    mutant("ocp_codes_read_as_fnuz", "gather", "OCP cache decoded as FNUZ (one IS_FNUZ flag for both caches, vLLM#42893)",
           _gather_as(Fp8Flavour.E4M3FNUZ.value)),
]
