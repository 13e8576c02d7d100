"""The DSv4 sparse attention stages ``decode`` and ``prefill``: their oracle segments and expected
outputs (judged by ``core.judge_attention``)."""

from __future__ import annotations

import torch

from dsv4_numerics.reference.caches import model1 as cache_model1
from dsv4_numerics.reference.cases import Case
from dsv4_numerics.reference.policies import Fp8Decode, Fp8Flavour, Ue8m0Consumer

from .core import (_ATTN_DEFAULTS, _ATTN_OUTPUTS, FAST, ORDERED, JudgeScope, StageSpec, Verdict, _attention_outputs,
                   _flag, _index_rule, _pol, judge_attention, prefill_segments, register)


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

    rule = IndexRule(_index_rule(case, policies))
    read = _pol(policies, "fp8_decode", Fp8Decode.EXACT.value)
    main_rows, main_idx = rows_of(on(inp["swa_cache"]), inp["swa_block_size"], on(inp["swa_indices"]),
                                  flavour=_pol(policies, "fp8", Fp8Flavour.E4M3FN.value),
                                  consumer=_pol(policies, "ue8m0", Ue8m0Consumer.EXACT.value))
    segs = [Segment(main_rows, main_idx, on(inp.get("swa_lens")), rule)]
    if "extra_cache" in inp:  # the compressed cache is OCP on every platform (datapath 2.3, H8)
        extra_rows, extra_idx = rows_of(on(inp["extra_cache"]), inp["extra_block_size"], on(inp["extra_indices"]),
                                        consumer=_pol(policies, "ue8m0", Ue8m0Consumer.EXACT.value))
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
    dev = _pol(policies, "oracle_device", "cpu") if _pol(policies, "oracle", ORDERED) == FAST else None
    # judged on the device (matrix.run_entry(judge_device=True)): only the slots the indices read
    segs = decode_segments(case, policies, dev, compact=_flag(policies, "judge_device"))
    return _attention_outputs(case, policies, case.inputs["q"], segs)


def _expected_prefill(case: Case, policies: dict) -> dict:
    return _attention_outputs(case, policies, case.inputs["q"], prefill_segments(case, policies))


def _judge_attention_stage(case: Case, expected: dict, got: dict, scope: JudgeScope) -> Verdict:
    return judge_attention(case, expected, got, scope, _ATTN_OUTPUTS)


register(StageSpec("decode", "numeric", _ATTN_OUTPUTS,
                   dict(_ATTN_DEFAULTS, fp8=Fp8Flavour.E4M3FN.value, fp8_decode=Fp8Decode.EXACT.value),
                   _expected_decode, _judge_attention_stage,
                   "sparse decode: one softmax over SWA + compressed segments, sink (attention 2, 7)"))
register(StageSpec("prefill", "numeric", _ATTN_OUTPUTS, dict(_ATTN_DEFAULTS), _expected_prefill, _judge_attention_stage,
                   "sparse prefill over the bf16 workspace, one combined segment (attention 1.4, 2)"))
