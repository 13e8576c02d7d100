"""Block-table plumbing: request-local positions <-> global cache slots.

Spec: datapath.md 1.3 (slot formula), 4.1 (local top-k -> global slots + lengths), 4.8
(compressed write slots), 4.9 / 7 H10 (sentinels); attention.md 1.4, 2.4-2.5.

Conventions (docs/architecture.md "Canonical data conventions"):

- A *local* index is an index inside one request: a token position for the SWA cache, a
  compressed-entry index ``j`` for a compressed cache. A *global slot* is
  ``block_table[req, L // bs] * bs + L % bs`` (datapath 1.3), ``bs`` = entries per page of the
  cache being addressed (64 for SWA and C4, 2 for C128 in production).
- Index tensors may be int32 or int64 on input; results are int32 (except
  :func:`get_compressed_slot_mapping`, int64 as in production). Arithmetic is int64 and every
  int32 result is range-checked, so CPU and CUDA give identical values and nothing wraps.
- ``-1`` is the empty sentinel of every result.
- Data-dependent preconditions (a block table narrower than a valid local index needs, a request
  index outside the table, a valid token outside its request's query range) raise
  :class:`~.errors.InputError` naming the argument, the offending token/column and the rule:
  production reads out of bounds there, so no value would be a faithful model.

The helpers ``as_index``, ``as_flags``, ``lookup_slots``, ``to_int32`` and
``request_token_positions`` are shared by the other ``indices_*`` modules.
"""

from __future__ import annotations

import torch

from ..errors import INDEX_DTYPES, check_dtype, check_int, check_rank, check_tensor, fail

INT32_MIN = -(2**31)
INT32_MAX = 2**31 - 1

# --------------------------------------------------------------------------- argument helpers


def as_index(fn: str, arg: str, t: object, rank: int | tuple[int, ...] | None = None,
             min_len: int | None = None) -> torch.Tensor:
    """Validate an int32/int64 index tensor and return it as int64 (same device).

    ``min_len``: the first dimension must hold at least this many entries (production buffers
    are often longer than the live prefix; only the prefix is read).
    """
    check_dtype(fn, arg, t, INDEX_DTYPES)
    if rank is not None:
        check_rank(fn, arg, t, rank)
    if min_len is not None and (t.dim() == 0 or t.shape[0] < min_len):
        fail(fn, arg, f"must have at least {min_len} entries along dim 0", f"shape {tuple(t.shape)}")
    return t.to(torch.int64)


def as_flags(fn: str, arg: str, t: object, min_len: int | None = None) -> torch.Tensor:
    """Validate a 1-D per-token flag tensor (bool, or int32/int64 holding only 0/1); return bool."""
    check_tensor(fn, arg, t)
    check_rank(fn, arg, t, 1)
    if t.dtype != torch.bool:
        check_dtype(fn, arg, t, (torch.bool,) + INDEX_DTYPES)
        if t.numel() and bool(((t != 0) & (t != 1)).any()):
            fail(fn, arg, "must be bool (or an integer tensor holding only 0 and 1)")
        t = t != 0
    if min_len is not None and t.shape[0] < min_len:
        fail(fn, arg, f"must have at least {min_len} entries", f"shape {tuple(t.shape)}")
    return t


def to_int32(fn: str, what: str, t: torch.Tensor) -> torch.Tensor:
    """Cast an int64 result to int32, raising if a value would wrap (production computes int32)."""
    if t.numel() and (int(t.min()) < INT32_MIN or int(t.max()) > INT32_MAX):
        bad = int(t.max()) if int(t.max()) > INT32_MAX else int(t.min())
        fail(fn, what, "produces a value outside the int32 range, which the production kernel "
             "computes in int32 and would wrap", bad)
    return t.to(torch.int32)


def _first(mask: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(i) for i in mask.nonzero()[0])


