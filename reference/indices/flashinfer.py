"""FlashInfer trtllm-gen mixed sparse-index table (SM100 path): SWA columns first, compressed after.

Spec: datapath.md 4.6; attention.md 1.4 ("FI trtllm-gen / CAKE: one combined table"), 2.4
(validity: columns ``< sparse_topk_lens`` and ``!= -1``; the first 128 columns also bounded by
``seq_lens``), 2.5.

Results are int32, ``-1`` = empty; inputs int32/int64 (production asserts int32; the reference
widens). See ``indices_slots`` for the InputError policy.
"""

from __future__ import annotations

import torch

from ..constants import FLASHINFER_ROW_ALIGN
from ..errors import check_int, fail
from .slots import as_flags, as_index, lookup_slots, request_token_positions, to_int32
from .window import swa_window_start


def remap_flashinfer_index(values: torch.Tensor, block_size: int, block_span: int) -> torch.Tensor:
    """``v >= 0 ? (v // block_size) * block_span + v % block_size : -1`` (datapath 4.6).

    Models the Triton helper ``_remap_flashinfer_index`` (vLLM 0.33.0
    ``models/deepseek_v4/common/ops/cache_utils.py:1244-1254``): FlashInfer indexes sparse KV by
    physical token stride, so a slot of a packed page pool (``block_span = page_stride //
    token_stride > block_size``) is re-expressed in token-stride units. Identity when
    ``block_span == block_size``. Every negative value maps to ``-1``. int64 in, int64 out.
    """
    valid = values >= 0
    safe = torch.where(valid, values, torch.zeros_like(values))
    mapped = torch.div(safe, block_size, rounding_mode="floor") * block_span + torch.remainder(safe, block_size)
    return torch.where(valid, mapped, torch.full_like(values, -1))


