"""ROCm ragged index streams + indptr (vLLM's ROCm Triton sparse attention inputs).

Spec: datapath.md 4.7, 4.9; attention.md 2.4 (ROCm Triton: ``0 <= i < num_rows`` and inside the
ragged range).

A ragged stream is a flat int32 vector ``ragged`` plus ``indptr [T+1]``: token ``t`` reads
``ragged[indptr[t] : indptr[t+1]]``. Two builders exist in production and they differ:

- *positional* (:func:`compute_global_topk_ragged_indices_and_indptr`): row length = count of
  valid entries, entries copied BY POSITION from the dense row (a ``-1`` inside the prefix
  survives as ``-1``, a valid entry after it is dropped);
- *compacting* (:func:`build_ragged_indices_from_dense`, :func:`build_prefill_topk_ragged_indices`):
  keeps, in order, every entry with ``col < len``, ``v >= 0`` and (if ``num_rows >= 0``)
  ``v < num_rows``.

They agree exactly when each row's valid entries form a prefix (hazard H10).

Production allocates the flat output with ``T * width`` entries and writes only the first
``indptr[-1]``; the reference returns exactly those ``indptr[-1]`` defined entries.
"""

from __future__ import annotations

import torch

from ..errors import check_int, check_rank, check_tensor, fail
from .slots import as_flags, as_index, lookup_slots, request_token_positions, to_int32


def build_indptr_from_lengths(lengths: torch.Tensor) -> torch.Tensor:
    """``[0, cumsum(lengths)]`` as int32 ``[T+1]``.

    Models ``_build_indptr_from_lengths`` (vLLM 0.33.0 ``models/deepseek_v4/amd/rocm.py:144-148``).
    Raises InputError for negative lengths (a decreasing indptr has no defined ragged range).
    """
    fn = "build_indptr_from_lengths"
    ln = as_index(fn, "lengths", lengths, rank=1)
    if bool((ln < 0).any()):
        fail(fn, "lengths", "must be non-negative")
    indptr = torch.zeros(ln.shape[0] + 1, dtype=torch.int64, device=ln.device)
    indptr[1:] = torch.cumsum(ln, 0)
    return to_int32(fn, "lengths", indptr)


def _rows2d(fn: str, arg: str, t: torch.Tensor) -> torch.Tensor:
    check_tensor(fn, arg, t)
    check_rank(fn, arg, t, (1, 2, 3))
    x = as_index(fn, arg, t)
    return x.reshape(x.shape[0], -1)


