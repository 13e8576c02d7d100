"""FlashInfer's dense paged MLA decode (DeepSeek-R1/V3, Kimi): stage ``dense_mla_decode`` of
``reference.cases.mla``, through ``flashinfer.mla.trtllm_batch_decode_with_kv_cache_mla`` with its
two SM100 backends (production imports are lazy, inside probes and calls).

==========================================  ==================  =========  ==========================
entry                                       stage               archs      production entry point
==========================================  ==================  =========  ==========================
``flashinfer.mla_decode.trtllm_gen``        dense_mla_decode    sm100/103  ``trtllm_batch_decode_with_kv_
                                                                           cache_mla(backend="trtllm-gen")``
``flashinfer.mla_decode.cute_dsl``          dense_mla_decode    sm100/103  same, ``backend="cute-dsl"``
==========================================  ==================  =========  ==========================

Contract honoured (FlashInfer 0.7.2.post1 ``FI:mla/_core.py:3811-4560``; vLLM 0.33.0
``flashinfer_mla.py:370-378``): ``query [B, q_len, H, 576]`` and ``kv_cache [nb, 1, bs, 576]`` of one
dtype (bf16 or fp8), ``bs`` in {32, 64}, ``block_tables`` int32 whose width is a multiple of
``128 / bs`` (padded here with a page the request never reads), ``seq_lens`` int32, ``bmm1_scale =
softmax_scale * q_scale * k_scale``, ``bmm2_scale = k_scale``, workspace 128 MiB zeroed int8 (vLLM's
``FLASHINFER_MLA_WORKSPACE_BUFFER_SIZE``), ``return_lse=True`` with ``return_lse_base="basee"``;
trtllm-gen rejects ``64 < H < 128``. Outputs: ``out [b, s_q, h, 512]`` and ``lse`` canonical
(natural, sink-free, ``[b, s_q, h]``).
"""

from __future__ import annotations

import functools

import torch

from dsv4_numerics.reference.constants import MLA_KV_LORA_RANK, MLA_QK_ROPE_DIM, R1_QK_NOPE_DIM
from dsv4_numerics.reference.errors import UnsupportedCase
from dsv4_numerics.reference.policies import LseConvention, NanPolicy

from dsv4_numerics.kernels.convert import FLASHINFER_HEADS, dense_mla_inputs, pad_block_table
from dsv4_numerics.kernels.probe import SM100_ARCHS, all_reasons, import_after_others, needs_arch, needs_module
from dsv4_numerics.kernels.registry import KernelEntry

__all__ = ["ENTRIES"]

FLASHINFER_MODULE = "flashinfer.mla"
FLASHINFER_WORKSPACE_BYTES = 128 * 1024 * 1024  # vLLM FLASHINFER_MLA_WORKSPACE_BUFFER_SIZE
FLASHINFER_PAGE_SIZES = (32, 64)  # trtllm-gen "requires block_size in (32, 64)"

_flashinfer_sm100 = all_reasons(needs_arch(*SM100_ARCHS), needs_module("flashinfer", "flashinfer-python", "0.7.2"),
                                import_after_others(FLASHINFER_MODULE))


@functools.lru_cache(maxsize=4)
def _fi_workspace(device: str) -> torch.Tensor:
    return torch.zeros(FLASHINFER_WORKSPACE_BYTES, dtype=torch.int8, device=device)


def _flashinfer_call(backend: str):
    def call(case) -> dict:
        inp, q, kv, bs, bt, seq = dense_mla_inputs(case)
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


# the fields the two backends share (the entries differ in their backend only)
_COMMON = dict(
    stage="dense_mla_decode",
    family="FlashInfer",
    source="flashinfer.mla.trtllm_batch_decode_with_kv_cache_mla",
    archs=SM100_ARCHS,
    dtypes=("bfloat16", "float8_e4m3fn"),
    policies={"lse": LseConvention.NATURAL_SINKFREE.value, "nan": NanPolicy.PROPAGATE.value},
    probe=_flashinfer_sm100,
)
_NOTES = ("; page 32/64; LSE requested in natural units (return_lse_base='basee'); FP8 routes are tier B "
          "(FP8 compute). Not run on hardware by its author (no SM100).")

ENTRIES: list[KernelEntry] = [
    KernelEntry(
        name="flashinfer.mla_decode.trtllm_gen",
        tolerance_scope="flashinfer.mla_decode.trtllm_gen",
        call=_flashinfer_call("trtllm-gen"),
        notes="backend='trtllm-gen'" + _NOTES,
        **_COMMON,
    ),
    KernelEntry(
        name="flashinfer.mla_decode.cute_dsl",
        tolerance_scope="flashinfer.mla_decode.cute_dsl",
        call=_flashinfer_call("cute-dsl"),
        notes="backend='cute-dsl'" + _NOTES,
        **_COMMON,
    ),
]
