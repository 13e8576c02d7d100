"""A CPU stand-in for ``vllm.third_party.flashmla.flash_mla_interface`` used to test the FlashMLA
adapter's plumbing without a GPU.

It enforces the argument checks of the real entry points (FlashMLA ``csrc/api/sparse_decode.h``
``sparse_attn_decode_interface`` and ``sparse_fwd.h`` ``sparse_attn_prefill_interface``,
paraphrased: ranks, dtypes, shapes, ``kv.stride(1) == 584``, h_q in {64, 128}, top-k a multiple of
the kernel block, last-dim contiguity, int32 lengths of shape ``[b]``) and computes with the
reference oracle in the *kernel's* conventions: LSE ``+inf`` for a query without a valid key,
decode LSE returned as a ``[b, h_q, s_q]`` transposed view of a ``[b, s_q, h_q]`` buffer.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch

from dsv4_numerics.reference.attention.ordered import Segment, sparse_attention
from dsv4_numerics.reference.caches.model1 import dequantize_all
from dsv4_numerics.reference.caches.v41 import dequantize_all as dequantize_v41
from dsv4_numerics.reference.policies import IndexRule, Ue8m0Consumer, V41Layout, V41Record

CALLS: list[dict] = []


def get_mla_metadata(*args, **kwargs):
    return SimpleNamespace(have_initialized=False), None


# FlashMLA selects the record from the bytes per token (V4 584, V4.1 MXFP8 528, V4.1 NVFP4 288)
_V41_RECORDS = {528: V41Record.MXFP8, 288: V41Record.NVFP4}


def cache_rows(k_cache: torch.Tensor) -> torch.Tensor:
    r = k_cache.shape[3]
    assert k_cache.dim() == 4 and k_cache.shape[2] == 1 and r in (584, *_V41_RECORDS), k_cache.shape
    assert k_cache.stride(1) == r and k_cache.stride(-1) == 1, k_cache.stride()
    assert k_cache.stride(0) % 16 == 0, "page stride must keep 16-byte aligned pages"
    bs = k_cache.shape[1]
    if r in _V41_RECORDS:  # interleaved records (FlashMLA 2026.09.30+)
        flat = torch.as_strided(k_cache, (k_cache.shape[0], bs * r), (k_cache.stride(0), 1), k_cache.storage_offset())
        return dequantize_v41(flat, bs, _V41_RECORDS[r], V41Layout.INTERLEAVED)
    return dequantize_all(k_cache[:, :, 0, :], bs, consumer=Ue8m0Consumer.FLASHMLA)


def flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata,
                           num_splits=None, softmax_scale=None, causal=False, is_fp8_kvcache=False,
                           indices=None, attn_sink=None, extra_k_cache=None, extra_indices_in_kvcache=None,
                           topk_length=None, extra_topk_length=None, out=None, enable_batch_invariant=False):
    assert block_table is None and cache_seqlens is None and not causal and is_fp8_kvcache
    assert head_dim_v == 512
    assert q.dim() == 4 and q.dtype == torch.bfloat16 and q.stride(-1) == 1
    b, s_q, h_q, d = q.shape
    assert h_q in (64, 128) and d == 512
    assert indices.dtype == torch.int32 and indices.shape[:2] == (b, s_q) and indices.stride(-1) == 1
    assert indices.shape[2] > 0 and indices.shape[2] % 64 == 0
    if extra_k_cache is not None and extra_k_cache.shape[3] == 288:
        assert k_cache.shape[3] == 528, "V4.1 fp4 is only valid for extra_k_cache next to a V4.1 k_cache"
    segs = []
    for cache, idx, ln in ((k_cache, indices, topk_length), (extra_k_cache, extra_indices_in_kvcache, extra_topk_length)):
        if cache is None:
            assert idx is None and ln is None
            continue
        assert idx.dtype == torch.int32 and idx.shape[:2] == (b, s_q) and idx.shape[2] % 64 == 0
        if ln is not None:
            assert ln.dtype == torch.int32 and ln.shape == (b,) and ln.is_contiguous()
        rows = cache_rows(cache)
        flat_idx = idx.reshape(b * s_q, -1)
        flat_len = None if ln is None else ln.repeat_interleave(s_q)
        segs.append(Segment(rows, flat_idx, flat_len, IndexRule.MINUS1_ONLY))
    if attn_sink is not None:
        assert attn_sink.dtype == torch.float32 and attn_sink.shape == (h_q,) and attn_sink.is_contiguous()
    res = sparse_attention(q.reshape(b * s_q, h_q, d), segs, softmax_scale, sink=attn_sink)
    out = res.out.to(torch.bfloat16).reshape(b, s_q, h_q, 512)
    lse = torch.where(res.lse == -math.inf, torch.full_like(res.lse, math.inf), res.lse).float()
    lse_buf = lse.reshape(b, s_q, h_q)
    CALLS.append({"fn": "decode", "h_q": h_q, "topk": indices.shape[2],
                  "extra_topk": None if extra_indices_in_kvcache is None else extra_indices_in_kvcache.shape[2]})
    return out, lse_buf.transpose(1, 2)


def flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None, out=None):
    assert q.dim() == 3 and kv.dim() == 3 and indices.dim() == 3
    s_q, h_q, d = q.shape
    assert q.dtype == torch.bfloat16 and kv.dtype == torch.bfloat16 and h_q in (64, 128) and d == 512
    assert kv.shape[1] == 1 and kv.stride(-1) == 1 and q.stride(-1) == 1
    assert indices.dtype == torch.int32 and indices.shape[:2] == (s_q, 1) and indices.shape[2] % 128 == 0
    if topk_length is not None:
        assert topk_length.dtype == torch.int32 and topk_length.shape == (s_q,)
    if attn_sink is not None:
        assert attn_sink.dtype == torch.float32 and attn_sink.shape == (h_q,)
    seg = Segment(kv[:, 0, :], indices[:, 0, :], topk_length, IndexRule.ANY_OUT_OF_RANGE_INVALID)
    res = sparse_attention(q, [seg], sm_scale, sink=attn_sink)
    lse = torch.where(res.lse == -math.inf, torch.full_like(res.lse, math.inf), res.lse).float()
    CALLS.append({"fn": "prefill", "h_q": h_q, "topk": indices.shape[2]})
    return res.out.to(torch.bfloat16), res.max_logits.float(), lse
