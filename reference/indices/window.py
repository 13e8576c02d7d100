"""Visibility tables built from positions alone: the SWA window, the C4 short-context fill and
the C128A table (no indexer).

Spec: datapath.md 4.2 (C4 short-context fill), 4.3 (C128A), 4.4 (SWA window);
attention.md 1.4 (widths), 3.1 (per-layer attention set: window ``max(0, p-W+1) .. p``,
compressed entries ``j < (p+1)//ratio``).

All results are int32, ``-1`` = empty; inputs int32/int64. See ``indices_slots`` for the shared
conventions and the InputError policy (a lookup production would make outside the block table
raises).
"""

from __future__ import annotations

import torch

from ..constants import C128_RATIO, C128A_TOPK_ALIGN, SWA_WINDOW
from ..errors import check_int, fail
from .slots import as_flags, as_index, lookup_slots, request_token_positions, to_int32


def _next_pow2(n: int) -> int:
    """Smallest power of two ``>= n`` (``triton.next_power_of_2`` for ``n >= 1``)."""
    return 1 << (n - 1).bit_length()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# --------------------------------------------------------------------------- SWA window


def swa_window_start(pos: torch.Tensor, w: int, left: torch.Tensor, floor: torch.Tensor | None = None) -> torch.Tensor:
    """First position of the sliding window of tokens at positions ``pos`` (int64 ``[T]``), window
    ``w``: ``max(p - (w-1) - max(left - (w-1), 0), 0)``, where ``left`` (``[T]``) is how far an image
    span makes the token see back (0 without one); raised to ``floor`` (``[T]``) when given -- the
    request's replay start (bounded replay) or the start of its gathered context."""
    start = (pos - (w - 1) - (left - (w - 1)).clamp(min=0)).clamp(min=0)
    return start if floor is None else torch.maximum(start, floor)


