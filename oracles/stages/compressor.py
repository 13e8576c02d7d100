"""The ``compressor`` stage: compressor steps 3-7 for the boundary positions of one request (normed rows
by tolerance, the written records by ``oracles.compressor_tier``)."""

from __future__ import annotations

import torch

from dsv4_numerics.reference.caches import model1 as cache_model1
from dsv4_numerics.reference.cases import Case
from dsv4_numerics.reference.policies import Fp8Flavour, Fp8Subnormals, RopeArithmetic, ScaleRule, SlotSkip

from .. import numeric as nm
from .core import JudgeScope, StageSpec, Verdict, missing_verdict, policy_value, register


def compressor_fires(inp: dict) -> torch.Tensor:
    """bool ``[M]``: the case's tokens the production compressor writes a record for (state slot
    ``>= 0``, boundary ``(p + 1) % ratio == 0``, compressed slot ``>= 0``; every token when the
    case carries no kernel contract)."""
    pos = inp["positions"].to(torch.int64).cpu()
    fires = (pos + 1) % int(inp["ratio"]) == 0
    for k in ("slot_mapping", "compressed_slot_mapping"):
        if k in inp:
            fires = fires & (inp[k].to(torch.int64).cpu() >= 0)
    return fires


def _expected_compressor(case: Case, policies: dict) -> dict:
    """``normed`` (fp32, compared as float64) and, when the case carries the kernel contract
    (``cache``, ``kv_block_size``, ``compressed_slot_mapping``: ``kernels/vllm/triton.py``
    ``compressor_args``), the ``cache`` after ``cache_model1.insert`` of the bf16 boundary rows of
    the firing tokens under the declared ``scale_rule`` / ``fp8`` (datapath 2.3: OCP on every
    platform), with the compressor tier's error bound ``_bound`` (``oracles.compressor_tier``)."""
    from dsv4_numerics.reference.pipeline.compressor import compressor_boundary

    from ..compressor_tier import compressor_error_bound

    inp = case.inputs
    arith = policy_value(policies, "rope_arith", RopeArithmetic.FMA_TRITON.value)
    b = compressor_boundary(inp["state"], inp["positions"], inp["ratio"], inp["norm_weight"], inp["eps"],
                            inp["cos_sin"], arithmetic=arith)
    out = {"normed": b.normed.to(torch.float64), "_row_bf16": b.row_bf16}
    if "cache" in inp and "compressed_slot_mapping" in inp:
        fires = compressor_fires(inp)
        slots = inp["compressed_slot_mapping"].to(torch.int64).cpu()[fires]
        out["cache"] = cache_model1.insert(
            inp["cache"], b.row_bf16[fires], slots, inp["kv_block_size"],
            rule=policy_value(policies, "scale_rule", ScaleRule.SCALE_CLAMP.value),
            flavour=policy_value(policies, "fp8", Fp8Flavour.E4M3FN.value),
            slot_skip=policy_value(policies, "slot_skip", SlotSkip.ALL_NEGATIVE.value),
            subnormals=policy_value(policies, "fp8_subnormals", Fp8Subnormals.KEEP.value))
        out["_slots"] = slots
        out["_bound"] = compressor_error_bound(inp["state"], inp["positions"][fires], inp["ratio"],
                                               inp["norm_weight"], inp["eps"], b.normed[fires])
    return out


def _judge_compressor(case: Case, expected: dict, got: dict, scope: JudgeScope) -> Verdict:
    """``normed`` (fp32 ``[M, 512]``) by the tolerance record (H7: producers' reductions differ),
    and/or ``cache`` (the production kernel's output: the compressed 584-byte records) by the
    compressor tier of ``oracles.compressor_tier`` (the GPU fuzz test's rounding-error model: NoPE bytes cannot be
    bit-exact across producers, H7; bytes outside the records must be untouched). At least one of
    the two must be returned; every returned one is judged."""
    from ..compressor_tier import judge_compressed_records

    if "normed" not in got and "cache" not in got:
        return missing_verdict("normed' or 'cache", got)
    checks: list[Verdict] = []
    if "normed" in got:
        g = got["normed"].detach().cpu()
        e = expected["normed"]
        if tuple(g.shape) != tuple(e.shape):
            return Verdict(False, "normed:shape", f"normed: got shape {tuple(g.shape)}, expected {tuple(e.shape)}", headroom=0.0)
        tol = scope.tol().lookup(scope.kernel, "normed", "*", scope.arch, case.params)
        r = nm.compare(g.to(torch.float64), e, atol=tol.atol, rtol=tol.rtol, cos_tol=tol.cos_tol, fmt="fp32", name="normed")
        checks.append(Verdict(r.passed, f"normed:{r.rule}", r.message, r.max_ulps_rel_regime, r.headroom,
                              {"normed": r.to_dict()}))
    if "cache" in got:
        if "cache" not in expected:
            return Verdict(False, "cache:no_contract", "the kernel returned 'cache' but the case carries no "
                           "compressed-cache contract (cache, kv_block_size, compressed_slot_mapping)", headroom=0.0)
        t = judge_compressed_records(got["cache"], expected["cache"], case.inputs["cache"], expected["_slots"],
                                     case.inputs["kv_block_size"], expected["_bound"])
        checks.append(Verdict(t.passed, t.rule, t.message, None, t.headroom, {"cache": t.details}))
    bad = [c for c in checks if not c.passed]
    if bad:
        return Verdict(False, bad[0].rule, "; ".join(f"{c.rule}: {c.message}" for c in bad), bad[0].worst_ulps,
                       min(c.headroom for c in checks), {k: v for c in checks for k, v in c.details.items()})
    binding = min(checks, key=lambda c: c.headroom)
    ulps = [c.worst_ulps for c in checks if c.worst_ulps is not None]
    return Verdict(True, binding.rule, "", max(ulps) if ulps else None, binding.headroom,
                   {k: v for c in checks for k, v in c.details.items()})


register(StageSpec(
    name="compressor",
    kind="numeric",
    outputs=("normed", "cache"),
    defaults={"rope_arith": RopeArithmetic.FMA_TRITON.value, "scale_rule": ScaleRule.SCALE_CLAMP.value,
              "fp8": Fp8Flavour.E4M3FN.value, "slot_skip": SlotSkip.ALL_NEGATIVE.value,
              "fp8_subnormals": Fp8Subnormals.KEEP.value},
    expected=_expected_compressor,
    judge=_judge_compressor,
    doc="compressor steps 3-7 for boundary positions of one request: fp32 normed rows by tolerance, "
        "the written compressed records by the compressor tier (H7)"))
