"""Kernel entries of the rest of the MLA family the DSv4 kernels also serve:
DeepSeek-V3.2 sparse decode over the 656-byte cache, and dense paged MLA decode / prefill of
DeepSeek-R1/V3 and Kimi (stages ``v32_decode``, ``dense_mla_decode``, ``dense_mla_prefill`` of
``reference.cases.mla``).

Entries (all production imports are lazy, inside probes and calls):

==========================================  ==================  =========  ==========================
entry                                       stage               archs      production entry point
==========================================  ==================  =========  ==========================
``flashmla.v32_sparse_decode.sm90``         v32_decode          sm90       ``flash_mla_with_kvcache``
                                                                           (indices, fp8, d_qk 576)
``flashmla.v32_sparse_decode.sm100``        v32_decode          sm100/103  same (head64 / head64x2)
``flashmla.dense_decode.sm90``              dense_mla_decode    sm90       ``flash_mla_with_kvcache``
                                                                           (block_table, causal, bf16)
``flashmla.dense_decode_fp8.sm90``          dense_mla_decode    sm90       ``torch.ops._flashmla_extension_C
                                                                           .fwd_kvcache_mla_fp8``
==========================================  ==================  =========  ==========================

Every ``call`` takes a canonical case (already on the device) and returns canonical outputs:
``out`` (``[b, s_q, h, 512]`` / prefill ``[T, h, 128]``, the kernel's dtype) and, where the kernel
returns one, ``lse`` in the canonical convention (natural log, sink-free, ``-inf`` for a query with
no visible key; ``[b, s_q, h]``). A case outside a kernel's documented contract raises
``reference.errors.UnsupportedCase`` before anything is launched.

Shape/stride contracts honoured (sources read; vLLM 0.33.0 ``V:``, FlashMLA ``FM:``, FlashInfer
0.7.2.post1 ``FI:``):

* FlashMLA sparse decode: ``q [b, s_q, h_q, 576]`` bf16, ``h_q`` in {64, 128} (other counts are
  zero-padded, sink padded with ``-inf``, as vLLM does, ``V:v1/attention/backends/mla/
  flashmla_sparse.py`` ``_fp8_flash_mla_kernel``); ``k_cache [nb, bs, 1, 656]`` uint8 with
  ``stride(1) == 656`` (``FM:csrc/api/sparse_decode.h`` "The whole block must be contiguous",
  SM90 ``KU_ASSERT(params.stride_kv_row == 656)``), page stride free; ``indices [b, s_q, topk]``
  int32 with ``topk % 64 == 0`` (padded with ``-1``); no ``topk_length`` for V3.2 (SM90
  ``KU_ASSERT(params.topk_length == nullptr, ...)``); LSE comes back as a ``[b, h_q, s_q]`` view,
  natural, ``+inf`` for a lonely query.
* FlashMLA dense decode (``FM:csrc/api/dense_decode.h``): SM90a only, ``q``/``k_cache`` bf16 (or
  fp16), ``k_cache [nb, 64, 1, 576]`` (``page_block_size == 64``), ``block_table`` int32 with a
  contiguous last dim, ``cache_seqlens`` int32 contiguous, ``head_dim_v == 512``; ``causal``
  ignored for ``s_q == 1``.
* FlashMLA dense FP8 (vLLM's ``_flashmla_extension_C``, ``V:v1/attention/ops/flashmla.py:119-150``):
  ``q`` and ``k_cache`` float8_e4m3fn, page 64, ``descale_q``/``descale_k`` fp32 ``[1]``, scheduler
  metadata from ``get_mla_decoding_metadata_dense_fp8(cache_seqlens, s_q * h_q, 1)``; bf16 output.

The same stages' FlashInfer and TokenSpeed entries live with their engines
(``kernels/flashinfer/mla_dense.py``, ``kernels/tokenspeed/mla.py``).
"""

from __future__ import annotations

import torch

from dsv4_numerics.reference.caches.v32 import v32_page_view
from dsv4_numerics.reference.constants import (
    FLASHMLA_DENSE_BLOCK_SIZE,
    MLA_D_V,
    V32_HEAD_DIM,
)
from dsv4_numerics.reference.errors import UnsupportedCase, check_rank
from dsv4_numerics.reference.policies import (
    AttentionMode,
    IndexRule,
    LseConvention,
    NanPolicy,
    V32ScaleDecode,
)