def compute_swa_indices_and_lens(
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    token_to_req_indices: torch.Tensor,
    is_valid_token: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    *,
    window_size: int = SWA_WINDOW,
    index_width: int | None = None,
    replay_start: torch.Tensor | None = None,
    left_visible: torch.Tensor | None = None,
    right_visible: torch.Tensor | None = None,
    num_tokens: int | None = None,
    token_offset: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """SWA window indices and lengths, decode and paged prefill (datapath 4.4, attention 1.4).

    Models ``_compute_swa_indices_and_lens_kernel`` (vLLM 0.33.0
    ``v1/attention/backends/mla/sparse_swa.py:1052-1133``, launched through
    ``ComputeSWAIndicesAndLensKernel``; callers ``:668-690`` decode, ``:715-733`` prefill).
    Argument names follow the launcher; the output buffers are returned instead of written.

    Token ``t = token_offset + i`` (``i < num_tokens``) of request ``r = token_to_req_indices[t]``
    has position ``p = seq_len[r] - query_len[r] + (t - query_start_loc[r])``
    (``query_start_loc`` is absolute: decode tokens first, then prefill tokens). For a valid token:

    - ``start = max(p - (W-1) - max(left - (W-1), 0), 0, replay_start[r])``,
      ``end = p + right + 1``, ``len = end - start`` (text: ``left = right = 0``, no replay, so the
      row is positions ``max(p-W+1, 0) .. p`` ascending and ``len = min(p+1, W)``);
    - column ``j < index_width`` holds ``block_table[r, (start+j)//bs]*bs + (start+j)%bs`` if
      ``j < len``, else ``-1`` (left-packed).

    Invalid tokens (``is_valid_token`` False, i.e. ``slot_mapping < 0``): all ``-1`` and len 0.

    window_size: ``W`` (128 in DSv4; a parameter). index_width: row width (default ``W``; the
    prefill builder uses ``W + max_image_tokens``). replay_start: ``[R]`` (V4.1 bounded replay;
    zeros/None for DSv4). left_visible/right_visible: ``[>= token_offset + num_tokens]`` per-token
    image visibility (vision variant, both or neither); indexed by the absolute token number.
    block_size: SWA entries per page (64 in production). num_tokens defaults to
    ``len(is_valid_token) - token_offset``.

    Returns ``(swa_indices int32 [num_tokens, index_width], swa_lens int32 [num_tokens])``.
    ``swa_lens`` is reported as computed even when it exceeds ``index_width`` (vision rows):
    production stores it unclamped; :func:`~.index_validate.validate_indices` flags it.
    """
    fn = "compute_swa_indices_and_lens"
    w = check_int(fn, "window_size", window_size, minimum=1)
    width = w if index_width is None else check_int(fn, "index_width", index_width, minimum=0)
    bs = check_int(fn, "block_size", block_size, minimum=1)
    off = check_int(fn, "token_offset", token_offset, minimum=0)
    valid_all = as_flags(fn, "is_valid_token", is_valid_token)
    n = (valid_all.shape[0] - off) if num_tokens is None else check_int(fn, "num_tokens", num_tokens, minimum=0)
    if n < 0 or valid_all.shape[0] < off + n:
        fail(fn, "is_valid_token", f"must cover tokens [token_offset, token_offset + num_tokens) "
             f"= [{off}, {off + max(n, 0)})", f"{valid_all.shape[0]} entries")
    qsl = as_index(fn, "query_start_loc", query_start_loc, rank=1)
    sl = as_index(fn, "seq_lens", seq_lens, rank=1)
    req_all = as_index(fn, "token_to_req_indices", token_to_req_indices, rank=1, min_len=off + n)
    bt = as_index(fn, "block_table", block_table, rank=2)
    if (left_visible is None) != (right_visible is None):
        fail(fn, "left_visible", "and right_visible must be given together")
    dev = qsl.device
    tok = torch.arange(off, off + n, device=dev, dtype=torch.int64)
    valid = valid_all[off: off + n]
    req = req_all[off: off + n]
    pos = request_token_positions(fn, tok, req, qsl, sl, valid)
    if left_visible is not None:
        left = as_index(fn, "left_visible", left_visible, rank=1, min_len=off + n)[off: off + n]
        right = as_index(fn, "right_visible", right_visible, rank=1, min_len=off + n)[off: off + n]
    else:
        left = right = torch.zeros_like(pos)
    floor = None
    if replay_start is not None:
        rs = as_index(fn, "replay_start", replay_start, rank=1, min_len=sl.shape[0])
        floor = rs[torch.where(valid, req, torch.zeros_like(req))]
    start = swa_window_start(pos, w, left, floor)
    end = pos + right + 1
    lens = torch.where(valid, end - start, torch.zeros_like(end))
    cols = torch.arange(width, device=dev, dtype=torch.int64)
    need = valid[:, None] & (cols[None, :] < lens[:, None])
    local = start[:, None] + cols[None, :]
    slots = lookup_slots(fn, local, req, bt, bs, need, local_arg="window position")
    return to_int32(fn, "block_table", slots), to_int32(fn, "seq_lens", lens)


# --------------------------------------------------------------------------- C4 short-context fill


def fill_short_context_topk_indices(positions: torch.Tensor, TOP_K: int,
                                    COMPRESS_RATIO: int) -> torch.Tensor:  # noqa: N803
    """Local top-k when every visible compressed entry fits (datapath 4.2).

    Models the Triton kernel ``_fill_short_context_topk_indices`` (vLLM 0.33.0
    ``models/deepseek_v4/attention.py:76-91``; used when ``max_seq_len // 4 <= index_topk`` and not
    capturing a CUDA graph, ``:1119-1145``). Argument names are the kernel's (``output`` returned).

    positions: int32/int64 ``[T]`` absolute token positions. Returns int32 ``[T, TOP_K]`` with
    ``out[t, k] = k`` if ``k < (positions[t] + 1) // COMPRESS_RATIO`` else ``-1``: valid entries
    always form a prefix, so the count computed downstream equals the prefix length.
    Negative positions give all ``-1`` rows (the visible count is ``<= 0`` under both floor and
    truncating division).
    """
    fn = "fill_short_context_topk_indices"
    pos = as_index(fn, "positions", positions, rank=1)
    k = check_int(fn, "TOP_K", TOP_K, minimum=0)
    r = check_int(fn, "COMPRESS_RATIO", COMPRESS_RATIO, minimum=1)
    visible = torch.div(pos + 1, r, rounding_mode="floor")
    cols = torch.arange(k, device=pos.device, dtype=torch.int64)
    out = torch.where(cols[None, :] < visible[:, None], cols[None, :].expand(pos.shape[0], k),
                      torch.full((), -1, dtype=torch.int64, device=pos.device))
    return out.to(torch.int32)


# --------------------------------------------------------------------------- C128A


def c128a_topk_width(max_seq_len: int, max_model_len: int, compress_ratio: int = C128_RATIO) -> int:
    """Width of the C128A top-k rows for one batch (datapath 4.3, attention 1.4).

    Models ``DeepseekV4SparseMLAMetadataBuilder._build_c128a_metadata`` (vLLM 0.33.0
    ``models/deepseek_v4/sparse_mla.py:253-261``) with the buffer width of ``:157-163``:
    ``min(max(next_pow2(max(max_seq_len // ratio, 1)), 128), round_up(cdiv(max_model_len, ratio), 128))``.
    Always a multiple of ``C128A_TOPK_ALIGN`` (128). Raises InputError when the width cannot
    hold every visible entry (``max_seq_len > max_model_len``; production asserts).
    """
    fn = "c128a_topk_width"
    s = check_int(fn, "max_seq_len", max_seq_len, minimum=0)
    m = check_int(fn, "max_model_len", max_model_len, minimum=1)
    r = check_int(fn, "compress_ratio", compress_ratio, minimum=1)
    cap = _cdiv(_cdiv(m, r), C128A_TOPK_ALIGN) * C128A_TOPK_ALIGN
    width = min(max(_next_pow2(max(s // r, 1)), C128A_TOPK_ALIGN), cap)
    if width < s // r:
        fail(fn, "max_seq_len", f"must not need more than {width} compressed entries "
             f"(max_model_len {m})", s)
    return width


def build_c128a_topk_metadata(
    positions: torch.Tensor,
    compress_ratio: int,
    num_decode_tokens: int,
    token_to_req_indices: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    slot_mapping: torch.Tensor,
    max_compressed_tokens: int = 8192,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """C128A visibility table (no indexer): every visible compressed entry (datapath 4.3).

    Models ``build_c128a_topk_metadata`` (vLLM 0.33.0 ``models/deepseek_v4/sparse_mla.py:302-361``,
    kernel ``BuildC128ATopkMetadataKernel`` ``:364-450``). Same argument names and order; the three
    output buffers are returned instead of written. ``max_compressed_tokens`` is the row width
    ``Wc`` (see :func:`c128a_topk_width`); it must be a positive multiple of 128.

    With ``n_t = min((positions[t] + 1) // compress_ratio, Wc)``:

    - decode tokens ``t < num_decode_tokens`` (request ``token_to_req_indices[t]``, row of
      ``block_table``, the C128 compressed table, ``block_size`` = entries per compressed page, 2
      in production): ``global[t, k] = block_table[req, k // bs]*bs + k % bs`` for ``k < n_t``,
      else ``-1``; ``decode_lens[t] = n_t`` if ``slot_mapping[t] >= 0`` else ``0``.
    - prefill tokens: ``local[t - D, k] = k`` if ``k < n_t`` else ``-1`` (request-local, for the
      prefill combine).

    Returns ``(global_decode int32 [D, Wc], decode_lens int32 [D], prefill_local int32 [T-D, Wc])``.
    On SM120 production returns the decode rows as views of the full buffer width (``:336-339``);
    the columns past ``Wc`` are not written by the kernel, so only ``[:, :Wc]`` is defined.
    """
    fn = "build_c128a_topk_metadata"
    pos = as_index(fn, "positions", positions, rank=1)
    r = check_int(fn, "compress_ratio", compress_ratio, minimum=1)
    num_tokens = pos.shape[0]
    d = check_int(fn, "num_decode_tokens", num_decode_tokens, minimum=0)
    if d > num_tokens:
        fail(fn, "num_decode_tokens", f"must be <= the number of positions ({num_tokens})", d)
    wc = check_int(fn, "max_compressed_tokens", max_compressed_tokens, minimum=1)
    if wc % C128A_TOPK_ALIGN:
        fail(fn, "max_compressed_tokens", f"must be a multiple of {C128A_TOPK_ALIGN}", wc)
    bs = check_int(fn, "block_size", block_size, minimum=1)
    bt = as_index(fn, "block_table", block_table, rank=2)
    req = as_index(fn, "token_to_req_indices", token_to_req_indices, rank=1, min_len=d)[:d]
    sm = as_index(fn, "slot_mapping", slot_mapping, rank=1, min_len=d)[:d]
    n = torch.div(pos + 1, r, rounding_mode="floor").clamp(max=wc)
    cols = torch.arange(wc, device=pos.device, dtype=torch.int64)
    vis = cols[None, :] < n[:, None]  # [T, Wc]
    dec_vis = vis[:d]
    local = cols[None, :].expand(d, wc)
    glob = lookup_slots(fn, local, req, bt, bs, dec_vis, local_arg="compressed index")
    count = dec_vis.sum(dim=1)
    lens = torch.where(sm >= 0, count, torch.zeros_like(count))
    pre = torch.where(vis[d:], cols[None, :].expand(num_tokens - d, wc),
                      torch.full((), -1, dtype=torch.int64, device=pos.device))
    return to_int32(fn, "block_table", glob), lens.to(torch.int32), pre.to(torch.int32)
