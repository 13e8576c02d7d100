"""The ``rope`` stage: RoPE / inverse RoPE on dims 448..511, bit-exact under the declared arithmetic."""

from __future__ import annotations

import torch

from dsv4_numerics.reference.cases import Case
from dsv4_numerics.reference.policies import RopeArithmetic

from .. import bytes_diff as bd
from .core import JudgeScope, StageSpec, Verdict, bytes_verdict, missing_verdict, policy_value, register


def _expected_rope(case: Case, policies: dict) -> dict:
    from dsv4_numerics.reference.pipeline.rope import apply_rope

    inp = case.inputs
    arith = policy_value(policies, "rope_arith", RopeArithmetic.FMA.value)
    return {"out": apply_rope(inp["x"], inp["positions"], inp["cos_sin"], inverse=bool(inp.get("inverse", False)),
                              arithmetic=arith)}


def _judge_rope(case: Case, expected: dict, got: dict, scope: JudgeScope) -> Verdict:
    """Bit-exact (README 2: RoPE is exact with the FMA-contracted arithmetic). A bf16 result is
    compared with the bf16 rounding of the fp32 reference."""
    if "out" not in got:
        return missing_verdict("out", got)
    e, g = expected["out"], got["out"].cpu()
    if g.dtype == torch.bfloat16:
        e = e.to(torch.bfloat16)
    rep = bd.diff_values(e, g, layout=f"rope_{str(g.dtype).replace('torch.', '')}")
    if not rep.passed:
        alts = {}
        for a in RopeArithmetic:
            if a.value != policy_value(scope.policies, "rope_arith", RopeArithmetic.FMA.value):
                alt = _expected_rope(case, {"rope_arith": a.value})["out"]
                alts[f"rope_arith={a.value}"] = alt.to(g.dtype) if g.dtype == torch.bfloat16 else alt
        rep.explanations.extend(bd.match_alternatives(g, alts))
        rep.message = bd.first_explanation(rep)
    return bytes_verdict(rep)


register(StageSpec(
    name="rope",
    kind="numeric",
    outputs=("out",),
    defaults={"rope_arith": RopeArithmetic.FMA.value},
    expected=_expected_rope,
    judge=_judge_rope,
    doc="RoPE / inverse RoPE on dims 448..511: bit-exact under the declared arithmetic (datapath H6)"))
