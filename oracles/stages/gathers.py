"""The ``gather`` stage: dequantise + gather the 584-byte cache by block table (judged by
``core.judge_gather_rows``)."""

from __future__ import annotations

import torch

from dsv4_numerics.reference.caches import model1 as cache_model1
from dsv4_numerics.reference.caches import plain as cache_plain
from dsv4_numerics.reference.cases import Case
from dsv4_numerics.reference.policies import Fp8Flavour, GatherOutput, Ue8m0Consumer

from .core import JudgeScope, StageSpec, Verdict, policy_value, judge_gather_rows, register


def _expected_gather(case: Case, policies: dict) -> dict:
    inp = case.inputs
    out, valid = cache_model1.gather(
        inp["cache"], inp["block_table"], inp["seq_lens"], inp["block_size"], inp.get("gather_lens"),
        flavour=policy_value(policies, "fp8", Fp8Flavour.E4M3FN.value),
        consumer=policy_value(policies, "ue8m0", Ue8m0Consumer.EXACT.value))
    if policy_value(policies, "gather_out", GatherOutput.BF16.value) == GatherOutput.E4M3_REQUANT.value:
        out = cache_plain.requantize_e4m3(out)
    return {"out": out, "_valid": valid}


def _gather_alternatives(case: Case, policies: dict) -> dict[str, torch.Tensor]:
    """The gather under each single other policy (explanations for a failing kernel)."""
    alts = {}
    inp = case.inputs
    for f in Fp8Flavour:
        if f.value != policy_value(policies, "fp8", Fp8Flavour.E4M3FN.value):
            p = dict(policies, fp8=f.value)
            alts[f"fp8={f.value} (codes read in the other FP8 flavour)"] = _expected_gather(case, p)["out"]
    for g in GatherOutput:
        if g.value != policy_value(policies, "gather_out", GatherOutput.BF16.value):
            alts[f"gather_out={g.value}"] = _expected_gather(case, dict(policies, gather_out=g.value))["out"]
    return alts


def _judge_gather(case: Case, expected: dict, got: dict, scope: JudgeScope) -> Verdict:
    return judge_gather_rows(expected, got, lambda: _gather_alternatives(case, scope.policies))


# ``gather_out`` (GatherOutput) is honoured with the default ``bf16`` but not listed here: the stage's
# defaults are the provenance the committed gather fixtures record.
register(StageSpec(
    name="gather",
    kind="bytes",
    outputs=("out",),
    defaults={"fp8": Fp8Flavour.E4M3FN.value, "ue8m0": Ue8m0Consumer.EXACT.value},
    expected=_expected_gather,
    judge=_judge_gather,
    doc="dequantise + gather by block table (datapath 3, 4.5)"))
