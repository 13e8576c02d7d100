"""CPU stand-ins for ``flashinfer.mla`` (DSv4 sparse decode) and vLLM's CuTe-DSL dequant-gather,
used to test the adapters' plumbing without the hardware they need (SM100 / SM120 / CuTe-DSL).

Each stand-in enforces the argument contract of the real entry point (paraphrased from FI
``mla/_core.py:1012-1255,1889-2820`` and ``_sparse_mla_sm120/_api.py:808-1157``; vLLM
``dequant_gather_k_cutedsl.py``) and computes with the reference in the *kernel's* conventions:

* trtllm-gen / CAKE: plain 512-wide rows in HND pools, a combined table whose first 128 columns
  are SWA rows valid iff ``c < clamp(seq_lens[b] - (q_len - 1 - q_off), 0, 128)`` and
  ``c < active_len`` and ``idx != -1``; compressed columns valid iff ``c < active_len`` and
  ``idx != -1`` (FI ``_core.py:2012-2027``); no LSE;
* SM120 wrapper: 584-byte pages, two segments, returns the base-2 LSE with the sink merged;
* CuTe gather: ``[nb, bs, 584]`` pages with a 32-byte aligned stride, UE8M0 decoded the CuTe way.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch

from dsv4_numerics.reference.attention.ordered import Segment, sparse_attention
from dsv4_numerics.reference.caches.model1 import dequantize_all, gather
from dsv4_numerics.reference.policies import IndexRule, Ue8m0Consumer

CALLS: list[dict] = []
SWA = 128


def _hnd_rows(pool: torch.Tensor) -> torch.Tensor:
    assert pool.dim() == 4 and pool.shape[1] == 1 and pool.shape[-1] == 512, pool.shape
    assert pool.is_contiguous(), "the adapter promises dense pools (no strided-page remap)"
    assert pool.dtype in (torch.bfloat16, torch.float8_e4m3fn)
    return pool.reshape(-1, 512).float() if pool.dtype == torch.float8_e4m3fn else pool.reshape(-1, 512)


def trtllm_batch_decode_sparse_mla_dsv4(query, swa_kv_cache, workspace_buffer, sparse_indices=None,
                                        compressed_kv_cache=None, sparse_topk_lens=None, seq_lens=None,
                                        out=None, bmm1_scale=1.0, bmm2_scale=1.0, sinks=None, kv_layout="HND",
                                        extra_sparse_indices=None, extra_sparse_topk_lens=None,
                                        backend="auto", **kw):
    assert kv_layout == "HND" and backend in ("trtllm-gen", "cake")
    assert query.dim() == 4 and query.dtype == torch.bfloat16 and query.shape[1] == 1 and query.shape[-1] == 512
    b, _, h, _ = query.shape
    assert h in (8, 16, 32, 64, 128)
    assert workspace_buffer.dtype == torch.uint8
    assert seq_lens.dtype == torch.int32 and seq_lens.shape == (b,)
    if sinks is not None:
        assert sinks.dtype == torch.float32 and sinks.shape == (h,)
    swa_rows, comp_rows = _hnd_rows(swa_kv_cache), _hnd_rows(compressed_kv_cache)
    col = torch.arange(SWA).unsqueeze(0)
    win = torch.clamp(seq_lens.to(torch.int64), 0, SWA).unsqueeze(1)
    if extra_sparse_indices is not None:  # CAKE: separate tables, compressed-only lengths
        assert backend == "cake" and sparse_topk_lens is None
        assert sparse_indices.shape == (b, SWA) and sparse_indices.dtype == torch.int32
        swa_idx = sparse_indices
        comp_idx, comp_len = extra_sparse_indices, extra_sparse_topk_lens.to(torch.int64)
    else:
        assert sparse_indices.dtype == torch.int32 and sparse_indices.dim() == 2
        w = sparse_indices.shape[1]
        assert w >= SWA and w % 4 == 0
        assert sparse_topk_lens.dtype == torch.int32 and bool((sparse_topk_lens >= SWA).all())
        assert bool((sparse_topk_lens <= w).all())
        swa_idx = sparse_indices[:, :SWA]
        comp_idx = sparse_indices[:, SWA:]
        comp_len = sparse_topk_lens.to(torch.int64) - SWA
    swa_ok = (col < win) & (swa_idx != -1)
    swa_eff = torch.where(swa_ok, swa_idx.to(torch.int64), torch.full_like(swa_idx, -1, dtype=torch.int64))
    segs = [Segment(swa_rows, swa_eff, None, IndexRule.MINUS1_ONLY)]
    if comp_idx.shape[1]:
        segs.append(Segment(comp_rows, comp_idx, comp_len, IndexRule.MINUS1_ONLY))
    res = sparse_attention(query[:, 0], segs, float(bmm1_scale), sink=sinks)
    CALLS.append({"fn": backend, "h": h, "width": sparse_indices.shape[1], "seq_lens": seq_lens.tolist()})
    return (res.out * bmm2_scale).to(torch.bfloat16).unsqueeze(1)


class SparseMLASm120Wrapper:
    def run(self, q, kv_cache, indices, output, sm_scale, *, topk_length=None, attn_sink=None,
            extra_kv_cache=None, extra_indices=None, extra_topk_length=None, return_lse=False, lse_scale=1.0, **kw):
        assert q.dim() == 3 and q.dtype == torch.bfloat16 and q.shape[1] <= 128
        t, h, _ = q.shape
        segs = []
        for cache, idx, ln in ((kv_cache, indices, topk_length), (extra_kv_cache, extra_indices, extra_topk_length)):
            if cache is None:
                continue
            assert cache.dim() == 4 and cache.shape[2] == 1 and cache.shape[-1] == 584  # NHD packed
            assert cache.stride(0) % 16 == 0 and cache.stride(1) == 584
            assert idx.dtype == torch.int32 and idx.shape[0] == t
            rows = dequantize_all(cache[:, :, 0, :], cache.shape[1], consumer=Ue8m0Consumer.SM120)
            segs.append(Segment(rows, idx, ln, IndexRule.ANY_OUT_OF_RANGE_INVALID))
        res = sparse_attention(q, segs, sm_scale, sink=attn_sink)
        output.copy_(res.out.to(torch.bfloat16))
        CALLS.append({"fn": "sm120", "h": h})
        lse2 = (res.lse_with_sink / math.log(2.0) * lse_scale).float()  # base 2, sink merged
        return lse2 if return_lse else None


MLA = SimpleNamespace(trtllm_batch_decode_sparse_mla_dsv4=trtllm_batch_decode_sparse_mla_dsv4,
                      SparseMLASm120Wrapper=SparseMLASm120Wrapper)


def _cute_gather(*, out, k_cache, seq_lens, gather_lens, block_table, block_size, offset):
    assert k_cache.dim() == 3 and k_cache.shape[1:] == (block_size, 584) and k_cache.stride(1) == 584
    assert k_cache.stride(0) % 32 == 0 and k_cache.data_ptr() % 32 == 0
    assert out.dtype == torch.bfloat16 and seq_lens.dtype == torch.int32 and block_table.dtype == torch.int32
    ref, valid = gather(k_cache, block_table, seq_lens, block_size, gather_lens, consumer=Ue8m0Consumer.CUTE,
                        offset=offset)
    w = ref.shape[1]
    out[:, :w][valid] = ref[valid]
    CALLS.append({"fn": "cute_gather", "stride": k_cache.stride(0)})


CUTE_GATHER_MODULE = SimpleNamespace(_DEQUANT_GATHER_K_CACHE_CUTEDSL_KERNEL=_cute_gather)