from dsv4_numerics.kernels.convert import FLASHMLA_HEADS, dense_mla_inputs, lse_plus_inf_to_minus_inf, pad_heads, pad_topk, padded_heads
from dsv4_numerics.kernels.probe import SM100_ARCHS, all_reasons, import_after_others, needs_arch, needs_staged_vllm
from dsv4_numerics.kernels.registry import KernelEntry

FLASHMLA_INTERFACE = "vllm.third_party.flashmla.flash_mla_interface"
FLASHMLA_EXTENSION = "vllm._flashmla_extension_C"
FLASHMLA_TOPK_BLOCK = 64  # FlashMLA decode: topk % 64 == 0 (SM90 TOPK_BLOCK_SIZE, SM100 B_TOPK)


# --------------------------------------------------------------------------- probes


_flashmla_sm90 = all_reasons(needs_arch("sm90"), needs_staged_vllm(FLASHMLA_INTERFACE), import_after_others(FLASHMLA_INTERFACE))
_flashmla_sm100 = all_reasons(needs_arch(*SM100_ARCHS), needs_staged_vllm(FLASHMLA_INTERFACE), import_after_others(FLASHMLA_INTERFACE))
_flashmla_fp8_sm90 = all_reasons(needs_arch("sm90"), needs_staged_vllm(FLASHMLA_EXTENSION), import_after_others(FLASHMLA_EXTENSION))


# --------------------------------------------------------------------------- pure conversions


def flashmla_lse_to_canonical(lse_bhs: torch.Tensor) -> torch.Tensor:
    """FlashMLA decode LSE ``[b, h, s_q]`` (natural, ``+inf`` lonely) -> canonical ``[b, s_q, h]``
    float32 (natural, ``-inf`` lonely)."""
    check_rank("flashmla_lse_to_canonical", "lse_bhs", lse_bhs, 3)
    return lse_plus_inf_to_minus_inf(lse_bhs.transpose(1, 2).contiguous())


def v32_kernel_cache(cache: torch.Tensor, block_size: int) -> torch.Tensor:
    """Canonical V32 cache -> FlashMLA's ``k_cache [nb, bs, 1, 656]`` uint8 view (strides
    ``(page_stride, 656, 656, 1)``), no copy. ``stride(1) == 656`` as FlashMLA requires."""
    v = v32_page_view(cache, block_size)
    return v.as_strided((v.shape[0], v.shape[1], 1, v.shape[2]), (v.stride(0), v.stride(1), v.stride(1), 1),
                        v.storage_offset())


# --------------------------------------------------------------------------- FlashMLA V3.2 sparse decode


def _flashmla_v32_call(case) -> dict:
    inp = case.inputs
    q = inp["q"]
    b, s_q, h, d = q.shape
    if d != V32_HEAD_DIM or q.dtype != torch.bfloat16:
        raise UnsupportedCase(f"FlashMLA V3.2 decode takes bf16 q with d_qk 576 (got {q.dtype}, {d})")
    if inp["d_v"] != MLA_D_V:
        raise UnsupportedCase(f"FlashMLA decode supports head_dim_v 512 only (got {inp['d_v']})")
    hp = padded_heads(h, FLASHMLA_HEADS, "FlashMLA sparse decode")
    qp, sink = pad_heads(q.reshape(b * s_q, h, d), inp["sink"], hp)
    qp = qp.reshape(b, s_q, hp, d).contiguous()
    idx = inp["indices"]
    topk = idx.shape[-1]
    idx = pad_topk(idx.reshape(b * s_q, topk), FLASHMLA_TOPK_BLOCK).reshape(b, s_q, -1).contiguous()
    kv = v32_kernel_cache(inp["kv_cache"], inp["block_size"])
    from vllm.third_party.flashmla.flash_mla_interface import flash_mla_with_kvcache, get_mla_metadata

    sched, _ = get_mla_metadata()
    out, lse = flash_mla_with_kvcache(
        q=qp, k_cache=kv, block_table=None, cache_seqlens=None, head_dim_v=MLA_D_V,
        tile_scheduler_metadata=sched, num_splits=None, softmax_scale=float(inp["scale"]),
        causal=False, is_fp8_kvcache=True, indices=idx,
        attn_sink=None if sink is None else sink.contiguous(),
    )
    return {"out": out[:, :, :h], "lse": flashmla_lse_to_canonical(lse)[:, :, :h]}


