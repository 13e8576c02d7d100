"""The DeepSeek-V4.1 cache stages beyond the writer (datapath 1.6, 4.5, hazard H13), registered in
``oracles.stages.STAGES`` on import (``oracles.stages`` imports this module).

``v41_gather`` (bytes)
    Dequantise-gather of V4.1 records by block table into a bf16 workspace (vLLM 0.33.0
    ``dequantize_and_gather_k_cache`` on a 528-byte MXFP8 or 288-byte NVFP4 cache). Reference:
    ``cache_v41.gather`` (``cache_v41.dequantize_slots`` of the rows ``gather_plan`` names), under
    the policies ``v41_layout`` (byte order the kernel reads) and ``ue8m0`` (MXFP8 scale bytes 0/255;
    ``Ue8m0Consumer``). Judged bit-exact over the gathered rows (``stages.judge_gather_rows``); a
    failure is explained by the other byte order (H13: the same bytes per token, misread) and
    the other UE8M0 consumers.
    Case inputs (``reference/cases/v41.py``): ``cache`` uint8 ``[num_blocks, page_stride]`` written
    by ``cache_v41.insert`` (the vLLM producer, interleaved) over stale garbage, ``record``,
    ``block_table`` int32 ``[R, max_blocks]``, ``seq_lens`` / ``gather_lens`` int32 ``[R]`` (or
    None), ``offset``, ``block_size``, ``num_blocks``, ``page_stride``, ``written_slots``.
    Canonical output: ``out`` bf16 ``[R, offset + max(g), 512]`` (rows not gathered are not compared).

The other V4.1 producers map onto existing stages, where their contract is the same:

==========================================  ================  ====================================
vLLM 0.33.0 function (``deepseek_v41/...``)  stage             contract difference
==========================================  ================  ====================================
``quantize_and_insert_k_cache`` (528 B)     ``v41_write``     none (``slot_skip = minus1_only``)
``rope_quant_insert`` (528 B / 288 B)       ``v41_write``     fed an identity table: all 256 pairs
                                                              rotated in fp32, ``writer_rope =
                                                              identity_all``
``compute_global_topk_indices_and_lens``    ``topk_global``   none
``combine_topk_swa_indices``                ``combine_prefill`` no vision columns (cases with image
                                                              spans are not this builder's)
``build_flashinfer_mixed_sparse_indices``   ``flashinfer_mixed`` ``replay_start`` (required; the case's,
                                                              modelled by the reference; zeros = V4), no DSpark non-causal
                                                              decode rows, no vision, no ``num_rows``
==========================================  ================  ====================================
"""

from __future__ import annotations

import torch

from dsv4_numerics.reference.caches import v41 as cache_v41
from dsv4_numerics.reference.cases import Case
from dsv4_numerics.reference.policies import E2m1Zero, Ue8m0Consumer, V41Layout

from .core import JudgeScope, StageSpec, Verdict, policy_value, judge_gather_rows, register

__all__ = ["V41_GATHER_DEFAULTS"]

V41_GATHER_DEFAULTS = {"v41_layout": V41Layout.INTERLEAVED.value, "ue8m0": Ue8m0Consumer.EXACT.value,
                       "e2m1_zero": E2m1Zero.SIGNED.value}


def _expected_v41_gather(case: Case, policies: dict) -> dict:
    inp = case.inputs
    out, valid = cache_v41.gather(
        inp["cache"], inp["block_table"], inp["seq_lens"], inp["block_size"], inp["record"],
        policy_value(policies, "v41_layout", V41Layout.INTERLEAVED.value), inp.get("gather_lens"),
        consumer=policy_value(policies, "ue8m0", Ue8m0Consumer.EXACT.value), offset=inp.get("offset", 0),
        e2m1_zero=policy_value(policies, "e2m1_zero", E2m1Zero.SIGNED.value))
    return {"out": out, "_valid": valid}


def _v41_gather_alternatives(case: Case, policies: dict) -> dict[str, torch.Tensor]:
    """The gather under each single other policy: the other byte order (H13), and for MXFP8 the
    other UE8M0 consumers."""
    alts = {}
    layout = policy_value(policies, "v41_layout", V41Layout.INTERLEAVED.value)
    for other in V41Layout:
        if other.value != layout:
            alts[f"v41_layout={other.value} (the cache read in the other byte order, H13)"] = \
                _expected_v41_gather(case, dict(policies, v41_layout=other.value))["out"]
    if case.inputs["record"] == "mxfp8_528":
        ue = policy_value(policies, "ue8m0", Ue8m0Consumer.EXACT.value)
        for c in (Ue8m0Consumer.EXACT, Ue8m0Consumer.TRITON, Ue8m0Consumer.CUTE):
            if c.value != ue:
                alts[f"ue8m0={c.value} (scale bytes 0/255 decoded by another consumer)"] = \
                    _expected_v41_gather(case, dict(policies, ue8m0=c.value))["out"]
    if case.inputs["record"] == "nvfp4_288":
        z = policy_value(policies, "e2m1_zero", E2m1Zero.SIGNED.value)
        for other in E2m1Zero:
            if other.value != z:
                alts[f"e2m1_zero={other.value} (E2M1 code 0x8 read as the other signed zero)"] = \
                    _expected_v41_gather(case, dict(policies, e2m1_zero=other.value))["out"]
    return alts


def _judge_v41_gather(case: Case, expected: dict, got: dict, scope: JudgeScope) -> Verdict:
    return judge_gather_rows(expected, got, lambda: _v41_gather_alternatives(case, scope.policies))


register(StageSpec(
    name="v41_gather",
    kind="bytes",
    outputs=("out",),
    defaults=dict(V41_GATHER_DEFAULTS),
    expected=_expected_v41_gather,
    judge=_judge_v41_gather,
    doc="dequantise + gather of DeepSeek-V4.1 528-byte MXFP8 / 288-byte NVFP4 records by block table "
        "(cache_v41.gather; datapath 1.6, 4.5, H13)"))