def build_flashinfer_mixed_sparse_indices(
    decode_swa_indices: torch.Tensor,
    decode_compressed_indices: torch.Tensor | None,
    decode_compressed_topk_lens: torch.Tensor | None,
    prefill_topk_indices: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    token_to_req_indices: torch.Tensor,
    swa_block_table: torch.Tensor,
    swa_block_size: int,
    compressed_block_table: torch.Tensor | None,
    compressed_block_size: int,
    window_size: int,
    compress_ratio: int,
    topk: int,
    decode_compressed_indices_are_local: bool = False,
    decode_is_valid_token: torch.Tensor | None = None,
    swa_block_span: int | None = None,
    compressed_block_span: int | None = None,
    prefill_left_visible: torch.Tensor | None = None,
    prefill_right_visible: torch.Tensor | None = None,
    max_image_tokens: int = 0,
    num_rows: int | None = None,
    replay_start: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The FlashInfer DSv4 mixed table for a decode-first batch (datapath 4.6).

    Models ``build_flashinfer_mixed_sparse_indices`` (vLLM 0.33.0
    ``models/deepseek_v4/common/ops/cache_utils.py:1083-1241``, kernel
    ``BuildFlashinferMixedSparseIndicesKernel`` ``:1257-1532``), same argument names and order.

    Layout: ``SW = decode_swa_indices.shape[-1] + image_width`` SWA columns, then
    ``Pk = ceil4(max(topk, DC))`` compressed columns (``DC`` = width of
    ``decode_compressed_indices``, 0 if None; 4 int32 = one 16-byte load). ``image_width =
    max_image_tokens`` if ``prefill_left_visible`` is given, else 0. Every stored value goes
    through :func:`remap_flashinfer_index` with the page span of its cache (default: the block
    size, i.e. identity). Token ``t`` of the call is a decode token if ``t < D = len(decode_swa_indices)``,
    else prefill token ``t - D``; ``query_start_loc`` / ``token_to_req_indices`` use that numbering.

    Decode rows (causal, ``decode_swa_indices.shape[-1] == window_size``):
      columns ``< SW``: ``remap(decode_swa_indices[t, c])`` (``-1`` past its width);
      column ``SW + k``: ``remap(v)``, ``v = decode_compressed_indices[t, k]`` for ``k < DC`` else
      ``-1``; if ``decode_compressed_indices_are_local`` (C4), ``v`` is first mapped through
      ``compressed_block_table[req]`` (``-1`` stays ``-1``);
      ``len = SW + c``: ``c`` = count of ``v >= 0`` on tokens with ``decode_is_valid_token`` (local
      form), ``decode_compressed_topk_lens[t]`` (global form with lens, C128), ``DC`` (global form
      without lens), ``0`` if ``DC == 0``. The SWA part always counts ``SW`` columns, even for
      padding tokens (FlashInfer bounds the SWA columns by ``seq_lens`` itself, attention 2.4).
    Decode rows, DSpark non-causal (``decode_swa_indices.shape[-1] > window_size``): the first
      ``window_len = min(context + i + 1, W)`` SWA entries at columns ``[0, window_len)``, the
      ``spill_len = min(context, W) + query_len - window_len`` following entries at
      ``[W, W + spill_len)``, compressed block from column ``W + spill_len``, ``-1`` after;
      ``len = W + spill_len + c`` (``cache_utils.py:1352-1457``).
    Prefill rows (position ``p`` from ``query_start_loc`` / ``seq_lens``):
      SWA column ``j < SW``: slot of position ``swa_start + j`` through ``swa_block_table[req]`` if
      ``j < swa_len`` else ``-1``, with ``swa_start = max(p - (W-1) - max(left - (W-1), 0), 0)``,
      ``swa_len = p + right - swa_start + 1``; with ``replay_start`` (int ``[num_reqs]``, >= 0; the
      DeepSeek-V4.1 builder's SWA bounded replay, vLLM 0.33.0 ``deepseek_v41/common/ops/
      cache_utils.py:1519-1520``) ``swa_start = max(swa_start, replay_start[req])``: no window KV
      exists below it, and a token below its request's replay start has no SWA column
      (``swa_len <= 0``); ``None`` = zeros, the V4 builder;
      compressed column ``k``: ``L = prefill_topk_indices[t - D, k]`` if ``k <`` its width and
      ``k < topk_len`` (else ``-1``), mapped through ``compressed_block_table[req]`` if ``L >= 0``;
      ``len = SW + topk_len`` with ``topk_len = min((p+1)//compress_ratio, topk)`` (H11).

    num_rows: production allocates ``num_rows >= T`` rows and leaves rows ``>= T`` unset
    (``torch.empty``); the reference returns only the ``T`` defined rows.
    Returns ``(sparse_indices int32 [T, SW + Pk], sparse_topk_lens int32 [T])``.
    """
    fn = "build_flashinfer_mixed_sparse_indices"
    dswa = as_index(fn, "decode_swa_indices", decode_swa_indices, rank=2)
    w = check_int(fn, "window_size", window_size, minimum=1)
    swi = dswa.shape[1]
    if swi < w:
        fail(fn, "decode_swa_indices", f"must be at least window_size = {w} columns wide", swi)
    has_image = prefill_left_visible is not None
    if has_image and prefill_right_visible is None:
        fail(fn, "prefill_right_visible", "must be given with prefill_left_visible")
    img = check_int(fn, "max_image_tokens", max_image_tokens, minimum=0)
    image_width = img if has_image else 0
    sw = swi + image_width
    ptopk = as_index(fn, "prefill_topk_indices", prefill_topk_indices, rank=2)
    nd, npf = dswa.shape[0], ptopk.shape[0]
    t_all = nd + npf
    qsl = as_index(fn, "query_start_loc", query_start_loc, rank=1)
    sl = as_index(fn, "seq_lens", seq_lens, rank=1)
    req_all = as_index(fn, "token_to_req_indices", token_to_req_indices, rank=1, min_len=t_all)[:t_all]
    swa_bt = as_index(fn, "swa_block_table", swa_block_table, rank=2)
    swa_bs = check_int(fn, "swa_block_size", swa_block_size, minimum=1)
    c_bt = swa_bt if compressed_block_table is None else as_index(
        fn, "compressed_block_table", compressed_block_table, rank=2)
    c_bs = check_int(fn, "compressed_block_size", compressed_block_size, minimum=1)
    ratio = check_int(fn, "compress_ratio", compress_ratio, minimum=1)
    k_top = check_int(fn, "topk", topk, minimum=0)
    swa_span = swa_bs if swa_block_span is None else check_int(fn, "swa_block_span", swa_block_span, minimum=1)
    c_span = c_bs if compressed_block_span is None else check_int(
        fn, "compressed_block_span", compressed_block_span, minimum=1)
    dc = 0
    if decode_compressed_indices is not None:
        dcomp = as_index(fn, "decode_compressed_indices", decode_compressed_indices, rank=2)
        if dcomp.shape[0] != nd:
            fail(fn, "decode_compressed_indices", f"must have one row per decode token ({nd})",
                 f"shape {tuple(dcomp.shape)}")
        dc = dcomp.shape[1]
    local = bool(decode_compressed_indices_are_local) and dc > 0
    if local:
        if decode_is_valid_token is None:
            fail(fn, "decode_is_valid_token", "is required when decode_compressed_indices_are_local")
        dvalid = as_flags(fn, "decode_is_valid_token", decode_is_valid_token, min_len=nd)[:nd]
    has_lens = decode_compressed_topk_lens is not None
    if has_lens:
        dlens = as_index(fn, "decode_compressed_topk_lens", decode_compressed_topk_lens, rank=1, min_len=nd)[:nd]
    pk = -(-max(k_top, dc) // FLASHINFER_ROW_ALIGN) * FLASHINFER_ROW_ALIGN
    if num_rows is not None and check_int(fn, "num_rows", num_rows, minimum=0) < t_all:
        fail(fn, "num_rows", f"must be >= the number of tokens ({t_all})", num_rows)
    width = sw + pk
    dev = dswa.device
    out = torch.full((t_all, width), -1, dtype=torch.int64, device=dev)
    lens = torch.zeros(t_all, dtype=torch.int64, device=dev)
    if t_all == 0:
        return out.to(torch.int32), lens.to(torch.int32)

    # ----------------------------------------------------------------- decode rows
    if nd:
        req = req_all[:nd]
        noncausal = swi > w
        cols_sw = torch.arange(sw, device=dev, dtype=torch.int64)[None, :].expand(nd, sw)
        if noncausal:
            num_reqs = sl.shape[0]
            if qsl.shape[0] < num_reqs + 1:
                fail(fn, "query_start_loc", f"must have num_reqs + 1 = {num_reqs + 1} entries",
                     f"shape {tuple(qsl.shape)}")
            if bool(((req < 0) | (req >= num_reqs)).any()):
                fail(fn, "token_to_req_indices", f"must name a request in [0, {num_reqs}) for every "
                     "decode token of a non-causal (DSpark) batch")
            q_start = qsl[req]
            qlen = qsl[req + 1] - q_start
            context = sl[req] - qlen
            tiq = torch.arange(nd, device=dev) - q_start
            window_len = torch.minimum(context + tiq + 1, torch.full_like(tiq, w))
            spill_len = torch.minimum(context, torch.full_like(tiq, w)) + qlen - window_len
            block_tok = (tiq >= 0) & (tiq < qlen)
            window_len = torch.where(block_tok, window_len, torch.zeros_like(window_len))
            spill_len = torch.where(block_tok, spill_len, torch.zeros_like(spill_len))
            comp_start = w + spill_len
            if bool((comp_start > sw).any()):
                fail(fn, "decode_swa_indices", "must be wide enough for the window plus the spilled "
                     f"block (window_size + spill_len <= {sw})", int(comp_start.max()))
            spill = cols_sw >= w
            src = torch.where(spill, cols_sw - w + window_len[:, None], cols_sw)
            src_ok = torch.where(spill, cols_sw < (w + spill_len)[:, None], cols_sw < window_len[:, None])
            if bool((src_ok & (src >= swi)).any()):
                fail(fn, "decode_swa_indices", "must hold window_len + spill_len entries per row", swi)
            write = cols_sw < comp_start[:, None]
        else:
            src = cols_sw
            src_ok = cols_sw < swi
            comp_start = torch.full((nd,), sw, dtype=torch.int64, device=dev)
            write = torch.ones_like(src_ok)
        vals = dswa.gather(1, torch.where(src_ok, src, torch.zeros_like(src)).clamp(max=max(swi - 1, 0)))
        vals = torch.where(src_ok, vals, torch.full_like(vals, -1))
        vals = remap_flashinfer_index(vals, swa_bs, swa_span)
        out[:nd, :sw] = torch.where(write, vals, out[:nd, :sw])

        ck = torch.arange(pk, device=dev, dtype=torch.int64)[None, :].expand(nd, pk)
        if dc:
            cv = torch.full((nd, pk), -1, dtype=torch.int64, device=dev)
            cv[:, :min(dc, pk)] = dcomp[:, :pk]
        else:
            cv = torch.full((nd, pk), -1, dtype=torch.int64, device=dev)
        c = torch.zeros(nd, dtype=torch.int64, device=dev)
        if local:
            ok = cv >= 0
            cv = lookup_slots(fn, cv, req, c_bt, c_bs, ok, local_arg="decode_compressed_indices value",
                              table_arg="compressed_block_table")
            c = (ok & dvalid[:, None]).sum(dim=1)
        elif dc:
            c = dlens if has_lens else torch.full((nd,), dc, dtype=torch.int64, device=dev)
        cv = remap_flashinfer_index(cv, c_bs, c_span)
        # compressed block at columns comp_start + k, then -1 to the end of the row
        rowcols = torch.arange(width, device=dev, dtype=torch.int64)[None, :]
        kidx = rowcols - comp_start[:, None]
        in_comp = (kidx >= 0) & (kidx < pk)
        comp_vals = cv.gather(1, kidx.clamp(min=0, max=max(pk - 1, 0))) if pk else torch.full_like(kidx, -1)
        dec = out[:nd]
        dec = torch.where(in_comp, comp_vals, dec)
        dec = torch.where(rowcols >= comp_start[:, None] + pk, torch.full_like(dec, -1), dec)
        out[:nd] = dec
        lens[:nd] = comp_start + c

    # ----------------------------------------------------------------- prefill rows
    if npf:
        tok = torch.arange(nd, t_all, device=dev, dtype=torch.int64)
        req = req_all[nd:]
        pos = request_token_positions(fn, tok, req, qsl, sl, torch.ones_like(tok, dtype=torch.bool))
        if image_width > 0:
            left = as_index(fn, "prefill_left_visible", prefill_left_visible, rank=1, min_len=t_all)[nd:t_all]
            right = as_index(fn, "prefill_right_visible", prefill_right_visible, rank=1, min_len=t_all)[nd:t_all]
        else:
            left = right = torch.zeros_like(pos)
        floor = None
        if replay_start is not None:
            rs = as_index(fn, "replay_start", replay_start, rank=1, min_len=sl.shape[0])
            if rs.numel() and int(rs.min()) < 0:
                fail(fn, "replay_start", "must be >= 0 (a position of the request)", int(rs.min()))
            floor = rs[req]
        swa_start = swa_window_start(pos, w, left, floor)
        swa_len = pos + right - swa_start + 1
        topk_len = torch.minimum(torch.div(pos + 1, ratio, rounding_mode="floor"), torch.full_like(pos, k_top))
        cols = torch.arange(sw, device=dev, dtype=torch.int64)[None, :]
        need = cols < swa_len[:, None]
        swa = lookup_slots(fn, swa_start[:, None] + cols, req, swa_bt, swa_bs, need,
                           local_arg="window position", table_arg="swa_block_table")
        out[nd:, :sw] = remap_flashinfer_index(swa, swa_bs, swa_span)
        pw = ptopk.shape[1]
        kc = torch.arange(pk, device=dev, dtype=torch.int64)[None, :]
        lv = torch.full((npf, pk), -1, dtype=torch.int64, device=dev)
        lv[:, :min(pw, pk)] = ptopk[:, :pk]
        lv = torch.where((kc < pw) & (kc < topk_len[:, None]), lv, torch.full_like(lv, -1))
        slots = lookup_slots(fn, lv, req, c_bt, c_bs, lv >= 0, local_arg="prefill_topk_indices value",
                             table_arg="compressed_block_table")
        out[nd:, sw:] = remap_flashinfer_index(slots, c_bs, c_span)
        lens[nd:] = sw + topk_len
    return to_int32(fn, "swa_block_table", out), to_int32(fn, "decode_compressed_topk_lens", lens)