_V32_NOTES = ("V3.2 656-byte cache: only -1 is an invalid index (other negatives are addresses); "
              "no topk_length for V3.2 on SM90; fp32 tile scales applied through bf16 (SM90) ")

_V32_COMMON = dict(
    stage="v32_decode",
    family="CUDA",
    source=f"{FLASHMLA_INTERFACE}.flash_mla_with_kvcache",
    dtypes=("bfloat16", "uint8"),
    call=_flashmla_v32_call,
)


# --------------------------------------------------------------------------- dense decode: FlashMLA


def _kv4(kv: torch.Tensor, bs: int) -> torch.Tensor:
    """``[nb, bs, D]`` -> ``[nb, bs, 1, D]`` (FlashMLA) without a copy."""
    if kv.dim() == 4:
        return kv
    return kv.unsqueeze(2)


def _flashmla_dense_call(case) -> dict:
    inp, q, kv, bs, bt, seq = dense_mla_inputs(case)
    if q.dtype != torch.bfloat16:
        raise UnsupportedCase(f"FlashMLA dense decode entry covers bf16 caches (got {q.dtype}; "
                              "FP8 is flashmla.dense_decode_fp8.sm90)")
    if bs != FLASHMLA_DENSE_BLOCK_SIZE:
        raise UnsupportedCase(f"FlashMLA dense decode needs page_block_size 64 (got {bs})")
    from vllm.third_party.flashmla.flash_mla_interface import flash_mla_with_kvcache, get_mla_metadata

    sched, _ = get_mla_metadata()
    out, lse = flash_mla_with_kvcache(
        q=q.contiguous(), k_cache=_kv4(kv, bs), block_table=bt, cache_seqlens=seq, head_dim_v=MLA_D_V,
        tile_scheduler_metadata=sched, num_splits=None, softmax_scale=float(inp["softmax_scale"]),
        causal=bool(inp["causal"]), is_fp8_kvcache=False,
    )
    return {"out": out, "lse": flashmla_lse_to_canonical(lse)}


def _flashmla_dense_fp8_call(case) -> dict:
    inp, q, kv, bs, bt, seq = dense_mla_inputs(case)
    if q.dtype != torch.float8_e4m3fn:
        raise UnsupportedCase(f"FlashMLA dense FP8 decode takes float8_e4m3fn q and cache (got {q.dtype})")
    if bs != FLASHMLA_DENSE_BLOCK_SIZE:
        raise UnsupportedCase(f"FlashMLA dense FP8 decode needs page_block_size 64 (got {bs})")
    b, s_q, h, _ = q.shape
    import vllm._flashmla_extension_C  # noqa: F401, PLC0415  (registers torch.ops._flashmla_extension_C)

    ops = torch.ops._flashmla_extension_C
    tile_md, num_splits = ops.get_mla_decoding_metadata_dense_fp8(seq, s_q * h, 1)
    dq = torch.tensor([float(inp["q_scale"])], dtype=torch.float32, device=q.device)
    dk = torch.tensor([float(inp["kv_scale"])], dtype=torch.float32, device=q.device)
    out, lse = ops.fwd_kvcache_mla_fp8(q.contiguous(), _kv4(kv, bs), MLA_D_V, seq, bt,
                                       float(inp["softmax_scale"]), bool(inp["causal"]), tile_md, num_splits, dq, dk)
    return {"out": out, "lse": flashmla_lse_to_canonical(lse)}


_DENSE_POLICIES = {
    "lse": LseConvention.NATURAL_SINKFREE.value,
    "nan": NanPolicy.PROPAGATE.value,
    "attention_mode": AttentionMode.BF16_P.value,
}


