"""Sparse decode attention in plain PyTorch (fp32 math, bf16 output), written from the DSv4
attention spec: one softmax over the union of the SWA segment and an optional compressed segment
of 584-byte paged caches, with a per-head attention sink in the denominator.

Per query token ``t`` and head ``h``: ``s_j = scale * q[t, h] . k_j`` over the valid keys ``j``
(the first ``lens[t]`` index columns of each segment, index ``-1`` = empty), ``m = max_j s_j``,
``out = sum_j exp(s_j - m) v_j / (sum_j exp(s_j - m) + exp(sink_h - m))`` with ``v_j = k_j`` (all
512 dims), ``lse = m + log(sum_j exp(s_j - m))`` (natural log, sink-free); a token with no valid key
gets ``out = 0`` and ``lse = -inf``.
"""

from __future__ import annotations

import torch

NOPE, ROPE, TILE, DATA_ROW, SCALE_ROW = 448, 64, 64, 576, 8


def dequantize_rows(cache: torch.Tensor, block_size: int, slots: torch.Tensor) -> torch.Tensor:
    """fp32 ``[len(slots), 512]`` rows of a 584-byte paged cache ``[num_blocks, page_stride]``."""
    flat, stride = cache.reshape(-1), cache.stride(0)
    page, entry = slots // block_size, slots % block_size
    d0 = page * stride + entry * DATA_ROW
    s0 = page * stride + block_size * DATA_ROW + entry * SCALE_ROW
    data = flat[d0.unsqueeze(1) + torch.arange(DATA_ROW, device=cache.device)]
    sc = flat[s0.unsqueeze(1) + torch.arange(NOPE // TILE, device=cache.device)].to(torch.int32)
    nope = data[:, :NOPE].view(torch.float8_e4m3fn).to(torch.float32).reshape(-1, NOPE // TILE, TILE)
    nope = nope * torch.pow(2.0, (sc - 127).to(torch.float32)).unsqueeze(-1)
    rope = data[:, NOPE:].contiguous().view(torch.bfloat16).to(torch.float32)
    return torch.cat([nope.reshape(-1, NOPE), rope], dim=1)


def sparse_decode(inputs: dict) -> dict:
    """The canonical call of the ``decode`` stage: ``{"out": bf16 [T, H, 512], "lse": fp32 [T, H]}``."""
    q = inputs["q"].to(torch.float32)
    T, H, D = q.shape
    segs = [("swa_cache", "swa_block_size", "swa_indices", "swa_lens"),
            ("extra_cache", "extra_block_size", "extra_indices", "extra_lens")]
    keys, valid = [], []
    for cache_k, bs_k, idx_k, len_k in segs:
        if cache_k not in inputs:
            continue
        idx = inputs[idx_k].to(torch.int64)
        ok = idx != -1
        lens = inputs.get(len_k)
        if lens is not None:
            ok &= torch.arange(idx.shape[1], device=idx.device).unsqueeze(0) < lens.to(torch.int64).unsqueeze(1)
        rows = dequantize_rows(inputs[cache_k], inputs[bs_k], torch.where(ok, idx, 0).reshape(-1))
        rows = torch.where(ok.reshape(-1, 1), rows, torch.zeros((), device=rows.device))  # no 0 * NaN leaks
        keys.append(rows.reshape(T, -1, D))
        valid.append(ok)
    k = torch.cat(keys, dim=1)  # [T, K, 512]
    ok = torch.cat(valid, dim=1)  # [T, K]
    s = torch.einsum("thd,tkd->thk", q, k) * float(inputs["scale"])
    s = s.masked_fill(~ok.unsqueeze(1), float("-inf"))
    m = s.amax(-1, keepdim=True)
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(s - m_safe)
    denom = p.sum(-1, keepdim=True)
    lse = (m_safe + torch.log(denom)).squeeze(-1)
    sink = inputs.get("sink")
    total = denom
    if sink is not None:
        total = denom + torch.exp(sink.to(torch.float32).reshape(1, H, 1) - m_safe)
    out = torch.einsum("thk,tkd->thd", p, k) / total
    lonely = ~ok.any(-1)  # [T]
    out = torch.where(lonely.reshape(T, 1, 1), torch.zeros((), device=out.device), out)
    lse = torch.where(lonely.reshape(T, 1), torch.full_like(lse, float("-inf")), lse)
    return {"out": out.to(torch.bfloat16), "lse": lse}