def lookup_slots(fn: str, local: torch.Tensor, req: torch.Tensor, block_table: torch.Tensor,
                 block_size: int, need: torch.Tensor, *, local_arg: str = "local index",
                 req_arg: str = "token_to_req_indices", table_arg: str = "block_table") -> torch.Tensor:
    """``block_table[req, L // bs] * bs + L % bs`` for every entry where ``need`` is True.

    local: int64 ``[T, K]`` local indices (must be ``>= 0`` where ``need``).
    req:   int64 ``[T]`` request row of each token.
    block_table: int64 ``[R, B]``.
    need:  bool ``[T, K]``.
    Returns int64 ``[T, K]``: the slot where ``need``, ``-1`` elsewhere. Raises InputError when a
    needed lookup would leave the table (request row outside ``[0, R)`` or column ``>= B``).
    """
    out = torch.full(local.shape, -1, dtype=torch.int64, device=local.device)
    if not bool(need.any()):
        return out
    num_reqs, width = block_table.shape
    col = torch.div(local, block_size, rounding_mode="floor")
    rows_need = need.any(dim=1)
    bad_req = rows_need & ((req < 0) | (req >= num_reqs))
    if bool(bad_req.any()):
        (t,) = _first(bad_req)
        fail(fn, req_arg, f"must index a row of {table_arg} (0 <= req < {num_reqs}) for every "
             f"token that needs a lookup", f"token {t} has request {int(req[t])}")
    bad_col = need & (col >= width)
    if bool(bad_col.any()):
        t, k = _first(bad_col)
        fail(fn, table_arg, f"is narrower than the local indices need: {local_arg} "
             f"{int(local[t, k])} (token {t}, column {k}) needs block-table column "
             f"{int(col[t, k])}, the table has {width} columns")
    safe_req = torch.where(rows_need, req, torch.zeros_like(req))[:, None].expand_as(local)
    safe_col = torch.where(need, col, torch.zeros_like(col))
    blocks = block_table[safe_req, safe_col]
    slots = blocks * block_size + torch.remainder(local, block_size)
    return torch.where(need, slots, out)


def request_token_positions(fn: str, token_ids: torch.Tensor, req: torch.Tensor,
                            query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                            check: torch.Tensor) -> torch.Tensor:
    """Absolute position of each token: ``seq_len[r] - query_len[r] + (t - query_start[r])``.

    token_ids: int64 ``[T]`` token numbers in the numbering of ``query_start_loc``.
    req:       int64 ``[T]`` request of each token.
    check:     bool ``[T]``: tokens that must lie inside their request's query range with a
               non-negative position (InputError otherwise). Unchecked tokens get position 0
               where their request index is out of range.
    This is how every vLLM index kernel derives a position (e.g. ``V:v1/attention/backends/mla/
    sparse_swa.py:1087-1095``); no kernel reads a positions tensor except the C128A builder.
    """
    num_reqs = seq_lens.shape[0]
    if query_start_loc.shape[0] < num_reqs + 1:
        fail(fn, "query_start_loc", f"must have num_reqs + 1 = {num_reqs + 1} entries",
             f"shape {tuple(query_start_loc.shape)}")
    bad_req = check & ((req < 0) | (req >= num_reqs))
    if bool(bad_req.any()):
        (i,) = _first(bad_req)
        fail(fn, "token_to_req_indices", f"must name a request in [0, {num_reqs}) for every "
             "valid token", f"token {int(token_ids[i])} has request {int(req[i])}")
    safe = torch.where((req >= 0) & (req < num_reqs), req, torch.zeros_like(req))
    q_start = query_start_loc[safe]
    q_end = query_start_loc[safe + 1]
    seq = seq_lens[safe]
    pos = seq - (q_end - q_start) + (token_ids - q_start)
    outside = check & ((token_ids < q_start) | (token_ids >= q_end))
    if bool(outside.any()):
        (i,) = _first(outside)
        fail(fn, "token_to_req_indices", "must place every valid token inside its request's "
             "query range [query_start_loc[r], query_start_loc[r+1])",
             f"token {int(token_ids[i])} -> request {int(req[i])} with range "
             f"[{int(q_start[i])}, {int(q_end[i])})")
    negative = check & (pos < 0)
    if bool(negative.any()):
        (i,) = _first(negative)
        fail(fn, "seq_lens", "must be >= the query length of every request (positions are "
             "seq_len - query_len + offset)", f"request {int(req[i])}: seq_len {int(seq[i])}, "
             f"query_len {int(q_end[i] - q_start[i])}")
    return pos


def _block_size(fn: str, block_size: object, arg: str = "block_size") -> int:
    return check_int(fn, arg, block_size, minimum=1)


# --------------------------------------------------------------------------- forward maps