ENTRIES: list[KernelEntry] = [
    KernelEntry(
        name="flashmla.v32_sparse_decode.sm90",
        archs=("sm90",),
        policies={
            "index_rule": IndexRule.MINUS1_ONLY.value,
            "lse": LseConvention.NATURAL_SINKFREE.value,
            "nan": NanPolicy.PROPAGATE.value,
            "attention_mode": AttentionMode.BF16_P.value,
            # FM splitkv_mla.cuh V32 branch: scales[i] = (bf16)scales_float[i]; cvt_fp8x8_bf16x8 (bf16 mul)
            "v32_scale_decode": V32ScaleDecode.BF16_RNE.value,
        },
        tolerance_scope="flashmla.v32_sparse_decode",
        probe=_flashmla_sm90,
        notes=_V32_NOTES + "(splitkv_mla.cuh `(bf16)scales_float`).",
        **_V32_COMMON,

    ),
    KernelEntry(
        name="flashmla.v32_sparse_decode.sm100",
        archs=SM100_ARCHS,
        policies={
            "index_rule": IndexRule.MINUS1_ONLY.value,
            "lse": LseConvention.NATURAL_SINKFREE.value,
            "nan": NanPolicy.PROPAGATE.value,
            "attention_mode": AttentionMode.BF16_P.value,
            # FM 9241ae3 csrc/sm100/decode/head64/kernel.cuh:705-709: fp32 scale -> e8m0 with RZ
            # (datapath 1.5, attention.md 6). Fixed upstream (FlashMLA 5aa668c / #184, bf16 RNE).
            # The vLLM 0.33.0 _flashmla_C.abi3.so still carries it: its sm_100 SASS has 16
            # F2FP.E8.F32.PACK_AB_MERGE_C.RZ (fp32 -> e8m0, round toward zero), all in the two
            # legacy::sm100::decode::sparse::head64 kernels instantiated with ModelType 0 (V3.2 by
            # inference: the MODEL1 kernels use ModelType 2/3) -- cuobjdump, read on an H200 host.
            # Not executed (no SM100): tests/mla/test_mla_gpu.py checks it is the best-fitting policy.
            "v32_scale_decode": V32ScaleDecode.SM100_RZ_E8M0.value,
        },
        tolerance_scope="flashmla.v32_sparse_decode",
        probe=_flashmla_sm100,
        notes=_V32_NOTES + "(SM100 head64: e8m0 round-toward-zero, FM 9241ae3 and the vLLM 0.33.0 SASS; h_q=128 "
              "runs head64 twice). Not run on hardware by its author (no SM100).",
        **_V32_COMMON,

    ),
    KernelEntry(
        name="flashmla.dense_decode.sm90",
        stage="dense_mla_decode",
        family="CUDA",
        source=f"{FLASHMLA_INTERFACE}.flash_mla_with_kvcache",
        archs=("sm90",),
        dtypes=("bfloat16",),
        policies=dict(_DENSE_POLICIES),
        tolerance_scope="flashmla.dense_decode",
        probe=_flashmla_sm90,
        call=_flashmla_dense_call,
        notes="SM90a only; page_block_size 64; causal bottom-right for s_q > 1 (FM dense_decode.h).",

    ),
    KernelEntry(
        name="flashmla.dense_decode_fp8.sm90",
        stage="dense_mla_decode",
        family="CUDA",
        source=f"{FLASHMLA_EXTENSION}.fwd_kvcache_mla_fp8",
        archs=("sm90",),
        dtypes=("float8_e4m3fn",),
        policies={"lse": LseConvention.NATURAL_SINKFREE.value, "nan": NanPolicy.PROPAGATE.value, "fp8_q": "true"},
        tolerance_scope="flashmla.dense_decode_fp8",
        probe=_flashmla_fp8_sm90,
        call=_flashmla_dense_fp8_call,
        notes="vLLM's FP8 dense FlashMLA (FP8 q and cache, per-tensor descale_q/descale_k); SM90 only.",

    ),
]


# The releases each entry is written for (``KernelEntry.releases``, set by ``registry.assemble``), from the survey (``python -m
# dsv4_numerics.staging.survey``): the interface and ``_flashmla_extension_C`` ship in every surveyed release;
# ``enable_batch_invariant`` (0.33.0) is never passed.
RELEASE_RANGES = {
    "flashmla.v32_sparse_decode.sm90": "vllm>=0.22.0",
    "flashmla.v32_sparse_decode.sm100": "vllm>=0.22.0",
    "flashmla.dense_decode.sm90": "vllm>=0.22.0",
    "flashmla.dense_decode_fp8.sm90": "vllm>=0.22.0",
}
