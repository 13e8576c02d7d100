"""The ``inv_rope_fp8`` stage: output inverse RoPE + FP8 group quantiser (bytes exact, values tier C)."""

from __future__ import annotations

import math

import torch

from dsv4_numerics.reference.cases import Case
from dsv4_numerics.reference.errors import fail
from dsv4_numerics.reference.policies import RopeArithmetic

from .. import bytes_diff as bd
from .core import JudgeScope, StageSpec, Verdict, bytes_verdict, dtype_name, missing_verdict, policy_value, register


def _expected_inv_rope_fp8(case: Case, policies: dict) -> dict:
    from dsv4_numerics.reference.attention.epilogue import inv_rope_fp8_quant

    inp = case.inputs
    arith = policy_value(policies, "rope_arith", RopeArithmetic.FMA_TRITON.value)
    r = inv_rope_fp8_quant(inp["o"], inp["positions"], inp["cos_sin"], inp["heads_per_group"], arithmetic=arith)
    return {"codes": r.codes_tgd.contiguous(), "exponents": r.exponents, "deq": r.dequantized, "_rotated": r.rotated}


def _judge_inv_rope_fp8(case: Case, expected: dict, got: dict, scope: JudgeScope) -> Verdict:
    """Bytes exact from the bf16 attention output (codes ``[T, G, hpg*512]`` and exponents
    ``[T, H, 4]``), then, if the kernel returns ``deq``, tier C on the dequantised values:
    ``|deq - rotated| <= block_mult * 2**e`` with ``e`` the kernel's own block exponent."""
    hpg = case.inputs["heads_per_group"]
    for k in ("codes", "exponents"):
        if k not in got:
            return missing_verdict(k, got)
    T, H, _ = expected["exponents"].shape
    G = H // hpg
    ge = got["exponents"].cpu()
    if tuple(ge.shape) != (T, H, 4) or ge.dtype.is_floating_point:
        return Verdict(False, "shape", f"exponents: got {ge.dtype}{tuple(ge.shape)}, expected int[{T}, {H}, 4]", headroom=0.0)
    rep = bd.diff_output_fp8(expected["codes"], got["codes"].cpu(), expected["exponents"].reshape(T, G, hpg * 4),
                             ge.reshape(T, G, hpg * 4), heads_per_group=hpg)
    v = bytes_verdict(rep)
    if not v.passed or "deq" not in got:
        return v
    tol = scope.tol().lookup(scope.kernel, "deq", dtype_name(case, scope.policies), scope.arch, case.params)
    if tol.metric != "block_scale":
        fail("_judge_inv_rope_fp8", "tolerances", f"output 'deq' needs a block_scale record (got {tol.metric})")
    bound = tol.block_mult * torch.pow(2.0, ge.to(torch.float64)).repeat_interleave(128, dim=-1)
    err = (got["deq"].cpu().to(torch.float64) - expected["_rotated"].to(torch.float64)).abs()
    worst = float((err / bound).max())
    head = math.inf if worst == 0 else 1.0 / worst
    if worst > 1.0:
        return Verdict(False, "deq:block_scale", f"|deq - rotated| reaches {worst:.3g} x the tier C bound "
                       f"{tol.block_mult:g} * 2**e", headroom=head, details={"bytes": rep.to_dict()})
    return Verdict(True, "bit_exact+deq:block_scale", "", headroom=head, details={"bytes": rep.to_dict(), "deq_over_bound": worst})


register(StageSpec(
    name="inv_rope_fp8",
    kind="bytes",
    outputs=("codes", "exponents", "deq"),
    defaults={"rope_arith": RopeArithmetic.FMA_TRITON.value},
    expected=_expected_inv_rope_fp8,
    judge=_judge_inv_rope_fp8,
    doc="output inverse RoPE + FP8 group quantiser: bytes exact, values tier C (attention 3.3, 7)"))
