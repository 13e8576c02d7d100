"""The cache-writer stages: ``swa_write`` and ``compressed_write`` (584-byte pages), ``v41_write`` (the
DeepSeek-V4.1 528/288-byte records) and ``plain_write`` (plain bf16 / per-tensor FP8 rows)."""

from __future__ import annotations

import torch

from dsv4_numerics.reference.caches import model1 as cache_model1
from dsv4_numerics.reference.caches import plain as cache_plain
from dsv4_numerics.reference.caches import v41 as cache_v41
from dsv4_numerics.reference.cases import Case
from dsv4_numerics.reference.policies import (Fp8Flavour, Fp8Subnormals, NonFinite, Nvfp4ScaleRule, ScaleRule,
                                              SlotSkip, V41Layout)

from .. import bytes_diff as bd
from ..bytes_diff_v41 import diff_v41
from .core import (JudgeScope, StageSpec, Verdict, bytes_verdict, clamp_policy, flag_policy, missing_verdict, policy_value, register,
                   writer_rows, written_slots)

# --------------------------------------------------------------------------- bytes stages


def _expected_model1(case: Case, policies: dict) -> dict:
    inp = case.inputs
    k = writer_rows(inp["k"], policies)
    cache = cache_model1.insert(
        inp["cache"], k, inp["slot_mapping"], inp["block_size"],
        rule=policy_value(policies, "scale_rule", ScaleRule.AMAX_CLAMP.value),
        flavour=policy_value(policies, "fp8", Fp8Flavour.E4M3FN.value),
        nonfinite=policy_value(policies, "nonfinite", NonFinite.FINITE.value),
        slot_skip=policy_value(policies, "slot_skip", SlotSkip.ALL_NEGATIVE.value),
        clamp=clamp_policy(policies),
        subnormals=policy_value(policies, "fp8_subnormals", Fp8Subnormals.KEEP.value))
    return {"cache": cache, "_k": k}


def _judge_model1(case: Case, expected: dict, got: dict, scope: JudgeScope) -> Verdict:
    if "cache" not in got:
        return missing_verdict("cache", got)
    inp = case.inputs
    k = expected.get("_k", inp["k"])
    slots = written_slots(inp["slot_mapping"], k.shape[0], scope.policies)
    rep = bd.diff_model1(expected["cache"], got["cache"].cpu(), block_size=inp["block_size"], slots=slots,
                         source_rows=k, policies=scope.policies, initial=inp["cache"])
    return bytes_verdict(rep)


def _expected_v41(case: Case, policies: dict) -> dict:
    inp = case.inputs
    cache = cache_v41.insert(
        inp["cache"], writer_rows(inp["k"], policies), inp["slot_mapping"], inp["block_size"], inp["record"],
        policy_value(policies, "v41_layout", V41Layout.INTERLEAVED.value),
        mxfp8_rule=policy_value(policies, "scale_rule", ScaleRule.AMAX_CLAMP.value),
        nonfinite=policy_value(policies, "nonfinite", NonFinite.FINITE.value),
        nvfp4_rule=policy_value(policies, "nvfp4_rule", Nvfp4ScaleRule.RECIP_MUL.value),
        slot_skip=policy_value(policies, "slot_skip", SlotSkip.ALL_NEGATIVE.value))
    return {"cache": cache}


def _judge_v41(case: Case, expected: dict, got: dict, scope: JudgeScope) -> Verdict:
    """diff_v41 over the written records in the declared byte order, then every other byte
    (other slots, page tails) must be the initial cache's (a clobber check)."""
    if "cache" not in got:
        return missing_verdict("cache", got)
    inp = case.inputs
    g = got["cache"].cpu()
    layout = policy_value(scope.policies, "v41_layout", V41Layout.INTERLEAVED.value)
    slots = inp["slot_mapping"]
    if tuple(g.shape) != tuple(inp["cache"].shape) or g.dtype != torch.uint8:
        return Verdict(False, "shape", f"cache: got {g.dtype}{tuple(g.shape)}, expected uint8{tuple(inp['cache'].shape)}",
                       headroom=0.0)
    rep = diff_v41(expected["cache"], g, slots, inp["block_size"], inp["record"], layout)
    mask = cache_v41.defined_byte_mask(inp["cache"], slots, inp["block_size"], inp["record"], layout)
    clobbered = int(((g != inp["cache"]) & ~mask).sum())
    if clobbered:
        rep.passed, rep.clobbered = False, clobbered
        rep.message = (rep.message + "; " if rep.message else "") + f"{clobbered} bytes changed outside the written records"
    return bytes_verdict(rep)


