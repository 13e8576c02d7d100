"""SGLang 0.5.23's DSv4 index builders (``S:`` = the SGLang wheel, ``sglang/``), with their own
argument names and conventions:

- :func:`combine_topk_swa_indices_sglang` -- ``S:kernels/ops/attention/dsv4/sparse_prefill_kernels.py``
  ``combine_topk_swa_indices``: one prefill row per query token ``[top-k | window | -1 ...]``,
  workspace bases given per request (``compressed_base``, ``swa_base``) instead of vLLM's
  ``M*r`` / ``M*r + N``, positions given (``query_pos``) instead of derived; negative top-k
  entries become ``-1`` (policy ``CombineInvalidTopk.KEPT_MINUS1``), no image visibility.
- :func:`build_swa_token_ids` -- same file: the flat list of SWA-cache token ids covering each
  request's union of query windows, ``[seq_len - min(seq_len, extend + W - 1), seq_len)``,
  through ``req_to_token`` then ``full_to_swa`` (what SGLang's bf16 gather consumes).
- :func:`v4_paged_decode_indices` -- ``S:kernels/ops/attention/dsv4/unified_kv_kernels/
  paged_decode_indices.py``: the SWA window prefix of every decode token written as RING offsets
  ``slot * ring_stride + abs_pos % ring_stride`` into three ragged (indptr) buffers, ``n =
  min(pos + 1, win)`` entries, no ``-1`` padding; tokens with ``batch_id < 0`` are left untouched.

Index tensors are int32/int64 inputs; outputs are int32 like production's buffers. Every
function validates first (``InputError`` naming the argument) where production would read or
write out of bounds.
"""

from __future__ import annotations

import torch

from ..constants import PREFILL_WIDTH_ALIGN
from ..errors import check_enum, check_int, fail
from .slots import as_index
from ..policies import CombineInvalidTopk

__all__ = ["combine_topk_swa_indices_sglang", "combined_topk_width", "build_swa_token_ids", "v4_paged_decode_indices"]

_I32 = (-(2**31), 2**31 - 1)


def _fits_int32(fn: str, arg: str, t: torch.Tensor) -> None:
    if t.numel() and (int(t.min()) < _I32[0] or int(t.max()) > _I32[1]):
        fail(fn, arg, "must fit in int32 (the production buffers are int32)", (int(t.min()), int(t.max())))


