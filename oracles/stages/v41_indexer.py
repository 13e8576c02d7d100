"""The ``v41_indexer_k_store`` stage: vLLM 0.33.0's DeepSeek-V4.1 ``indexer_k_norm_rope_store``
(k_norm, RoPE, FP8 or MXFP4 quantisation, paged store), registered in ``oracles.stages.STAGES``
on import. Reference: ``reference.caches.indexer_v41.insert_indexer_k`` under the entry's
``rope_arith`` and ``indexer_k_scale`` (only ``fp32`` is modelled).

Bytes, bit-exact: the cases' ``k_pre`` rows are exact-norm rows, on which the kernel's RMS norm is
exact (``reference.pipeline.query_quant``); every later step is modelled bit for bit. Output
``cache``: uint8 ``[num_blocks, block_size, row_bytes]`` after the store (every byte compared;
bytes of tokens not written must keep the stale input). A failure names the differing tokens'
slots and whether the values or the scale bytes differ.
"""

from __future__ import annotations

import torch

from dsv4_numerics.reference.caches.indexer_v41 import indexer_row_bytes, insert_indexer_k
from dsv4_numerics.reference.cases import Case
from dsv4_numerics.reference.errors import UnsupportedCase
from dsv4_numerics.reference.policies import IndexerKScale, RopeArithmetic

from .core import JudgeScope, StageSpec, Verdict, policy_value, register

__all__ = ["V41_INDEXER_DEFAULTS"]

V41_INDEXER_DEFAULTS = {"rope_arith": RopeArithmetic.FMA_TRITON.value, "indexer_k_scale": IndexerKScale.FP32.value}


def _expected(case: Case, policies: dict) -> dict:
    if policy_value(policies, "indexer_k_scale", IndexerKScale.FP32.value) != IndexerKScale.FP32.value:
        raise UnsupportedCase("indexer_k_scale=ue8m0_x4 (pack_ue8m0_x4 scales) is not modelled")
    i = case.inputs
    return {"cache": insert_indexer_k(i["cache"], i["k_pre"], i["positions"], i["cos_sin"], i["weight"], i["eps"],
                                      i["slots"], i["compress_ratio"], i["record"],
                                      policy_value(policies, "rope_arith", RopeArithmetic.FMA_TRITON.value))}


def _judge(case: Case, expected: dict, got: dict, scope: JudgeScope) -> Verdict:
    if "cache" not in got:
        return Verdict(False, "cache:missing", f"the kernel returned no 'cache' (got {sorted(got)})", headroom=0.0)
    g = got["cache"].detach().cpu()
    w = expected["cache"]
    if g.dtype != torch.uint8 or tuple(g.shape) != tuple(w.shape):
        return Verdict(False, "cache:shape", f"cache {g.dtype} {tuple(g.shape)}, expected uint8 {tuple(w.shape)}",
                       headroom=0.0)
    if torch.equal(g, w):
        return Verdict(True, "bit_exact", headroom=float("inf"))
    nb, bs, rb = w.shape
    vw = rb - 4
    pg, pw = g.reshape(nb, bs * rb), w.reshape(nb, bs * rb)
    vals = (pg[:, :bs * vw] != pw[:, :bs * vw]).reshape(nb, bs, vw).any(2)
    scales = (pg[:, bs * vw:] != pw[:, bs * vw:]).reshape(nb, bs, 4).any(2)
    slots_v = (vals.flatten().nonzero().flatten()).tolist()
    slots_s = (scales.flatten().nonzero().flatten()).tolist()
    return Verdict(False, "cache:bit_exact", f"indexer records differ: values at slots {slots_v[:8]}, scale bytes "
                   f"at slots {slots_s[:8]} ({case.inputs['record']}, row {indexer_row_bytes(case.inputs['record'])} B)",
                   headroom=0.0, details={"value_slots": slots_v, "scale_slots": slots_s})


register(StageSpec(
    name="v41_indexer_k_store",
    kind="bytes",
    outputs=("cache",),
    defaults=dict(V41_INDEXER_DEFAULTS),
    expected=_expected,
    judge=_judge,
    doc="DeepSeek-V4.1 indexer K store (indexer_k_norm_rope_store): k_norm, RoPE at the group start, "
        "FP8 + fp32 scale or MXFP4 records; bit-exact on exact-norm rows"))
