"""The DSv4 sparse attention stages ``decode`` and ``prefill``: their oracle segments and expected
outputs (judged by ``core.judge_attention``)."""

from __future__ import annotations

import torch

from dsv4_numerics.reference.caches import model1 as cache_model1
from dsv4_numerics.reference.cases import Case
from dsv4_numerics.reference.policies import Fp8Decode, Fp8Flavour, Ue8m0Consumer

from .core import (ATTN_DEFAULTS, ATTN_OUTPUTS, FAST, ORDERED, JudgeScope, StageSpec, Verdict, attention_outputs,
                   index_rule_of, policy_value, judge_attention, prefill_segments, register)


def decode_segments(case: Case, policies: dict, device: str | torch.device | None = None) -> list:
    """The oracle segments of a ``decode`` case: ``[SWA, compressed?]`` over the exactly
    dequantised 584-byte caches (SWA in the declared ``fp8`` flavour; compressed always OCP).
    ``device``: dequantise there (the reference gives the same bits on every device; a production
    cache dequantised on the GPU takes milliseconds instead of seconds); None: where the case is."""
    from dsv4_numerics.reference.attention.ordered import Segment
    from dsv4_numerics.reference.policies import IndexRule

    inp = case.inputs

    def on(x):
        return x if x is None or device is None else x.to(device)

    rule = IndexRule(index_rule_of(case, policies))
    read = policy_value(policies, "fp8_decode", Fp8Decode.EXACT.value)
    main_rows = cache_model1.dequantize_all(on(inp["swa_cache"]), inp["swa_block_size"],
                                            flavour=policy_value(policies, "fp8", Fp8Flavour.E4M3FN.value),
                                            consumer=policy_value(policies, "ue8m0", Ue8m0Consumer.EXACT.value), read=read)
    segs = [Segment(main_rows, on(inp["swa_indices"]), on(inp.get("swa_lens")), rule)]
    if "extra_cache" in inp:  # the compressed cache is OCP on every platform (datapath 2.3, H8)
        extra_rows = cache_model1.dequantize_all(on(inp["extra_cache"]), inp["extra_block_size"],
                                                 consumer=policy_value(policies, "ue8m0", Ue8m0Consumer.EXACT.value),
                                                 read=read)
        segs.append(Segment(extra_rows, on(inp["extra_indices"]), on(inp.get("extra_lens")), rule))
    return segs


def _expected_decode(case: Case, policies: dict) -> dict:
    # under the fast oracle the caches are dequantised where the attention runs (the kernel's device)
    dev = policy_value(policies, "oracle_device", "cpu") if policy_value(policies, "oracle", ORDERED) == FAST else None
    return attention_outputs(case, policies, case.inputs["q"], decode_segments(case, policies, dev))


def expected_prefill(case: Case, policies: dict) -> dict:
    return attention_outputs(case, policies, case.inputs["q"], prefill_segments(case, policies))


def _judge_attention_stage(case: Case, expected: dict, got: dict, scope: JudgeScope) -> Verdict:
    return judge_attention(case, expected, got, scope, ATTN_OUTPUTS)


register(StageSpec(
    name="decode",
    kind="numeric",
    outputs=ATTN_OUTPUTS,
    defaults=dict(ATTN_DEFAULTS, fp8=Fp8Flavour.E4M3FN.value, fp8_decode=Fp8Decode.EXACT.value),
    expected=_expected_decode,
    judge=_judge_attention_stage,
    doc="sparse decode: one softmax over SWA + compressed segments, sink (attention 2, 7)"))
register(StageSpec(
    name="prefill",
    kind="numeric",
    outputs=ATTN_OUTPUTS,
    defaults=dict(ATTN_DEFAULTS),
    expected=expected_prefill,
    judge=_judge_attention_stage,
    doc="sparse prefill over the bf16 workspace, one combined segment (attention 1.4, 2)"))