def combined_topk_width(topk: int, window_size: int) -> int:
    """Row width of the combined indices: ``ceil(topk + window_size, 128)``."""
    return -(-(topk + window_size) // PREFILL_WIDTH_ALIGN) * PREFILL_WIDTH_ALIGN


def combine_topk_swa_indices_sglang(
    topk_indices: torch.Tensor,
    query_start_loc: torch.Tensor,
    query_pos: torch.Tensor,
    seq_lens: torch.Tensor,
    gather_lens: torch.Tensor,
    compressed_base: torch.Tensor,
    swa_base: torch.Tensor,
    window_size: int,
    compress_ratio: int,
    topk: int,
    *,
    invalid_topk: CombineInvalidTopk | str = CombineInvalidTopk.KEPT_MINUS1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """SGLang's combined prefill rows (same argument names and order; ``out_*`` and the explicit
    SWA variant dropped).

    Token ``t`` belongs to the last request ``r`` with ``query_start_loc[r] - query_start_loc[0]
    <= t``; tokens at or past ``query_start_loc[R] - query_start_loc[0]`` own no request (row all
    ``-1``, length 0). With ``p = query_pos[t]``: ``topk_len = min((p+1)//ratio, topk)``,
    ``swa_len = min(p+1, W)``, ``gather_start = seq_lens[r] - gather_lens[r]``;
    ``out[t, k] = topk[t, k] + compressed_base[r]`` for ``k < topk_len`` (a negative entry -> ``-1``
    under ``KEPT_MINUS1``, shifted like any other under ``SHIFTED_BY_BASE``),
    ``out[t, topk_len + j] = swa_base[r] + p - swa_len + 1 - gather_start + j`` for ``j < swa_len``,
    every other column ``-1``; width :func:`combined_topk_width`; ``lens = topk_len + swa_len``.
    Returns ``(combined_indices int32 [T, width], combined_lens int32 [T])``.
    """
    fn = "combine_topk_swa_indices_sglang"
    invalid_topk = check_enum(fn, "invalid_topk", CombineInvalidTopk, invalid_topk)
    tk = as_index(fn, "topk_indices", topk_indices, rank=2)
    sl = as_index(fn, "seq_lens", seq_lens, rank=1)
    nr = sl.shape[0]
    qsl = as_index(fn, "query_start_loc", query_start_loc, rank=1, min_len=nr + 1)[: nr + 1]
    gl = as_index(fn, "gather_lens", gather_lens, rank=1, min_len=nr)[:nr]
    cb = as_index(fn, "compressed_base", compressed_base, rank=1, min_len=nr)[:nr]
    sb = as_index(fn, "swa_base", swa_base, rank=1, min_len=nr)[:nr]
    w = check_int(fn, "window_size", window_size, minimum=1)
    ratio = check_int(fn, "compress_ratio", compress_ratio, minimum=1)
    k = check_int(fn, "topk", topk, minimum=0)
    t = tk.shape[0]
    pos = as_index(fn, "query_pos", query_pos, rank=1, min_len=t)[:t]
    if tk.shape[1] < k:
        fail(fn, "topk_indices", f"must have at least topk = {k} columns", f"width {tk.shape[1]}")
    if nr == 0:
        fail(fn, "seq_lens", "must hold at least one request (the kernel reads request 0)")
    if bool((qsl[1:] < qsl[:-1]).any()):
        fail(fn, "query_start_loc", "must be non-decreasing")
    if bool((pos < 0).any()):
        fail(fn, "query_pos", "must be >= 0 (absolute positions)")
    width = combined_topk_width(k, w)
    starts = qsl - qsl[0]
    tok = torch.arange(t, dtype=torch.int64, device=tk.device)
    req = (torch.searchsorted(starts[:nr].contiguous(), tok, right=True) - 1).clamp(0, nr - 1)
    owned = tok < starts[nr]
    topk_len = torch.where(owned, torch.minimum((pos + 1) // ratio, torch.full_like(pos, k)), 0)
    swa_len = torch.where(owned, torch.minimum(pos + 1, torch.full_like(pos, w)), 0)
    gather_start = sl[req] - gl[req]
    col = torch.arange(width, dtype=torch.int64, device=tk.device)[None, :]
    in_topk = col < topk_len[:, None]
    in_swa = (col < (topk_len + swa_len)[:, None]) & ~in_topk
    tk_cols = torch.full((t, width), -1, dtype=torch.int64, device=tk.device)
    n = min(width, tk.shape[1])
    tk_cols[:, :n] = tk[:, :n]
    shifted = tk_cols + cb[req][:, None]
    if invalid_topk == CombineInvalidTopk.KEPT_MINUS1:
        shifted = torch.where(tk_cols >= 0, shifted, torch.full_like(shifted, -1))
    swa = (sb[req] + pos - swa_len + 1 - gather_start)[:, None] + (col - topk_len[:, None])
    out = torch.where(in_topk, shifted, torch.where(in_swa, swa, torch.full_like(swa, -1)))
    _fits_int32(fn, "compressed_base/swa_base", out)
    return out.to(torch.int32), (topk_len + swa_len).to(torch.int32)


def build_swa_token_ids(
    seq_lens: torch.Tensor,
    extend_seq_lens: torch.Tensor,
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    full_to_swa: torch.Tensor,
    swa_window: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """SGLang's ``build_swa_token_ids`` (``total_swa`` = the sum of the gather lengths, as the
    caller computes it). Per request ``b``: ``g = min(seq_len, extend + W - 1)``, ``first =
    seq_len - g``; ids ``full_to_swa[req_to_token[req_pool_indices[b], first + i]]`` (int64 ->
    int32, truncated like the kernel's ``.to(tl.int32)``) for ``i < g``, packed by request.
    Returns ``(swa_token_ids [sum g], swa_first_pos [R], swa_gather_lens [R], swa_offsets [R+1])``,
    all int32. Positions past ``req_to_token``'s width, pool rows past its height and full ids
    past ``full_to_swa`` raise InputError (the kernel would read out of bounds)."""
    fn = "build_swa_token_ids"
    sl = as_index(fn, "seq_lens", seq_lens, rank=1)
    nr = sl.shape[0]
    ext = as_index(fn, "extend_seq_lens", extend_seq_lens, rank=1, min_len=nr)[:nr]
    pool = as_index(fn, "req_pool_indices", req_pool_indices, rank=1, min_len=nr)[:nr]
    r2t = as_index(fn, "req_to_token", req_to_token, rank=2)
    f2s = as_index(fn, "full_to_swa", full_to_swa, rank=1)
    w = check_int(fn, "swa_window", swa_window, minimum=1)
    if bool((sl < 0).any()) or bool((ext < 0).any()):
        fail(fn, "seq_lens", "seq_lens and extend_seq_lens must be >= 0")
    g = torch.minimum(sl, ext + (w - 1))
    first = sl - g
    offsets = torch.zeros(nr + 1, dtype=torch.int64, device=sl.device)
    offsets[1:] = torch.cumsum(g, 0)
    total = int(offsets[-1])
    if total == 0:
        return (torch.empty(0, dtype=torch.int32, device=sl.device), first.to(torch.int32), g.to(torch.int32),
                offsets.to(torch.int32))
    if bool(((pool < 0) | (pool >= r2t.shape[0])).any()):
        fail(fn, "req_pool_indices", f"must index rows of req_to_token [0, {r2t.shape[0]})")
    if int(sl.max()) > r2t.shape[1]:
        fail(fn, "req_to_token", f"must have at least max(seq_lens) = {int(sl.max())} columns", tuple(r2t.shape))
    req = torch.repeat_interleave(torch.arange(nr, device=sl.device), g)
    i = torch.arange(total, device=sl.device) - offsets[:-1][req]
    full = r2t[pool[req], first[req] + i]
    if bool(((full < 0) | (full >= f2s.shape[0])).any()):
        fail(fn, "req_to_token", f"gathered full ids must index full_to_swa [0, {f2s.shape[0]})")
    ids = f2s[full]
    ids = ((ids + 2**31) % 2**32) - 2**31  # .to(tl.int32): keep the low 32 bits
    return ids.to(torch.int32), first.to(torch.int32), g.to(torch.int32), offsets.to(torch.int32)


def v4_paged_decode_indices(
    state_slot_per_seq: torch.Tensor,
    batch_id_per_token: torch.Tensor,
    positions: torch.Tensor,
    swa_indptr: torch.Tensor,
    csa_indptr: torch.Tensor,
    hca_indptr: torch.Tensor,
    swa_indices: torch.Tensor,
    csa_indices: torch.Tensor,
    hca_indices: torch.Tensor,
    T: int,  # noqa: N803
    win: int,
    ring_stride: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SGLang's ``write_v4_paged_decode_indices`` on copies of the three output buffers (their
    other entries are returned unchanged, so the caller's fill value shows what was not written).

    For ``t < T`` with ``bid = batch_id_per_token[t] >= 0``: ``slot = state_slot_per_seq[bid]``,
    ``p = positions[t]``, ``n = min(p + 1, win)``; for ``i < n``: value ``slot * ring_stride +
    (p - n + 1 + i) % ring_stride`` at ``X_indices[X_indptr[t] + i]`` for X in swa, csa, hca.
    Returns the three buffers, int32. Writes past a buffer, a batch id past ``state_slot_per_seq``
    or a value outside int32 raise InputError (production would write out of bounds / wrap)."""
    fn = "v4_paged_decode_indices"
    t_n = check_int(fn, "T", T, minimum=0)
    w = check_int(fn, "win", win, minimum=1)
    rs = check_int(fn, "ring_stride", ring_stride, minimum=1)
    slots = as_index(fn, "state_slot_per_seq", state_slot_per_seq, rank=1)
    bid = as_index(fn, "batch_id_per_token", batch_id_per_token, rank=1, min_len=t_n)[:t_n]
    pos = as_index(fn, "positions", positions, rank=1, min_len=t_n)[:t_n]
    ptrs = [as_index(fn, f"{x}_indptr", v, rank=1, min_len=t_n + 1) for x, v in
            (("swa", swa_indptr), ("csa", csa_indptr), ("hca", hca_indptr))]
    bufs = [as_index(fn, f"{x}_indices", v, rank=1).clone() for x, v in
            (("swa", swa_indices), ("csa", csa_indices), ("hca", hca_indices))]
    live = bid >= 0
    if bool((bid[live] >= slots.shape[0]).any()):
        fail(fn, "batch_id_per_token", f"must be < len(state_slot_per_seq) = {slots.shape[0]} (or < 0 for padding)")
    for t in torch.nonzero(live).flatten().tolist():
        p = int(pos[t])
        n = min(p + 1, w)
        if n <= 0:
            continue
        i = torch.arange(n, dtype=torch.int64, device=pos.device)
        vals = int(slots[int(bid[t])]) * rs + torch.remainder(p - n + 1 + i, rs)
        _fits_int32(fn, "state_slot_per_seq * ring_stride", vals)
        for name, ptr, buf in zip(("swa", "csa", "hca"), ptrs, bufs):
            start = int(ptr[t])
            if start < 0 or start + n > buf.shape[0]:
                fail(fn, f"{name}_indices", f"token {t} writes [{start}, {start + n}) past its {buf.shape[0]} entries")
            buf[start: start + n] = vals
    return tuple(b.to(torch.int32) for b in bufs)
