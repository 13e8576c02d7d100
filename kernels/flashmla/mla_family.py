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
``flashinfer.mla_decode.trtllm_gen``        dense_mla_decode    sm100/103  ``trtllm_batch_decode_with_kv_
                                                                           cache_mla(backend="trtllm-gen")``
``flashinfer.mla_decode.cute_dsl``          dense_mla_decode    sm100/103  same, ``backend="cute-dsl"``
``tokenspeed_mla.decode``                   dense_mla_decode    sm100/103  ``tokenspeed_mla.tokenspeed_mla_decode``
``tokenspeed_mla.prefill``                  dense_mla_prefill   sm100/103  ``tokenspeed_mla.tokenspeed_mla_prefill``
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
* FlashInfer ``trtllm_batch_decode_with_kv_cache_mla`` (``FI:mla/_core.py:3811-4560``): ``query
  [B, q_len, H, 576]`` and ``kv_cache [nb, 1, bs, 576]`` of one dtype (bf16 or fp8), ``bs`` in
  {32, 64}, ``block_tables`` int32 whose width is a multiple of ``128 / bs`` (padded here with a
  page the request never reads), ``seq_lens`` int32, ``bmm1_scale = softmax_scale * q_scale *
  k_scale``, ``bmm2_scale = k_scale`` (vLLM ``flashinfer_mla.py:370-378``), workspace 128 MiB
  zeroed int8 (vLLM's ``FLASHINFER_MLA_WORKSPACE_BUFFER_SIZE``), ``return_lse=True`` with
  ``return_lse_base="basee"``; trtllm-gen rejects ``64 < H < 128``.
* TokenSpeed decode (``tokenspeed_mla.tokenspeed_mla_decode``): ``query [B, q_len, H, 576]``,
  ``kv_cache [nb, bs, 576]`` of the query dtype, ``bs`` in {32, 64}, ``q_len`` 1..4 (vLLM sizes
  its workspace for up to 8), ``softmax_scale = bmm1``, ``output_scale = bmm2``, workspace int8,
  LSE base 2 (``lse_base_on_e = False`` in ``V:v1/attention/backends/mla/tokenspeed_mla.py``),
  causal bound ``seq_len - (q_len - 1) + q_tok``. DeepSeek-R1 dims only (kv_lora 512, rope 64).
* TokenSpeed prefill: ragged ``q [T, H, 192]``, ``k [T, H, 192]``, ``v [T, H, 128]`` (contiguous;
  vLLM forces ``v.contiguous()``), ``cum_seq_lens`` int32, ``is_causal``; bf16 output; LSE not
  requested (its base is not documented).
"""

from __future__ import annotations

import functools
import math

import torch

from dsv4_numerics.reference.caches.v32 import v32_page_view
from dsv4_numerics.reference.constants import (
    FLASHMLA_DENSE_BLOCK_SIZE,
    MLA_D_QK,
    MLA_D_V,
    MLA_KV_LORA_RANK,
    MLA_QK_ROPE_DIM,
    R1_QK_NOPE_DIM,
    R1_V_HEAD_DIM,
    V32_HEAD_DIM,
)
from dsv4_numerics.reference.errors import UnsupportedCase, check_rank, check_tensor
from dsv4_numerics.reference.policies import (
    AttentionMode,
    IndexRule,
    LseConvention,
    NanPolicy,
    V32ScaleDecode,
)

from dsv4_numerics.kernels.convert import FLASHINFER_HEADS, FLASHMLA_HEADS, lse_plus_inf_to_minus_inf, pad_heads, pad_topk, padded_heads, round_up
from dsv4_numerics.kernels.probe import needs_arch, needs_import, needs_module, needs_staged_vllm
from dsv4_numerics.kernels.registry import KernelEntry

FLASHMLA_INTERFACE = "vllm.third_party.flashmla.flash_mla_interface"
FLASHMLA_EXTENSION = "vllm._flashmla_extension_C"
FLASHINFER_MODULE = "flashinfer.mla"
TOKENSPEED_MODULE = "tokenspeed_mla"
FLASHMLA_TOPK_BLOCK = 64  # FlashMLA decode: topk % 64 == 0 (SM90 TOPK_BLOCK_SIZE, SM100 B_TOPK)
FLASHINFER_WORKSPACE_BYTES = 128 * 1024 * 1024  # vLLM FLASHINFER_MLA_WORKSPACE_BUFFER_SIZE
FLASHINFER_PAGE_SIZES = (32, 64)  # trtllm-gen "requires block_size in (32, 64)"
TOKENSPEED_PAGE_SIZES = (32, 64)  # vLLM TokenspeedMLABackend.get_supported_kernel_block_sizes
TOKENSPEED_MAX_Q_LEN = 4  # tokenspeed_mla_decode_with_kvcache traits: q_len in {1, 2, 3, 4}
LN2 = math.log(2.0)
SM100_ARCHS = ("sm100", "sm103")


# --------------------------------------------------------------------------- probes


def all_reasons(*probes) -> "callable":
    """A cached probe that reports *every* failing requirement joined by ``"; "`` (e.g. both
    "needs sm100/sm103 (found sm90 ...)" and "flashinfer-python not installed"), so a reader on
    an H200 learns everything that is missing at once. Import probes run only when the cheap
    ones before them pass (they have side effects)."""

    @functools.lru_cache(maxsize=None)
    def probe() -> str | None:
        reasons = []
        for p in probes:
            if getattr(p, "_after_ok", False) and reasons:
                continue
            r = p()
            if r:
                reasons.append(str(r))
        return "; ".join(reasons) if reasons else None

    return probe


def _last(p):
    """Mark an (import) probe to run only when every probe before it passed."""
    p._after_ok = True  # noqa: SLF001
    return p


def _imp(module: str):
    return _last(needs_import(module))


_flashmla_sm90 = all_reasons(needs_arch("sm90"), needs_staged_vllm(FLASHMLA_INTERFACE), _imp(FLASHMLA_INTERFACE))
_flashmla_sm100 = all_reasons(needs_arch(*SM100_ARCHS), needs_staged_vllm(FLASHMLA_INTERFACE), _imp(FLASHMLA_INTERFACE))
_flashmla_fp8_sm90 = all_reasons(needs_arch("sm90"), needs_staged_vllm(FLASHMLA_EXTENSION), _imp(FLASHMLA_EXTENSION))
_flashinfer_sm100 = all_reasons(needs_arch(*SM100_ARCHS), needs_module("flashinfer", "flashinfer-python", "0.7.2"),
                                _imp(FLASHINFER_MODULE))
_tokenspeed_sm100 = all_reasons(needs_arch(*SM100_ARCHS), needs_module(TOKENSPEED_MODULE, "tokenspeed-mla"),
                                _imp(TOKENSPEED_MODULE))


# --------------------------------------------------------------------------- pure conversions


def flashmla_lse_to_canonical(lse_bhs: torch.Tensor) -> torch.Tensor:
    """FlashMLA decode LSE ``[b, h, s_q]`` (natural, ``+inf`` lonely) -> canonical ``[b, s_q, h]``
    float32 (natural, ``-inf`` lonely)."""
    check_rank("flashmla_lse_to_canonical", "lse_bhs", lse_bhs, 3)
    return lse_plus_inf_to_minus_inf(lse_bhs.transpose(1, 2).contiguous())


def base2_lse_to_natural(lse2: torch.Tensor) -> torch.Tensor:
    """A base-2 LSE (``log2 sum 2**(s * log2 e)``, TokenSpeed / trtllm-gen default) -> natural log
    (multiply by ``ln 2``); ``+-inf`` unchanged."""
    check_tensor("base2_lse_to_natural", "lse2", lse2)
    return lse2.to(torch.float32) * LN2


def pad_block_table(bt: torch.Tensor, multiple: int, fill: torch.Tensor | int = 0) -> torch.Tensor:
    """``bt [B, M]`` int -> int32 ``[B, round_up(M, multiple)]``; new column ``j`` of row ``r``
    holds ``fill`` (an int, or a ``[B]`` tensor of per-row page ids). Columns a request never
    reads (``>= ceil(seq_len / bs)``) are never dereferenced by a correct kernel."""
    fn = "pad_block_table"
    check_rank(fn, "bt", bt, 2)
    b, m = bt.shape
    mp = round_up(max(m, 1), multiple)
    out = torch.empty((b, mp), dtype=torch.int32, device=bt.device)
    out[:, :m] = bt.to(torch.int32)
    if mp > m:
        if isinstance(fill, torch.Tensor):
            out[:, m:] = fill.to(torch.int32).view(b, 1).to(bt.device)
        else:
            out[:, m:] = int(fill)
    return out.contiguous()


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

FLASHMLA_V32_SM90 = KernelEntry(
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
)

FLASHMLA_V32_SM100 = KernelEntry(
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
)


# --------------------------------------------------------------------------- dense decode: FlashMLA


def _dense_common(case) -> tuple:
    inp = case.inputs
    q, kv = inp["q"], inp["kv_cache"]
    if q.dim() != 4 or q.shape[-1] != MLA_D_QK:
        raise UnsupportedCase(f"MLA decode kernels take q [b, s_q, h, {MLA_D_QK}] (got {tuple(q.shape)})")
    if kv.dtype != q.dtype:
        raise UnsupportedCase(f"q and kv_cache must share a dtype (got {q.dtype}, {kv.dtype})")
    bs = int(inp["block_size"])
    bt = inp["block_table"].to(torch.int32).contiguous()
    seq = inp["seq_lens"].to(torch.int32).contiguous()
    return inp, q, kv, bs, bt, seq


def _kv4(kv: torch.Tensor, bs: int) -> torch.Tensor:
    """``[nb, bs, D]`` -> ``[nb, bs, 1, D]`` (FlashMLA) without a copy."""
    if kv.dim() == 4:
        return kv
    return kv.unsqueeze(2)


def _flashmla_dense_call(case) -> dict:
    inp, q, kv, bs, bt, seq = _dense_common(case)
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
    inp, q, kv, bs, bt, seq = _dense_common(case)
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

FLASHMLA_DENSE_SM90 = KernelEntry(
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
)

FLASHMLA_DENSE_FP8_SM90 = KernelEntry(
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
)


# --------------------------------------------------------------------------- dense decode: FlashInfer


@functools.lru_cache(maxsize=4)
def _fi_workspace(device: str) -> torch.Tensor:
    return torch.zeros(FLASHINFER_WORKSPACE_BYTES, dtype=torch.int8, device=device)


def _flashinfer_call(backend: str):
    def call(case) -> dict:
        inp, q, kv, bs, bt, seq = _dense_common(case)
        if q.dtype not in (torch.bfloat16, torch.float8_e4m3fn):
            raise UnsupportedCase(f"FlashInfer MLA decode takes bf16 or fp8 q/cache (got {q.dtype})")
        if bs not in FLASHINFER_PAGE_SIZES:
            raise UnsupportedCase(f"FlashInfer {backend} MLA decode needs page size 32 or 64 (got {bs})")
        b, s_q, h, _ = q.shape
        if h not in FLASHINFER_HEADS:
            raise UnsupportedCase(f"FlashInfer MLA decode head counts are {FLASHINFER_HEADS} (got {h})")
        bmm1 = float(inp["softmax_scale"]) * float(inp["q_scale"]) * float(inp["kv_scale"])
        bmm2 = float(inp["kv_scale"])
        bt_p = pad_block_table(bt, 128 // bs, fill=bt[:, :1])
        from flashinfer.mla import trtllm_batch_decode_with_kv_cache_mla

        out, lse = trtllm_batch_decode_with_kv_cache_mla(
            query=q.contiguous(), kv_cache=kv.unsqueeze(1), workspace_buffer=_fi_workspace(str(q.device)),
            qk_nope_head_dim=R1_QK_NOPE_DIM, kv_lora_rank=MLA_KV_LORA_RANK, qk_rope_head_dim=MLA_QK_ROPE_DIM,
            block_tables=bt_p, seq_lens=seq, max_seq_len=int(seq.max()), bmm1_scale=bmm1, bmm2_scale=bmm2,
            backend=backend, return_lse=True, return_lse_base="basee",
        )
        return {"out": out, "lse": lse.reshape(b, s_q, h).to(torch.float32)}

    return call


def _flashinfer_entry(backend: str, tag: str) -> KernelEntry:
    return KernelEntry(
        name=f"flashinfer.mla_decode.{tag}",
        stage="dense_mla_decode",
        family="FlashInfer",
        source="flashinfer.mla.trtllm_batch_decode_with_kv_cache_mla",
        archs=SM100_ARCHS,
        dtypes=("bfloat16", "float8_e4m3fn"),
        policies={"lse": LseConvention.NATURAL_SINKFREE.value, "nan": NanPolicy.PROPAGATE.value},
        tolerance_scope=f"flashinfer.mla_decode.{tag}",
        probe=_flashinfer_sm100,
        call=_flashinfer_call(backend),
        notes=f"backend={backend!r}; page 32/64; LSE requested in natural units (return_lse_base='basee'); "
              "FP8 routes are tier B (FP8 compute). Not run on hardware by its author (no SM100).",
    )


FLASHINFER_TRTLLM_GEN = _flashinfer_entry("trtllm-gen", "trtllm_gen")
FLASHINFER_CUTE_DSL = _flashinfer_entry("cute-dsl", "cute_dsl")


# --------------------------------------------------------------------------- TokenSpeed MLA


def _tokenspeed_decode_call(case) -> dict:
    inp, q, kv, bs, bt, seq = _dense_common(case)
    b, s_q, h, _ = q.shape
    if bs not in TOKENSPEED_PAGE_SIZES:
        raise UnsupportedCase(f"TokenSpeed MLA decode needs page size 32 or 64 (got {bs})")
    if s_q > TOKENSPEED_MAX_Q_LEN or h > 128:
        raise UnsupportedCase(f"TokenSpeed MLA decode supports q_len 1..4 and <= 128 heads (got {s_q}, {h})")
    if s_q > 1 and q.dtype != torch.float8_e4m3fn:
        # tokenspeed_mla_decode docstring: causal_mask "is effective for the FP8 kernel path"
        raise UnsupportedCase("TokenSpeed documents causal masking (q_len > 1) for the FP8 path only")
    bmm1 = float(inp["softmax_scale"]) * float(inp["q_scale"]) * float(inp["kv_scale"])
    bmm2 = float(inp["kv_scale"])
    # workspace bound of vLLM's _get_workspace: num_sms * H * MAX_Q_LEN(8) * (kv_lora + 1) * 4 bytes
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    ws = torch.zeros(sms * max(h, 128) * 8 * (MLA_KV_LORA_RANK + 1) * 4, dtype=torch.int8, device=q.device)
    from tokenspeed_mla import tokenspeed_mla_decode

    out, lse2 = tokenspeed_mla_decode(
        query=q.contiguous(), kv_cache=kv, workspace_buffer=ws, kv_lora_rank=MLA_KV_LORA_RANK,
        qk_rope_head_dim=MLA_QK_ROPE_DIM, block_tables=bt, seq_lens=seq, max_seq_len=int(seq.max()),
        softmax_scale=bmm1, output_scale=bmm2, causal_mask=bool(inp["causal"]), return_lse=True,
    )
    return {"out": out, "lse": base2_lse_to_natural(lse2.reshape(b, s_q, h))}


def _tokenspeed_prefill_call(case) -> dict:
    inp = case.inputs
    q, k, v = inp["q"], inp["k"], inp["v"]
    if q.shape[-1] != R1_QK_NOPE_DIM + MLA_QK_ROPE_DIM or v.shape[-1] != R1_V_HEAD_DIM:
        raise UnsupportedCase("TokenSpeed MLA prefill is specialised for DeepSeek-R1 dims (d_qk 192, d_v 128)")
    cq, ck = inp["cu_seqlens_q"].to(torch.int32), inp["cu_seqlens_kv"].to(torch.int32)
    if not torch.equal(cq.cpu(), ck.cpu()):
        # the FMHA's causal alignment for q_len != kv_len is not documented (window_right = 0)
        raise UnsupportedCase("this adapter covers new-token prefill (cu_seqlens_q == cu_seqlens_kv) only")
    lens = (ck[1:] - ck[:-1]).contiguous()
    from tokenspeed_mla import tokenspeed_mla_prefill

    out = tokenspeed_mla_prefill(
        query=q.contiguous(), key=k.contiguous(), value=v.contiguous(), seq_lens=lens, cum_seq_lens=ck.contiguous(),
        max_seq_len=int(lens.max()), batch_size=int(lens.numel()), softmax_scale=float(inp["scale"]),
        is_causal=bool(inp["causal"]), return_lse=False,
    )
    return {"out": out}


TOKENSPEED_DECODE = KernelEntry(
    name="tokenspeed_mla.decode",
    stage="dense_mla_decode",
    family="CuTe-DSL",
    source="tokenspeed_mla.tokenspeed_mla_decode",
    archs=SM100_ARCHS,
    dtypes=("bfloat16", "float8_e4m3fn"),
    policies={"lse": LseConvention.NATURAL_SINKFREE.value, "nan": NanPolicy.PROPAGATE.value},
    tolerance_scope="tokenspeed_mla.decode",
    probe=_tokenspeed_sm100,
    call=_tokenspeed_decode_call,
    notes="DeepSeek-R1 dims only (kv_lora 512, rope 64); vLLM runs it with FP8 q/cache; base-2 LSE "
          "converted to natural. Not run on hardware by its author (no SM100).",
)

TOKENSPEED_PREFILL = KernelEntry(
    name="tokenspeed_mla.prefill",
    stage="dense_mla_prefill",
    family="CuTe-DSL",
    source="tokenspeed_mla.tokenspeed_mla_prefill",
    archs=SM100_ARCHS,
    dtypes=("bfloat16",),
    policies={"nan": NanPolicy.PROPAGATE.value},
    tolerance_scope="tokenspeed_mla.prefill",
    probe=_tokenspeed_sm100,
    call=_tokenspeed_prefill_call,
    notes="Ragged causal MHA prefill, DeepSeek-R1 per-head dims (192/128). Not run on hardware by its "
          "author (no SM100).",
)


ENTRIES = [
    FLASHMLA_V32_SM90,
    FLASHMLA_V32_SM100,
    FLASHMLA_DENSE_SM90,
    FLASHMLA_DENSE_FP8_SM90,
    FLASHINFER_TRTLLM_GEN,
    FLASHINFER_CUTE_DSL,
    TOKENSPEED_DECODE,
    TOKENSPEED_PREFILL,
]