def local_to_global_slots(local_indices: torch.Tensor, token_to_req_indices: torch.Tensor,
                          block_table: torch.Tensor, block_size: int) -> torch.Tensor:
    """Map request-local indices to global slots (datapath 1.3): ``bt[r, L//bs]*bs + L%bs``.

    local_indices: int32/int64 ``[T]`` or ``[T, K]``; row ``t`` belongs to request
        ``token_to_req_indices[t]``. Every negative value is the empty sentinel (policy: the
        vLLM Triton kernels test ``L >= 0``, datapath 4.1) and maps to ``-1``.
    token_to_req_indices: int32/int64 ``[>= T]`` (only the first ``T`` entries are read).
    block_table: int32/int64 ``[R, B]`` physical page numbers. block_size: entries per page.
    Returns int32 of the shape of ``local_indices``. Raises InputError where production would
    read outside the block table (a valid index needing column ``>= B``).
    """
    fn = "local_to_global_slots"
    local = as_index(fn, "local_indices", local_indices, rank=(1, 2))
    bs = _block_size(fn, block_size)
    bt = as_index(fn, "block_table", block_table, rank=2)
    squeeze = local.dim() == 1
    local2 = local[:, None] if squeeze else local
    req = as_index(fn, "token_to_req_indices", token_to_req_indices, rank=1,
                   min_len=local2.shape[0])[: local2.shape[0]]
    slots = lookup_slots(fn, local2, req, bt, bs, local2 >= 0, local_arg="local index")
    slots = to_int32(fn, "block_table", slots)
    return slots[:, 0] if squeeze else slots