def compute_global_topk_ragged_indices_and_indptr(
    topk_indices: torch.Tensor,
    token_to_req_indices: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    is_valid_token: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Positional ragged form of the local top-k -> global slot map (datapath 4.7).

    Models ``compute_global_topk_ragged_indices_and_indptr`` (vLLM 0.33.0
    ``models/deepseek_v4/amd/rocm.py:543-584``; kernels ``_compute_topk_lens_kernel`` ``:345-367``
    and ``_pack_global_topk_ragged_kernel`` ``:370-411``), same argument names and order.

    ``topk_lens[t] = #{k : topk[t, k] >= 0}`` (0 for invalid tokens), ``indptr = [0, cumsum]``,
    ``ragged[indptr[t] + k] = slot(topk[t, k])`` for ``k < topk_lens[t]`` (``-1`` where
    ``topk[t, k] < 0``): by POSITION, not compacted.
    Returns ``(global_topk_ragged int32 [indptr[-1]], topk_indptr int32 [T+1], topk_lens int32 [T])``.
    """
    fn = "compute_global_topk_ragged_indices_and_indptr"
    topk = _rows2d(fn, "topk_indices", topk_indices)
    t, k = topk.shape
    req = as_index(fn, "token_to_req_indices", token_to_req_indices, rank=1, min_len=t)[:t]
    bt = as_index(fn, "block_table", block_table, rank=2)
    bs = check_int(fn, "block_size", block_size, minimum=1)
    valid_tok = as_flags(fn, "is_valid_token", is_valid_token, min_len=t)[:t]
    count = (topk >= 0).sum(dim=1)
    lens = torch.where(valid_tok, count, torch.zeros_like(count))
    cols = torch.arange(k, device=topk.device, dtype=torch.int64)[None, :]
    live = cols < lens[:, None]
    slots = lookup_slots(fn, topk, req, bt, bs, live & (topk >= 0), local_arg="topk_indices value")
    ragged = slots[live]  # row-major: row t's first lens[t] columns, in order
    indptr = build_indptr_from_lengths(lens)
    return to_int32(fn, "block_table", ragged), indptr, lens.to(torch.int32)


def build_ragged_indices_from_dense(indices: torch.Tensor, lengths: torch.Tensor,
                                    num_rows: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """Compacting dense -> ragged conversion (datapath 4.7).

    Models ``build_ragged_indices_from_dense`` (vLLM 0.33.0
    ``v1/attention/ops/rocm_aiter_mla_sparse.py:2073-2142``; kernels
    ``_count_valid_row_entries_kernel`` ``:2002-2041`` and ``_compact_dense_row_to_ragged_kernel``
    ``:2043-2070``), same argument names and order.

    indices ``[T, ...]`` (flattened to ``[T, width]``), lengths ``[T]``. Keeps, in column order,
    the entries with ``col < lengths[t]``, ``v >= 0`` and, if ``num_rows >= 0``, ``v < num_rows``.
    Production casts values to int32 first; int64 values outside the int32 range raise InputError
    here (they would wrap). Returns ``(flat int32 [indptr[-1]], indptr int32 [T+1])``.
    """
    fn = "build_ragged_indices_from_dense"
    idx = _rows2d(fn, "indices", indices)
    ln = as_index(fn, "lengths", lengths).reshape(-1)
    if ln.numel() != idx.shape[0]:
        fail(fn, "lengths", f"must have one entry per row of indices ({idx.shape[0]})",
             f"{ln.numel()} entries")
    nr = check_int(fn, "num_rows", num_rows)
    vals = to_int32(fn, "indices", idx).to(torch.int64)
    cols = torch.arange(idx.shape[1], device=idx.device, dtype=torch.int64)[None, :]
    keep = (cols < ln[:, None]) & (vals >= 0)
    if nr >= 0:
        keep = keep & (vals < nr)
    flat = vals[keep]
    counts = keep.sum(dim=1)
    indptr = torch.zeros(idx.shape[0] + 1, dtype=torch.int64, device=idx.device)
    indptr[1:] = torch.cumsum(counts, 0)
    return flat.to(torch.int32), to_int32(fn, "indices", indptr)


def build_prefill_topk_ragged_indices(
    topk_indices: torch.Tensor,
    token_to_req_indices: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    is_valid_token: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    compress_ratio: int,
    num_compressed: int,
    token_offset: int,
    num_rows: int = -1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill top-k rows -> ragged compressed-cache slots (datapath 4.7).

    Models ``build_prefill_topk_ragged_indices`` (vLLM 0.33.0
    ``v1/attention/ops/rocm_aiter_mla_sparse.py:4709-4756``; kernel
    ``_prefill_topk_global_slots_kernel`` ``:4663-4706``), same argument names and order.

    Row ``i`` is batch token ``t = token_offset + i`` (request ``token_to_req_indices[t]``,
    position from ``query_start_loc`` / ``seq_lens``, batch-wide). ``row_len = min((p+1)//ratio,
    width)`` for valid tokens, 0 otherwise; column ``c < row_len`` with ``0 <= L < num_compressed``
    maps through ``block_table[req]`` (``block_size`` = compressed entries per page), others
    ``-1``; the dense rows are then compacted by :func:`build_ragged_indices_from_dense` with
    ``num_rows``. Returns ``(flat int32 [indptr[-1]], indptr int32 [T+1])``.
    """
    fn = "build_prefill_topk_ragged_indices"
    topk = _rows2d(fn, "topk_indices", topk_indices)
    t, width = topk.shape
    off = check_int(fn, "token_offset", token_offset, minimum=0)
    req_all = as_index(fn, "token_to_req_indices", token_to_req_indices, rank=1, min_len=off + t)
    valid_all = as_flags(fn, "is_valid_token", is_valid_token, min_len=off + t)
    qsl = as_index(fn, "query_start_loc", query_start_loc, rank=1)
    sl = as_index(fn, "seq_lens", seq_lens, rank=1)
    bt = as_index(fn, "block_table", block_table, rank=2)
    bs = check_int(fn, "block_size", block_size, minimum=1)
    ratio = check_int(fn, "compress_ratio", compress_ratio, minimum=1)
    nc = check_int(fn, "num_compressed", num_compressed)
    dev = topk.device
    tok = torch.arange(off, off + t, device=dev, dtype=torch.int64)
    req = req_all[off: off + t]
    valid = valid_all[off: off + t]
    pos = request_token_positions(fn, tok, req, qsl, sl, valid)
    row_len = torch.minimum(torch.div(pos + 1, ratio, rounding_mode="floor"), torch.full_like(pos, width))
    row_len = torch.where(valid, row_len, torch.zeros_like(row_len))
    cols = torch.arange(width, device=dev, dtype=torch.int64)[None, :]
    live = cols < row_len[:, None]
    ok = live & (topk >= 0) & (topk < nc)
    dense = lookup_slots(fn, topk, req, bt, bs, ok, local_arg="topk_indices value")
    dense = to_int32(fn, "block_table", dense)
    return build_ragged_indices_from_dense(dense, row_len.to(torch.int32), num_rows=num_rows)
