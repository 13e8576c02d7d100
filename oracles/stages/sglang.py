"""Stages of SGLang 0.5.23's own DeepSeek-V4 kernels, registered in ``oracles.stages.STAGES`` on
import (``oracles.stages`` imports this module).

``kv_norm_rope_store`` (bytes)
    KV RMSNorm + RoPE stored as unit-scale E4M3 rows into a plain FP8 pool (``kv_norm_rope_store.
    fused_k_norm_rope_uniform_fp8``). Reference: ``pipeline.norm_rope_store.kv_norm_rope_store``
    under the policies ``rope_arith`` (``RopeArithmetic``, default ``fma``: the kernel's ``even*c -
    odd*s`` / ``even*s + odd*c`` with the left product fused), ``slot_skip`` (default
    ``all_negative``, the writers' rule; SGLang declares ``negative_wraps``: a negative slot ``s``
    writes row ``rows + s``) and ``nonfinite`` (default ``finite``: the saturating store cast;
    ``torch``: torch 2.11's cast, overflow -> NaN).
    Case inputs (``reference/cases/sglang.py``): ``kv`` ``[T, 512]``, ``weight`` ``[512]``, ``eps``,
    ``cos_sin`` fp32 ``[max_pos, 64]``, ``positions`` / ``slots`` int ``[T]``, ``cache`` uint8
    ``[rows, 512]`` (stale bytes).
    Canonical output: ``cache`` uint8 (or float8_e4m3fn) ``[rows, 512]``, every byte compared
    (bit-exact: the cases are exact-norm rows with ``eps = 0``); a failure names the other policies
    whose bytes the kernel wrote.
"""

from __future__ import annotations

import torch

from dsv4_numerics.reference.cases import Case
from dsv4_numerics.reference.pipeline.norm_rope_store import kv_norm_rope_store
from dsv4_numerics.reference.policies import NonFinite, RopeArithmetic, SlotSkip

from .. import bytes_diff as bd
from .core import JudgeScope, StageSpec, Verdict, bytes_verdict, missing_verdict, policy_value, register

__all__ = ["NORM_ROPE_STORE_DEFAULTS"]

NORM_ROPE_STORE_DEFAULTS = {"rope_arith": RopeArithmetic.FMA.value, "slot_skip": SlotSkip.ALL_NEGATIVE.value,
                            "nonfinite": NonFinite.FINITE.value}
_ALTERNATIVES = {"rope_arith": tuple(RopeArithmetic),
                 "slot_skip": (SlotSkip.ALL_NEGATIVE, SlotSkip.NEGATIVE_WRAPS),
                 "nonfinite": (NonFinite.FINITE, NonFinite.TORCH)}


def _expected_norm_rope_store(case: Case, policies: dict) -> dict:
    inp = case.inputs
    nonfinite = policy_value(policies, "nonfinite", NonFinite.FINITE.value)
    cache = kv_norm_rope_store(inp["kv"], inp["weight"], float(inp["eps"]), inp["cos_sin"], inp["positions"],
                               inp["slots"], inp["cache"],
                               arithmetic=policy_value(policies, "rope_arith", RopeArithmetic.FMA.value),
                               slot_skip=policy_value(policies, "slot_skip", SlotSkip.ALL_NEGATIVE.value),
                               nonfinite=nonfinite)
    return {"cache": cache}


def _alternatives(case: Case, policies: dict) -> dict[str, torch.Tensor]:
    """The pool under each single other policy value (``_ALTERNATIVES``)."""
    alts = {}
    for key, values in _ALTERNATIVES.items():
        mine = policy_value(policies, key, NORM_ROPE_STORE_DEFAULTS[key])
        for v in values:
            if v.value != mine:
                alts[f"{key}={v.value}"] = _expected_norm_rope_store(case, dict(policies, **{key: v.value}))["cache"]
    return alts


def _judge_norm_rope_store(case: Case, expected: dict, got: dict, scope: JudgeScope) -> Verdict:
    if "cache" not in got:
        return missing_verdict("cache", got)
    g = got["cache"].detach().cpu()
    g = g.view(torch.uint8) if g.dtype == torch.float8_e4m3fn else g
    rep = bd.diff_plain_rows(expected["cache"], g, fp8_scale=1.0)
    if not rep.passed and g.dtype == torch.uint8 and tuple(g.shape) == tuple(expected["cache"].shape):
        rep.explanations.extend(bd.match_alternatives(g, _alternatives(case, scope.policies)))
    return bytes_verdict(rep)


register(StageSpec(
    name="kv_norm_rope_store",
    kind="bytes",
    outputs=("cache",),
    defaults=dict(NORM_ROPE_STORE_DEFAULTS),
    expected=_expected_norm_rope_store,
    judge=_judge_norm_rope_store,
    doc="kv RMSNorm + RoPE stored as unit-scale E4M3 rows of a plain pool (SGLang's "
        "fused_k_norm_rope_uniform_fp8; reference.pipeline.norm_rope_store)"))
