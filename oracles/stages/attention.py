"""The DSv4 sparse attention stages ``decode`` and ``prefill``: their oracle segments and expected
outputs (judged by ``core.judge_attention``)."""

from __future__ import annotations

import torch

from dsv4_numerics.reference.caches import model1 as cache_model1
from dsv4_numerics.reference.cases import Case
from dsv4_numerics.reference.policies import Fp8Decode, Fp8Flavour, Ue8m0Consumer

from .core import (ATTN_DEFAULTS, ATTN_OUTPUTS, FAST, ORDERED, JudgeScope, StageSpec, Verdict, attention_outputs,
                   flag_policy, index_rule_of, policy_value, judge_attention, prefill_segments, register)


def decode_segments(case: Case, policies: dict, device: str | torch.device | None = None,
                    compact: bool = False) -> list:
    """The oracle segments of a ``decode`` case: ``[SWA, compressed?]`` over the exactly
    dequantised 584-byte caches (SWA in the declared ``fp8`` flavour; compressed always OCP).
    ``device``: dequantise there (the reference gives the same bits on every device; a production
    cache dequantised on the GPU takes milliseconds instead of seconds); None: where the case is.
    ``compact``: dequantise only the slots some in-range index value reads (``_compact``), not the
    whole cache: the same row values at every valid slot, so the same oracle results, in a
    fraction of the memory and time (a batch-128 C128A case's SWA cache holds two million slots,
    its indices read 16 thousand)."""
    from dsv4_numerics.reference.attention.ordered import Segment
    from dsv4_numerics.reference.policies import IndexRule

    inp = case.inputs

    def on(x):
        return x if x is None or device is None else x.to(device)

    def rows_of(cache, bs, idx, **kw):
        if not compact:
            return cache_model1.dequantize_all(cache, bs, read=read, **kw), idx
        return _compact(cache, bs, idx, read=read, **kw)

    rule = IndexRule(index_rule_of(case, policies))
    read = policy_value(policies, "fp8_decode", Fp8Decode.EXACT.value)
    main_rows, main_idx = rows_of(on(inp["swa_cache"]), inp["swa_block_size"], on(inp["swa_indices"]),
                                  flavour=policy_value(policies, "fp8", Fp8Flavour.E4M3FN.value),
                                  consumer=policy_value(policies, "ue8m0", Ue8m0Consumer.EXACT.value))
    segs = [Segment(main_rows, main_idx, on(inp.get("swa_lens")), rule)]
    if "extra_cache" in inp:  # the compressed cache is OCP on every platform (datapath 2.3, H8)
        extra_rows, extra_idx = rows_of(on(inp["extra_cache"]), inp["extra_block_size"], on(inp["extra_indices"]),
                                        consumer=policy_value(policies, "ue8m0", Ue8m0Consumer.EXACT.value))
        segs.append(Segment(extra_rows, extra_idx, on(inp.get("extra_lens")), rule))
    return segs


def _compact(cache: torch.Tensor, block_size: int, idx: torch.Tensor, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows, idx')``: the dequantised rows of the distinct in-range slots ``u_0 < u_1 < ...`` that
    ``idx`` holds (any column: past-length columns too), and ``idx`` renumbered onto them: an
    in-range value ``u_i`` becomes ``i``, a value ``v >= S`` (``S`` slots in the cache) becomes ``v -
    S + len(u)`` (out of range still, by as much), a negative value stays. Every index rule reads the
    same row (or the same invalidity) at every column, and the renumbering keeps the slots' order,
    so ``v_rms`` and ``logit_scale`` see the same values in the same order. At least one row (slot 0
    when no value is in range), so a segment never has zero rows."""
    nb, bs, _ = cache_model1.cache_geometry("decode_segments", cache, block_size)
    S = nb * bs
    i64 = idx.to(torch.int64)
    inr = (i64 >= 0) & (i64 < S)
    used = torch.unique(i64[inr], sorted=True)
    if used.numel() == 0:
        used = torch.zeros(1, dtype=torch.int64, device=idx.device)
    rows = cache_model1.dequantize_slots(cache, used, block_size, **kw)
    renum = torch.where(inr, torch.searchsorted(used, i64), torch.where(i64 >= S, i64 - S + used.numel(), i64))
    return rows, renum.to(idx.dtype)


def _expected_decode(case: Case, policies: dict) -> dict:
    # under the fast oracle the caches are dequantised where the attention runs (the kernel's device)
    dev = policy_value(policies, "oracle_device", "cpu") if policy_value(policies, "oracle", ORDERED) == FAST else None
    # judged on the device (matrix.run_entry(judge_device=True)): only the slots the indices read
    segs = decode_segments(case, policies, dev, compact=flag_policy(policies, "judge_device"))
    return attention_outputs(case, policies, case.inputs["q"], segs)


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