def compute_global_topk_indices_and_lens(
    topk_indices: torch.Tensor,
    token_to_req_indices: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    is_valid_token: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Local top-k -> global compressed-cache slots and per-token lengths (datapath 4.1).

    Models ``compute_global_topk_indices_and_lens`` (vLLM 0.33.0
    ``models/deepseek_v4/common/ops/cache_utils.py:550-741``, Triton kernel
    ``ComputeGlobalTopkIndicesAndLensKernel``), same argument names and order.

    topk_indices: int32/int64 ``[T, K]`` local compressed indices, negative = empty.
    token_to_req_indices: ``[>= T]`` request row per token. block_table: ``[R, B]`` compressed
    block table. block_size: entries per compressed page (``256 // ratio`` in production: 64 for
    C4, 2 for C128). is_valid_token: bool ``[>= T]`` (``slot_mapping >= 0``).

    Returns ``(global_topk_indices int32 [T, K], topk_lens int32 [T])``:

    - ``global[t, k] = block_table[req, L // bs] * bs + L % bs`` if ``L = topk[t, k] >= 0`` else
      ``-1``. Rows of padding tokens are mapped too (production does; only their length is 0).
    - ``topk_lens[t] = #{k : topk[t, k] >= 0}`` for valid tokens, ``0`` for padding tokens. This is
      a COUNT, as vLLM computes it, not a prefix length: consumers read the first ``len``
      columns, so the two agree only when the valid entries form a prefix (hazard H10). Use
      :func:`~.index_validate.validate_indices` to flag rows where they do not.

    Policy where production is undefined: production has no upper-bound check on ``L`` and reads
    past the block-table row; here that raises InputError.
    """
    fn = "compute_global_topk_indices_and_lens"
    topk = as_index(fn, "topk_indices", topk_indices, rank=2)
    num_tokens = topk.shape[0]
    req = as_index(fn, "token_to_req_indices", token_to_req_indices, rank=1,
                   min_len=num_tokens)[:num_tokens]
    bt = as_index(fn, "block_table", block_table, rank=2)
    bs = _block_size(fn, block_size)
    valid_tok = as_flags(fn, "is_valid_token", is_valid_token, min_len=num_tokens)[:num_tokens]
    valid = topk >= 0
    slots = to_int32(fn, "block_table", lookup_slots(fn, topk, req, bt, bs, valid,
                                                     local_arg="topk_indices value"))
    count = valid.sum(dim=1)
    lens = torch.where(valid_tok, count, torch.zeros_like(count)).to(torch.int32)
    return slots, lens


def abs_indices2indices_in_kvcache(abs_indices: torch.Tensor, block_table: torch.Tensor,
                                   block_size: int) -> torch.Tensor:
    """FlashMLA test-helper form of the block-table map (datapath 4.1, last paragraph).

    Models ``abs_indices2indices_in_kvcache`` of FlashMLA ``tests/quant.py:126-158`` (commit
    9241ae3): ``abs_indices [b, s_q, topk]`` holds positions of batch row ``b``, mapped through
    ``block_table[b]``. Only ``-1`` is the sentinel (kept as ``-1``), exactly as in the helper.

    Policy: the helper maps any other negative value through a flattened block table (it lands
    in the previous batch row's table, or fails for ``b = 0``), so there is no faithful value:
    other negatives raise InputError, as does a position whose page column is ``>= B``.
    Returns int32 ``[b, s_q, topk]``.
    """
    fn = "abs_indices2indices_in_kvcache"
    idx = as_index(fn, "abs_indices", abs_indices, rank=3)
    bt = as_index(fn, "block_table", block_table, rank=2)
    bs = _block_size(fn, block_size)
    if bt.shape[0] < idx.shape[0]:
        fail(fn, "block_table", f"must have a row per batch row ({idx.shape[0]})",
             f"shape {tuple(bt.shape)}")
    other_neg = idx < -1
    if bool(other_neg.any()):
        b, s, k = _first(other_neg)
        fail(fn, "abs_indices", "may hold -1 as its only negative value (the helper treats only "
             "-1 as invalid; other negatives have no defined mapping)",
             f"{int(idx[b, s, k])} at [{b}, {s}, {k}]")
    b, s_q, k = idx.shape
    flat = idx.reshape(b, s_q * k)
    req = torch.arange(b, device=idx.device, dtype=torch.int64)
    slots = lookup_slots(fn, flat, req, bt, bs, flat >= 0, local_arg="abs_indices value",
                         req_arg="abs_indices")
    return to_int32(fn, "block_table", slots).reshape(b, s_q, k)


# --------------------------------------------------------------------------- inverse map


def slots_to_request_positions(slots: torch.Tensor, block_table: torch.Tensor, block_size: int,
                               seq_lens: torch.Tensor | None = None
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of the block-table map: global slot -> (request row, local position).

    slots: int32/int64, any shape. block_table: ``[R, B]``. block_size: entries per page.
    seq_lens: optional ``[R]``: if given, request ``r`` owns only the table cells of its first
        ``ceil(seq_len[r] / bs)`` columns (vLLM block tables carry padding cells, e.g. the null
        block 0, after the live ones); if absent, every cell with a non-negative block number.
    Returns ``(req, pos)`` int32 of the shape of ``slots``: ``pos = c * bs + s % bs`` where
    ``block_table[req, c] == s // bs`` is the owning cell. ``(-1, -1)`` for negative slots and for
    slots whose page no request owns (tell the two apart with ``slots >= 0``). A position in the
    owned last page but past ``seq_len`` still maps (ownership is per page).
    Raises InputError if a physical page is owned by two cells (the inverse is ambiguous).
    """
    fn = "slots_to_request_positions"
    s = as_index(fn, "slots", slots)
    bt = as_index(fn, "block_table", block_table, rank=2)
    bs = _block_size(fn, block_size)
    num_reqs, width = bt.shape
    cols = torch.arange(width, device=bt.device, dtype=torch.int64)
    owned = bt >= 0
    if seq_lens is not None:
        sl = as_index(fn, "seq_lens", seq_lens, rank=1)
        if sl.shape[0] != num_reqs:
            fail(fn, "seq_lens", f"must have one entry per block-table row ({num_reqs})",
                 f"shape {tuple(sl.shape)}")
        pages = torch.div(sl + bs - 1, bs, rounding_mode="floor")
        if bool((pages > width).any()):
            (r,) = _first(pages > width)
            fail(fn, "block_table", f"is narrower than seq_lens need: request {r} has "
                 f"seq_len {int(sl[r])} = {int(pages[r])} pages, the table has {width} columns")
        owned = owned & (cols[None, :] < pages[:, None])
    own_r, own_c = owned.nonzero(as_tuple=True)
    own_b = bt[own_r, own_c]
    order = torch.argsort(own_b, stable=True)
    own_b, own_r, own_c = own_b[order], own_r[order], own_c[order]
    if own_b.numel() > 1:
        dup = own_b[1:] == own_b[:-1]
        if bool(dup.any()):
            (i,) = _first(dup)
            fail(fn, "block_table", "must not list one physical page in two owned cells (the "
                 "inverse map would be ambiguous)",
                 f"page {int(own_b[i])} at [{int(own_r[i])}, {int(own_c[i])}] and "
                 f"[{int(own_r[i + 1])}, {int(own_c[i + 1])}]")
    page = torch.div(s, bs, rounding_mode="floor")
    req = torch.full_like(s, -1)
    pos = torch.full_like(s, -1)
    if own_b.numel():
        at = torch.searchsorted(own_b, page.reshape(-1)).reshape(s.shape)
        at_c = at.clamp(max=own_b.numel() - 1)
        hit = (s >= 0) & (at < own_b.numel()) & (own_b[at_c] == page)
        req = torch.where(hit, own_r[at_c], req)
        pos = torch.where(hit, own_c[at_c] * bs + torch.remainder(s, bs), pos)
    return to_int32(fn, "slots", req), to_int32(fn, "slots", pos)


# --------------------------------------------------------------------------- compressed write slots


def get_compressed_slot_mapping(
    num_tokens: int,
    slot_mapping: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    compress_ratio: int,
    dcp_world_size: int = 1,
    cp_interleave: int = 1,
) -> torch.Tensor:
    """Slot each token writes its compressed state to, or ``-1`` (datapath 4.8).

    Models ``get_compressed_slot_mapping`` (vLLM 0.33.0
    ``v1/attention/backends/mla/compressor_utils.py:186-229``, kernel
    ``CompressedSlotMappingKernel`` ``:31-183``, body ``:46-107``), same argument names and order (``out`` dropped).

    For request ``r`` (one per block-table row) and its query token ``t`` at position
    ``p = seq_len[r] - query_len[r] + (t - query_start_loc[r])`` with own slot
    ``s = slot_mapping[t]``: the token writes iff ``(p + 1) % compress_ratio == 0`` and
    ``s != -1`` (production compares with PAD_ID = -1 only, so other negatives count as valid;
    modelled faithfully). Then ``j = local_pos // compress_ratio`` with
    ``local_pos = p // (cp_interleave * dcp_world_size) * cp_interleave + p % cp_interleave``
    (``= p`` without DCP), and the slot is ``block_table[r, j // bs] * bs + j % bs``.

    block_size: entries per compressed page (``kv_cache_spec.num_states``: 64 for C4, 2 for C128).
    The production caller clamps the block table to ``>= 0`` first (``V:models/deepseek_v4/
    sparse_mla.py:199``); this function uses the table as given.
    Returns int64 ``[num_tokens]`` (as production); tokens of no request stay ``-1``.
    """
    fn = "get_compressed_slot_mapping"
    n = check_int(fn, "num_tokens", num_tokens, minimum=0)
    sm = as_index(fn, "slot_mapping", slot_mapping, rank=1)
    qsl = as_index(fn, "query_start_loc", query_start_loc, rank=1)
    sl = as_index(fn, "seq_lens", seq_lens, rank=1)
    bt = as_index(fn, "block_table", block_table, rank=2)
    bs = _block_size(fn, block_size)
    ratio = check_int(fn, "compress_ratio", compress_ratio, minimum=1)
    dcp = check_int(fn, "dcp_world_size", dcp_world_size, minimum=1)
    inter = check_int(fn, "cp_interleave", cp_interleave, minimum=1)
    num_reqs = bt.shape[0]
    if sl.shape[0] < num_reqs or qsl.shape[0] < num_reqs + 1:
        fail(fn, "query_start_loc", f"and seq_lens must cover every block-table row ({num_reqs})",
             f"query_start_loc {tuple(qsl.shape)}, seq_lens {tuple(sl.shape)}")
    out = torch.full((n,), -1, dtype=torch.int64, device=sm.device)
    if num_reqs == 0:
        return out
    starts, ends = qsl[:num_reqs], qsl[1: num_reqs + 1]
    qlen = ends - starts
    if bool((qlen < 0).any()) or bool((starts < 0).any()):
        fail(fn, "query_start_loc", "must be non-negative and non-decreasing")
    total = int(ends.max())
    if total > n or total > sm.shape[0]:
        fail(fn, "query_start_loc", f"must stay within num_tokens ({n}) and slot_mapping "
             f"({sm.shape[0]} entries)", f"a request ends at token {total}")
    req = torch.repeat_interleave(torch.arange(num_reqs, device=sm.device), qlen)
    first = torch.repeat_interleave(torch.cumsum(qlen, 0) - qlen, qlen)
    tok = starts[req] + (torch.arange(req.numel(), device=sm.device) - first)
    pos = sl[req] - qlen[req] + (tok - starts[req])
    if bool((pos < 0).any()):
        (i,) = _first(pos < 0)
        fail(fn, "seq_lens", "must be >= query length of every request",
             f"request {int(req[i])}")
    valid = (torch.remainder(pos + 1, ratio) == 0) & (sm[tok] != -1)
    local_pos = torch.div(pos, inter * dcp, rounding_mode="floor") * inter + torch.remainder(pos, inter)
    j = torch.div(local_pos, ratio, rounding_mode="floor")
    slots = lookup_slots(fn, j[:, None], req, bt, bs, valid[:, None],
                         local_arg="compressed index")[:, 0]
    out[tok] = slots
    return out
