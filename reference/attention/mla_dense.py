"""Dense paged MLA oracles (DeepSeek-R1/V3, Kimi K2): decode over a paged latent cache, and the
per-head causal prefill of TokenSpeed (attention.md 1.3, 4.2, 8).

Both are built **on top of the sparse attention oracle** (``attention.sparse_attention``, fp64,
attention.md 7): the dense decode turns the block table into one index row per query token
(every visible cache slot, left-packed, ``-1`` padded, prefix length = visible count) and calls
the oracle with ``d_v = 512`` and no sink, so it inherits its float64 semantics, its exact-zero
lonely rows, its ``-inf`` natural LSE convention and its NaN isolation (rows no valid index points
at never reach the output).

Dense decode semantics (FlashMLA ``flash_mla_with_kvcache`` dense path, FlashInfer
``trtllm_batch_decode_with_kv_cache_mla``, TokenSpeed ``tokenspeed_mla_decode``):

* latent row ``[kv_lora_rank 512 | rope 64]`` (``d_qk = 576``); K = the whole row, V = its first
  512 dims (``d_v = 512``); one KV head (MQA over the latent);
* request ``b`` owns cache positions ``0 .. L_b - 1`` (``L_b = seq_lens[b]``), position ``p`` at
  slot ``block_table[b, p // bs] * bs + p % bs``;
* causal with ``s`` query tokens per request (speculative decoding / MTP): query token ``i``
  (``0 <= i < s``) attends positions ``p <= L_b - s + i`` (bottom-right aligned; FlashMLA's test
  reference ``tril(diagonal = s_k - s_q)``, ``FM:tests/test_fp8_flash_mla.py``
  ``scaled_dot_product_attention``; TokenSpeed's ``k_bound = causal_seqs - (q_len - 1) + q_tok``);
  non-causal: every token sees ``0 .. L_b - 1``;
* scales: logits ``bmm1_scale * <q, k>`` (for FP8 caches ``bmm1_scale = softmax_scale * q_scale *
  k_scale`` and ``q``/``k`` are the decoded FP8 values), output ``bmm2_scale * softmax @ V``
  (``bmm2_scale = v_scale``; FI ``_core.py`` docstring "In MLA, the actual BMM1 and BMM2 scales",
  ``V:v1/attention/backends/mla/flashinfer_mla.py:370-378``). The LSE is of the ``bmm1``-scaled
  logits, natural log, ``-inf`` for a query with no visible position.

The prefill oracle (``dense_mha_prefill``) is ordinary per-head causal attention over ragged
``q/k/v`` (DeepSeek-R1 non-absorbed prefill: ``d_qk = 192``, ``d_v = 128``; vLLM
``v1/attention/backends/mla/prefill/tokenspeed_mla.py``), one oracle call per head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .ordered import Segment, sparse_attention
from ..constants import MLA_D_V
from ..errors import INDEX_DTYPES, check_dtype, check_int, check_rank, check_tensor, fail
from ..policies import AttentionMode

__all__ = [
    "DenseOut",
    "dense_token_indices",
    "dense_kv_rows",
    "dense_mla_decode",
    "ragged_causal_indices",
    "dense_mha_prefill",
]

_VALUE_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.float8_e4m3fn)


@dataclass
class DenseOut:
    """Dense oracle result (float64).

    out:       ``[B, s, H, d_v]`` (decode) or ``[T_q, H, d_v]`` (prefill), ``bmm2_scale`` applied;
               exactly 0 for a query with no visible position.
    lse:       ``[B, s, H]`` / ``[T_q, H]`` natural-log LSE of the scaled logits; ``-inf`` if lonely.
    max_logit: same shape as ``lse``; ``-inf`` if lonely.
    n_valid:   ``[B, s]`` / ``[T_q]`` int64 number of visible positions of each query token.
    """

    out: torch.Tensor
    lse: torch.Tensor
    max_logit: torch.Tensor
    n_valid: torch.Tensor


# --------------------------------------------------------------------------- index construction


def _check_paged(fn: str, block_table: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
                 num_blocks: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    check_dtype(fn, "block_table", block_table, INDEX_DTYPES)
    check_rank(fn, "block_table", block_table, 2)
    check_dtype(fn, "seq_lens", seq_lens, INDEX_DTYPES)
    check_rank(fn, "seq_lens", seq_lens, 1)
    check_int(fn, "block_size", block_size, minimum=1)
    b, m = block_table.shape
    if seq_lens.shape[0] != b:
        fail(fn, "seq_lens", f"must have one entry per block_table row ({b})", tuple(seq_lens.shape))
    lens = seq_lens.to(torch.int64).cpu()
    bt = block_table.to(torch.int64).cpu()
    if bool((lens < 0).any()):
        fail(fn, "seq_lens", "must be >= 0", lens.tolist())
    need = (lens + block_size - 1) // block_size
    if bool((need > m).any()):
        fail(fn, "block_table", f"must have >= ceil(seq_len / block_size) columns for every request "
             f"(needs {int(need.max())})", tuple(block_table.shape))
    for r in range(b):
        used = bt[r, : int(need[r])]
        if used.numel() and (bool((used < 0).any()) or (num_blocks is not None and bool((used >= num_blocks).any()))):
            fail(fn, "block_table", f"entries used by request {r} must lie in [0, num_blocks = {num_blocks})",
                 used.tolist())
    return bt, lens


def dense_token_indices(block_table: torch.Tensor, seq_lens: torch.Tensor, q_len: int, block_size: int,
                        causal: bool = True, num_blocks: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-query-token slot rows of a dense paged decode.

    block_table ``[B, M]`` int (page ids), seq_lens ``[B]`` int (``L_b``), ``q_len`` = query tokens
    per request ``s``. Token ``t = b * s + i`` sees positions ``0 .. hi`` with
    ``hi = L_b - s + i`` (causal) or ``L_b - 1``; its row holds the slots of those positions in
    position order, then ``-1``. Returns ``(idx [B*s, W] int32, length [B*s] int32)`` with
    ``W = max(1, max_b L_b)`` and ``length`` = number of visible positions (``>= 0``).
    With ``num_blocks`` given, used block-table entries are checked to be in range.
    """
    fn = "dense_token_indices"
    check_int(fn, "q_len", q_len, minimum=1)
    bt, lens = _check_paged(fn, block_table, seq_lens, block_size, num_blocks)
    b = bt.shape[0]
    w = max(1, int(lens.max()) if b else 1)
    pos = torch.arange(w, dtype=torch.int64)
    i = torch.arange(q_len, dtype=torch.int64)
    hi = (lens.view(b, 1) - q_len + i.view(1, q_len)) if causal else (lens.view(b, 1) - 1).expand(b, q_len)
    count = torch.clamp(torch.minimum(hi + 1, lens.view(b, 1)), min=0)  # [B, s]
    page_col = torch.clamp(pos // block_size, max=bt.shape[1] - 1)
    slots = bt[:, page_col] * block_size + pos % block_size  # [B, W]
    idx = slots.view(b, 1, w).expand(b, q_len, w)
    idx = torch.where(pos.view(1, 1, w) < count.view(b, q_len, 1), idx, torch.full_like(idx, -1))
    dev = block_table.device
    return idx.reshape(b * q_len, w).to(torch.int32).to(dev), count.reshape(b * q_len).to(torch.int32).to(dev)


def dense_kv_rows(kv_cache: torch.Tensor, block_size: int) -> torch.Tensor:
    """Every slot of a dense paged cache as exact float64 rows ``[num_blocks * block_size, D]``.

    ``kv_cache``: ``[num_blocks, block_size, D]``, ``[num_blocks, block_size, 1, D]`` or
    ``[num_blocks, 1, block_size, D]`` (FlashInfer HND with one head); dtype bfloat16, float16,
    float32, float64 or float8_e4m3fn (decoded exactly; NaN codes stay NaN). Per-tensor FP8 scales
    are *not* applied here (they belong to ``bmm1_scale``/``bmm2_scale``).
    """
    fn = "dense_kv_rows"
    check_dtype(fn, "kv_cache", kv_cache, _VALUE_DTYPES)
    check_int(fn, "block_size", block_size, minimum=1)
    c = kv_cache
    if c.dim() == 4:
        if c.shape[2] == 1 and c.shape[1] == block_size:
            c = c[:, :, 0]
        elif c.shape[1] == 1 and c.shape[2] == block_size:
            c = c[:, 0]
        else:
            fail(fn, "kv_cache", f"4-D form must be [nb, {block_size}, 1, D] or [nb, 1, {block_size}, D]",
                 tuple(kv_cache.shape))
    if c.dim() != 3 or c.shape[1] != block_size:
        fail(fn, "kv_cache", f"must have shape [num_blocks, {block_size}, D]", tuple(kv_cache.shape))
    return c.to(torch.float64).reshape(-1, c.shape[-1])


# --------------------------------------------------------------------------- decode oracle


def _finite_float(fn: str, arg: str, v: object) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        fail(fn, arg, "must be a float", type(v).__name__)
    v = float(v)
    if not (v == v and abs(v) != float("inf")):
        fail(fn, arg, "must be finite", v)
    return v


def _oracle_fields(res) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(out, lse, max_logit, n_valid)`` of an ``attention.sparse_attention`` result."""
    return res.out, res.lse, res.max_logits, res.n_valid


def dense_mla_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    bmm1_scale: float,
    *,
    d_v: int = MLA_D_V,
    bmm2_scale: float = 1.0,
    causal: bool = True,
    mode: AttentionMode | str = AttentionMode.EXACT,
) -> DenseOut:
    """Dense paged MLA decode in float64 (module docstring for the semantics).

    q          ``[B, s, H, D]`` (bf16 / fp16 / fp32 / fp64 / float8_e4m3fn values, taken exactly)
    kv_cache   paged cache, ``dense_kv_rows`` forms, ``D`` = ``q``'s last dim (576 for MLA)
    block_table ``[B, M]`` int page ids; seq_lens ``[B]`` int cache lengths (>= 0)
    block_size page size (tokens); bmm1_scale logit multiplier; bmm2_scale output multiplier
    d_v        value width: V = the first ``d_v`` dims of each row (512)
    mode       ``AttentionMode.EXACT`` (fp64) or ``BF16_P`` (the bf16 kernels' precision model,
               applied by the sparse oracle)
    Returns ``DenseOut`` with ``out [B, s, H, d_v]``, ``lse``/``max_logit [B, s, H]``,
    ``n_valid [B, s]``.
    """
    fn = "dense_mla_decode"
    check_dtype(fn, "q", q, _VALUE_DTYPES)
    check_rank(fn, "q", q, 4)
    b, s, h, d = q.shape
    rows = dense_kv_rows(kv_cache, block_size)
    if rows.shape[1] != d:
        fail(fn, "kv_cache", f"must have rows as wide as q's last dim ({d})", tuple(kv_cache.shape))
    check_int(fn, "d_v", d_v, minimum=1)
    if d_v > d:
        fail(fn, "d_v", f"must be <= the row width {d}", d_v)
    s1 = _finite_float(fn, "bmm1_scale", bmm1_scale)
    s2 = _finite_float(fn, "bmm2_scale", bmm2_scale)
    check_tensor(fn, "block_table", block_table)
    if block_table.dim() != 2 or block_table.shape[0] != b:
        fail(fn, "block_table", f"must have one row per request ({b})", tuple(block_table.shape))
    nb = rows.shape[0] // block_size
    idx, length = dense_token_indices(block_table, seq_lens, s, block_size, causal=causal, num_blocks=nb)
    qf = q.to(torch.float64).reshape(b * s, h, d)
    res = sparse_attention(qf, [Segment(rows, idx.to(rows.device), length.to(rows.device))], s1,
                           sink=None, d_v=d_v, mode=mode)
    out, lse, mx, nv = _oracle_fields(res)
    out = out * s2
    return DenseOut(out.reshape(b, s, h, d_v), lse.reshape(b, s, h), mx.reshape(b, s, h), nv.reshape(b, s))


# --------------------------------------------------------------------------- prefill oracle


def ragged_causal_indices(cu_seqlens_q: torch.Tensor, cu_seqlens_kv: torch.Tensor,
                          causal: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Index rows of a ragged (varlen) prefill over concatenated K/V.

    Request ``r`` owns query rows ``[cq[r], cq[r+1])`` and key rows ``[ck[r], ck[r+1])``; its
    query ``i`` (``0 <= i < s_r``) sees keys ``j <= L_r - s_r + i`` (bottom-right causal; equal
    to top-left when ``s_r == L_r``), or all ``L_r`` keys when not causal. Returns
    ``(idx [T_q, W] int32 of global key rows, -1 padded; length [T_q] int32)``.
    """
    fn = "ragged_causal_indices"
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_kv", cu_seqlens_kv)):
        check_dtype(fn, name, cu, INDEX_DTYPES)
        check_rank(fn, name, cu, 1)
        c = cu.to(torch.int64).cpu()
        if c.numel() < 2 or int(c[0]) != 0 or bool((c[1:] < c[:-1]).any()):
            fail(fn, name, "must start at 0, be non-decreasing and have >= 2 entries", c.tolist())
    cq, ck = cu_seqlens_q.to(torch.int64).cpu(), cu_seqlens_kv.to(torch.int64).cpu()
    if cq.numel() != ck.numel():
        fail(fn, "cu_seqlens_kv", "must have as many entries as cu_seqlens_q", (cq.numel(), ck.numel()))
    sq, sk = cq[1:] - cq[:-1], ck[1:] - ck[:-1]
    tq = int(cq[-1])
    w = max(1, int(sk.max()))
    idx = torch.full((tq, w), -1, dtype=torch.int64)
    length = torch.zeros(tq, dtype=torch.int64)
    pos = torch.arange(w, dtype=torch.int64)
    for r in range(sq.numel()):
        s_r, l_r = int(sq[r]), int(sk[r])
        i = torch.arange(s_r, dtype=torch.int64)
        cnt = torch.clamp(torch.minimum(l_r - s_r + i + 1, torch.tensor(l_r)), min=0) if causal \
            else torch.full((s_r,), l_r, dtype=torch.int64)
        rows = int(ck[r]) + pos.view(1, w).expand(s_r, w)
        idx[int(cq[r]):int(cq[r + 1])] = torch.where(pos.view(1, w) < cnt.view(s_r, 1), rows, torch.full_like(rows, -1))
        length[int(cq[r]):int(cq[r + 1])] = cnt
    dev = cu_seqlens_q.device
    return idx.to(torch.int32).to(dev), length.to(torch.int32).to(dev)


def dense_mha_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_kv: torch.Tensor,
    scale: float,
    *,
    causal: bool = True,
    mode: AttentionMode | str = AttentionMode.EXACT,
) -> DenseOut:
    """Per-head ragged prefill attention in float64 (R1 non-absorbed MLA prefill).

    q ``[T_q, H, D_qk]``, k ``[T_k, H_k, D_qk]``, v ``[T_k, H_k, D_v]`` with ``H % H_k == 0``
    (query head ``h`` uses KV head ``h // (H / H_k)``); ``cu_seqlens_*`` ``[R + 1]``; logits
    ``scale * <q, k>``; causal rule of ``ragged_causal_indices``. Returns ``DenseOut`` with
    ``out [T_q, H, D_v]``, ``lse``/``max_logit [T_q, H]``, ``n_valid [T_q]``.
    """
    fn = "dense_mha_prefill"
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_dtype(fn, name, t, _VALUE_DTYPES)
        check_rank(fn, name, t, 3)
    tq, h, dqk = q.shape
    tk, hk, dk = k.shape
    if dk != dqk:
        fail(fn, "k", f"must have q's head dim {dqk}", tuple(k.shape))
    if v.shape[0] != tk or v.shape[1] != hk:
        fail(fn, "v", f"must have shape [{tk}, {hk}, D_v]", tuple(v.shape))
    if hk < 1 or h % hk != 0:
        fail(fn, "k", f"KV head count must divide the query head count {h}", hk)
    if not bool(torch.isfinite(v.to(torch.float64)).all()):
        fail(fn, "v", "must be finite (prefill activations; the [V | K] row layout needs finite V)")
    s1 = _finite_float(fn, "scale", scale)
    idx, length = ragged_causal_indices(cu_seqlens_q, cu_seqlens_kv, causal)
    if int(cu_seqlens_q[-1]) != tq or int(cu_seqlens_kv[-1]) != tk:
        fail(fn, "cu_seqlens_q", "last entries must equal the q / k row counts", (tq, tk))
    dv = v.shape[2]
    group = h // hk
    # One oracle call for all KV heads: "token" (t, kh) = row t * hk + kh of a [T_q * hk, group, .]
    # query; the key rows of KV head kh are rows kh * T_k .. kh * T_k + T_k - 1 of one row table.
    # The sparse oracle takes V = rows[:, :d_v] of one row tensor, so rows are laid out [V | K] and
    # the query [0 | q]: the logits are exactly <q, K> (the zero block adds exact zeros; V is
    # finite, checked above) and the value is exactly V.
    dev = q.device
    rows = torch.cat([v.to(torch.float64).permute(1, 0, 2).reshape(hk * tk, dv),
                      k.to(torch.float64).permute(1, 0, 2).reshape(hk * tk, dqk)], dim=1)
    qh = torch.cat([torch.zeros(tq, hk, group, dv, dtype=torch.float64, device=dev),
                    q.to(torch.float64).reshape(tq, hk, group, dqk)], dim=3).reshape(tq * hk, group, dv + dqk)
    idx64 = idx.to(torch.int64).to(dev)
    off = (torch.arange(hk, device=dev, dtype=torch.int64) * tk).view(1, hk, 1)
    idx_h = torch.where(idx64.unsqueeze(1) >= 0, idx64.unsqueeze(1) + off, torch.full_like(off, -1))
    idx_h = idx_h.reshape(tq * hk, -1)
    len_h = length.to(dev).unsqueeze(1).expand(tq, hk).reshape(tq * hk)
    res = sparse_attention(qh, [Segment(rows, idx_h, len_h)], s1, sink=None, d_v=dv, mode=mode)
    o, l, m, n = _oracle_fields(res)
    return DenseOut(o.reshape(tq, h, dv), l.reshape(tq, h), m.reshape(tq, h), n.reshape(tq, hk)[:, 0].contiguous())