def _expected_plain(case: Case, policies: dict) -> dict:
    inp = case.inputs
    k = writer_rows(inp["k"], policies)
    skip = policy_value(policies, "slot_skip", SlotSkip.ALL_NEGATIVE.value)
    if inp["layout"] == "bf16":
        cache = cache_plain.insert_bf16_rows(inp["cache"], k, inp["slot_mapping"], slot_skip=skip)
    else:
        cache = cache_plain.insert_fp8_rows(
            inp["cache"], k, inp["slot_mapping"], kv_scale=inp.get("kv_scale", 1.0),
            round_to_bf16_first=flag_policy(policies, "round_to_bf16_first", True),
            nonfinite=policy_value(policies, "nonfinite", NonFinite.FINITE.value), slot_skip=skip)
    return {"cache": cache}


def _judge_plain(case: Case, expected: dict, got: dict, scope: JudgeScope) -> Verdict:
    if "cache" not in got:
        return missing_verdict("cache", got)
    e, g = expected["cache"], got["cache"].cpu()
    bs = case.inputs["block_size"]

    def where(idx):
        return {"slot": idx[0] * bs + idx[1], **bd.dim_part(idx[-1])}

    if e.dtype == torch.bfloat16:
        rep = bd.diff_values(e, g, layout="plain_bf16", describe=where)
    else:
        g8 = g.view(torch.uint8) if g.dtype == torch.float8_e4m3fn else g
        e8 = e.view(torch.uint8) if e.dtype == torch.float8_e4m3fn else e
        rep = bd.diff_plain_rows(e8, g8, fp8_scale=case.inputs.get("kv_scale", 1.0))
    return bytes_verdict(rep)


_WRITE_DEFAULTS = {"fp8": Fp8Flavour.E4M3FN.value, "nonfinite": NonFinite.FINITE.value,
                   "slot_skip": SlotSkip.ALL_NEGATIVE.value, "fp8_subnormals": Fp8Subnormals.KEEP.value}

register(StageSpec(
    name="swa_write",
    kind="bytes",
    outputs=("cache",),
    defaults={"scale_rule": ScaleRule.AMAX_CLAMP.value, **_WRITE_DEFAULTS},
    expected=_expected_model1,
    judge=_judge_model1,
    doc="SWA writer: cache_model1.insert (Q_A by default, datapath 2.1, H1)"))
register(StageSpec(
    name="compressed_write",
    kind="bytes",
    outputs=("cache",),
    defaults={"scale_rule": ScaleRule.SCALE_CLAMP.value, **_WRITE_DEFAULTS},
    expected=_expected_model1,
    judge=_judge_model1,
    doc="compressed writer from the bf16 pre-quantisation rows (Q_S by default: the CuTe "
        "compressor, every compressed cache on NVIDIA, datapath 2.4, H1, H7)"))
register(StageSpec(
    name="v41_write",
    kind="bytes",
    outputs=("cache",),
    defaults={"v41_layout": V41Layout.INTERLEAVED.value, "scale_rule": ScaleRule.AMAX_CLAMP.value,
              "nvfp4_rule": Nvfp4ScaleRule.RECIP_MUL.value, "nonfinite": NonFinite.FINITE.value},
    expected=_expected_v41,
    judge=_judge_v41,
    doc="DeepSeek-V4.1 writer of the 528-byte MXFP8 / 288-byte NVFP4 records (cache_v41.insert; "
        "vLLM 0.33.0 interleaved byte order by default, datapath 1.6, H13)"))
register(StageSpec(
    name="plain_write",
    kind="bytes",
    outputs=("cache",),
    defaults={"slot_skip": SlotSkip.ALL_NEGATIVE.value},
    expected=_expected_plain,
    judge=_judge_plain,
    doc="plain bf16 / per-tensor FP8 rows (datapath 2.7)"))
