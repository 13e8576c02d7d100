"""Prefill gather workspace plan and the combined prefill index rows (FlashMLA / ROCm prefill).

Spec: datapath.md 4.5, 7 H10/H11; attention.md 1.4 ("Prefill ... one combined row per token").

The prefill path dequantises, per chunk of prefill requests, a bf16 workspace
``kv[chunk_reqs, M, 512]``: request row ``r`` holds its compressed entries ``0 .. seq_len//ratio - 1``
at rows ``[0, seq_len//ratio)`` and its last ``gather_len`` raw tokens (positions
``seq_len - gather_len .. seq_len - 1``) at rows ``[N, N + gather_len)``. The combined index row of
a query token addresses that workspace flattened to ``[chunk_reqs * M, 512]``: compressed entries
first, the window after. All results are int32 except the chunk plan (Python ints).
"""

from __future__ import annotations

import torch

from ..constants import PREFILL_WIDTH_ALIGN
from ..errors import check_enum, check_int, fail
from ..policies import CombineInvalidTopk, CombineWindowStart
from .slots import as_index, to_int32
from .window import swa_window_start


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 0 else 1


# --------------------------------------------------------------------------- workspace plan


def compute_prefill_gather_lens(
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    replay_start: torch.Tensor | None,
    num_prefills: int,
    num_decodes: int,
    window_size: int,
) -> torch.Tensor:
    """Raw tokens gathered per prefill request (datapath 4.5).

    Models ``ComputePrefillMetadataKernel`` (vLLM 0.33.0 ``v1/attention/backends/mla/
    sparse_swa.py:342-384``; caller ``:970-981``), argument order of its kernel (output returned).
    Prefill request ``i`` is batch request ``num_decodes + i``; with ``query_len``, ``seq_len`` and
    ``prefix = seq_len - query_len``: ``gather_len = query_len + min(max(prefix - replay_start, 0),
    window_size - 1)``. ``replay_start`` None means zeros (DSv4). Returns int32 ``[num_prefills]``.
    """
    fn = "compute_prefill_gather_lens"
    p = check_int(fn, "num_prefills", num_prefills, minimum=0)
    d = check_int(fn, "num_decodes", num_decodes, minimum=0)
    w = check_int(fn, "window_size", window_size, minimum=1)
    sl = as_index(fn, "seq_lens", seq_lens, rank=1, min_len=d + p)
    qsl = as_index(fn, "query_start_loc", query_start_loc, rank=1, min_len=d + p + 1)
    idx = torch.arange(d, d + p, device=sl.device)
    qlen = qsl[idx + 1] - qsl[idx]
    prefix = sl[idx] - qlen
    if bool((qlen < 0).any()) or bool((prefix < 0).any()):
        fail(fn, "seq_lens", "must be >= query_len >= 0 for every prefill request")
    rs = torch.zeros_like(prefix)
    if replay_start is not None:
        rs = as_index(fn, "replay_start", replay_start, rank=1, min_len=d + p)[idx]
    gather = qlen + torch.minimum((prefix - rs).clamp(min=0), torch.full_like(prefix, w - 1))
    return to_int32(fn, "seq_lens", gather)


def get_prefill_chunk_plan(
    prefill_seq_lens: torch.Tensor,
    prefill_query_lens: torch.Tensor,
    compress_ratio: int,
    prefill_chunk_size: int,
    *,
    prefill_max_model_len: int,
    prefill_window_size: int,
    prefill_max_num_batched_tokens: int,
    has_compressed: bool | None = None,
) -> list[tuple[int, int, int, int]]:
    """Greedy split of the prefill requests into workspace chunks ``(start, end, N, M)``.

    Models ``DeepseekSparseSWAMetadata.get_prefill_chunk_plan`` (vLLM 0.33.0
    ``v1/attention/backends/mla/sparse_swa.py:260-339``); the metadata fields it reads are
    arguments here. ``has_compressed`` defaults to ``compress_ratio > 1`` (DSv4).

    Per request: ``compressed = seq_len // ratio`` (0 without a compressed cache) and the gather
    upper bound ``query_len + clamp(seq_len - query_len, 0, W - 1)`` (replay not considered, as in
    production: the plan is an upper bound). A chunk grows while
    ``(#requests) * (max compressed + max gather) <= prefill_chunk_size * (cdiv(max_model_len,
    ratio) [if compressed] + W + max_num_batched_tokens)``; it always takes at least one request.
    ``N`` = max compressed of the chunk, ``M = N + max gather``. Returns a list of int tuples.
    """
    fn = "get_prefill_chunk_plan"
    sl = as_index(fn, "prefill_seq_lens", prefill_seq_lens, rank=1)
    ql = as_index(fn, "prefill_query_lens", prefill_query_lens, rank=1)
    if ql.shape != sl.shape:
        fail(fn, "prefill_query_lens", f"must have the shape of prefill_seq_lens {tuple(sl.shape)}",
             f"shape {tuple(ql.shape)}")
    r = check_int(fn, "compress_ratio", compress_ratio, minimum=1)
    chunk = check_int(fn, "prefill_chunk_size", prefill_chunk_size, minimum=1)
    mml = check_int(fn, "prefill_max_model_len", prefill_max_model_len, minimum=1)
    w = check_int(fn, "prefill_window_size", prefill_window_size, minimum=1)
    mbt = check_int(fn, "prefill_max_num_batched_tokens", prefill_max_num_batched_tokens, minimum=1)
    comp = (r > 1) if has_compressed is None else bool(has_compressed)
    area = chunk * ((_cdiv(mml, r) if comp else 0) + w + mbt)
    seqs = [int(v) for v in sl.tolist()]
    qls = [int(v) for v in ql.tolist()]
    gather = [q + min(max(s - q, 0), w - 1) for s, q in zip(seqs, qls)]
    compressed = [s // r if comp else 0 for s in seqs]
    plan: list[tuple[int, int, int, int]] = []
    start, n = 0, len(seqs)
    while start < n:
        cmax, gmax, end = compressed[start], gather[start], start + 1
        while end < n:
            c2, g2 = max(cmax, compressed[end]), max(gmax, gather[end])
            if (end - start + 1) * (c2 + g2) > area:
                break
            cmax, gmax, end = c2, g2, end + 1
        plan.append((start, end, cmax, cmax + gmax))
        start = end
    return plan


def prefill_workspace_rows(
    seq_lens: torch.Tensor,
    gather_lens: torch.Tensor,
    compress_ratio: int,
    N: int,  # noqa: N803
    M: int,  # noqa: N803
    has_compressed: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """What each workspace row of a chunk holds (datapath 4.5, the two gathers of
    ``V:models/deepseek_v4/nvidia/flashmla.py:329-349`` into ``kv[r, :, :]``).

    seq_lens, gather_lens: ``[R]`` of the chunk's requests. Returns int32
    ``(compressed_local [R, M], swa_position [R, M])``: ``compressed_local[r, i] = i`` for
    ``i < seq_len // ratio`` (compressed entry ``i``) and ``swa_position[r, N + i] = seq_len -
    gather_len + i`` for ``i < gather_len`` (raw token position); ``-1`` elsewhere. Flattened row
    ``r * M + i`` is what a combined index addresses. Raises InputError if the rows overflow
    ``N`` / ``M``.
    """
    fn = "prefill_workspace_rows"
    sl = as_index(fn, "seq_lens", seq_lens, rank=1)
    gl = as_index(fn, "gather_lens", gather_lens, rank=1)
    if gl.shape != sl.shape:
        fail(fn, "gather_lens", f"must have the shape of seq_lens {tuple(sl.shape)}", f"shape {tuple(gl.shape)}")
    r = check_int(fn, "compress_ratio", compress_ratio, minimum=1)
    n = check_int(fn, "N", N, minimum=0)
    m = check_int(fn, "M", M, minimum=n)
    comp = (r > 1) if has_compressed is None else bool(has_compressed)
    nc = torch.div(sl, r, rounding_mode="floor") if comp else torch.zeros_like(sl)
    if bool((nc > n).any()):
        fail(fn, "N", "must hold every request's compressed entries (seq_len // ratio)", n)
    if bool((gl < 0).any()) or bool((gl > sl).any()) or bool((n + gl > m).any()):
        fail(fn, "gather_lens", f"must satisfy 0 <= gather_len <= seq_len and N + gather_len <= M ({m})")
    rows = torch.arange(m, device=sl.device, dtype=torch.int64)[None, :]
    neg = torch.full((), -1, dtype=torch.int64, device=sl.device)
    comp_local = torch.where(rows < nc[:, None], rows.expand(sl.shape[0], m), neg)
    i = rows - n
    swa = torch.where((i >= 0) & (i < gl[:, None]), (sl - gl)[:, None] + i, neg)
    return comp_local.to(torch.int32), swa.to(torch.int32)


# --------------------------------------------------------------------------- combine


def _combine_common_args(fn, topk_indices, query_start_loc, seq_lens, gather_lens, window_size,
                         compress_ratio, topk, M, N, max_image_tokens):
    topk_i = as_index(fn, "topk_indices", topk_indices, rank=(2, 3))
    topk_i = topk_i.reshape(topk_i.shape[0], -1)
    sl = as_index(fn, "seq_lens", seq_lens, rank=1)
    num_reqs = sl.shape[0]
    qsl = as_index(fn, "query_start_loc", query_start_loc, rank=1, min_len=num_reqs + 1)
    gl = as_index(fn, "gather_lens", gather_lens, rank=1, min_len=num_reqs)[:num_reqs]
    w = check_int(fn, "window_size", window_size, minimum=1)
    r = check_int(fn, "compress_ratio", compress_ratio, minimum=1)
    k = check_int(fn, "topk", topk, minimum=0)
    m = check_int(fn, "M", M, minimum=0)
    n = check_int(fn, "N", N, minimum=0)
    img = check_int(fn, "max_image_tokens", max_image_tokens, minimum=0)
    # query_start_loc is a global tensor; the kernel rebases it on its first entry
    # (V:.../cache_utils.py:870-874).
    base = qsl[0]
    starts = qsl[:num_reqs] - base
    ends = qsl[1: num_reqs + 1] - base
    qlen = ends - starts
    if bool((qlen < 0).any()):
        fail(fn, "query_start_loc", "must be non-decreasing")
    if num_reqs and int(ends[-1]) != topk_i.shape[0]:
        fail(fn, "query_start_loc", "must cover exactly the rows of topk_indices "
             f"(query_start_loc[-1] - query_start_loc[0] == {topk_i.shape[0]}); rows of no request "
             "would be left undefined", int(ends[-1]))
    if bool((sl < qlen).any()) or bool((gl < 0).any()) or bool((gl > sl).any()):
        fail(fn, "gather_lens", "must satisfy 0 <= gather_len <= seq_len and seq_len >= query_len")
    req = torch.repeat_interleave(torch.arange(num_reqs, device=sl.device), qlen)
    first = torch.repeat_interleave(torch.cumsum(qlen, 0) - qlen, qlen)
    in_q = torch.arange(req.numel(), device=sl.device) - first  # token index inside its query
    pos = sl[req] - qlen[req] + in_q
    return topk_i, sl, gl, w, r, k, m, n, img, req, pos


def _visibility(fn, left_visible, right_visible, load: bool, t: int, pos):
    if not load:
        z = torch.zeros_like(pos)
        return z, z
    left = as_index(fn, "left_visible", left_visible, rank=1, min_len=t)[:t]
    right = as_index(fn, "right_visible", right_visible, rank=1, min_len=t)[:t]
    return left, right


def combine_topk_swa_indices(
    topk_indices: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    gather_lens: torch.Tensor,
    window_size: int,
    compress_ratio: int,
    topk: int,
    M: int,  # noqa: N803
    N: int,  # noqa: N803
    *,
    left_visible: torch.Tensor | None = None,
    right_visible: torch.Tensor | None = None,
    max_image_tokens: int = 0,
    invalid_topk: CombineInvalidTopk | str = CombineInvalidTopk.SHIFTED_BY_BASE,
    window_start: CombineWindowStart | str = CombineWindowStart.SEQUENCE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combined prefill rows, common (NVIDIA) form, faithfully including its divergence.

    Models ``combine_topk_swa_indices`` (vLLM 0.33.0 ``models/deepseek_v4/common/ops/
    cache_utils.py:752-1077``, kernel ``CombineTopkSwaIndicesKernel``). Same argument names and
    order (``out`` dropped; ``left_visible``/``right_visible``/``max_image_tokens`` keyword-only).

    topk_indices ``[T, K]``: request-local compressed indices of the chunk's ``T`` query tokens
    (indexer output for C4A, ``build_c128a_topk_metadata``'s prefill rows for C128A; ignored when
    ``topk = 0``, SWA-only layers). ``query_start_loc`` ``[R+1]`` is rebased on its first entry
    (a non-zero base is normal: the chunk's slice of the global tensor) and must cover ``T`` rows.
    seq_lens, gather_lens ``[R]``; ``M``, ``N`` from the chunk plan.

    For token ``t`` of chunk request ``r`` at position ``p``: ``topk_len = min((p+1)//ratio, topk)``
    (H11: NOT the indexer's own count), ``swa_start = max(p - (W-1) - max(left-(W-1), 0), 0)``,
    ``swa_len = p + right - swa_start + 1``, ``gather_start = seq_len - gather_len``:

    - ``out[t, k] = topk[t, k] + M*r`` for ``k < topk_len`` with NO validity check: a ``-1`` inside
      the first ``topk_len`` columns becomes ``M*r - 1``, the last workspace row of request
      ``r-1`` (documented divergence, hazard H10; reproduced on purpose, flagged by
      :func:`~.index_validate.find_combine_minus1`); a ``-1`` of request 0 stays ``-1``.
    - ``out[t, topk_len + j] = M*r + N + swa_start + j - gather_start`` for ``j < swa_len``.
    - every other column ``-1``; width ``ceil128(topk + W + max_image_tokens)``;
      ``combined_lens[t] = topk_len + swa_len``.

    The image visibility (``left``, ``right``) is read only when ``left_visible`` is given AND
    ``max_image_tokens > 0`` (the kernel's ``IMAGE_WIDTH``); the kernel stores at most
    ``ceil((W + IMAGE_WIDTH) / W) * W`` window columns. Rows where production would read past the
    top-k row (``topk_len > K``) or write past its own row raise InputError.

    The two named policies give vLLM 0.33.0's V4.1 kernel of the same name (``deepseek_v41/common/
    ops/cache_utils.py``), which differs in exactly these (``invalid_topk = bounded_minus1``,
    ``window_start = gathered``; it has no image visibility): ``invalid_topk``
    (:class:`~.policies.CombineInvalidTopk`) what a top-k entry outside ``[0, N)`` becomes;
    ``window_start`` (:class:`~.policies.CombineWindowStart`) whether the window is clamped to
    ``gather_start``. The defaults are the V4 common form described above.
    Returns ``(combined_indices int32 [T, width], combined_lens int32 [T])``.
    """
    fn = "combine_topk_swa_indices"
    invalid_topk = check_enum(fn, "invalid_topk", CombineInvalidTopk, invalid_topk)
    window_start = check_enum(fn, "window_start", CombineWindowStart, window_start)
    if invalid_topk == CombineInvalidTopk.KEPT_MINUS1:
        fail(fn, "invalid_topk", "must be shifted_by_base or bounded_minus1 here (kept_minus1 is SGLang's "
             "form: indices_sglang.combine_topk_swa_indices_sglang)", invalid_topk.value)
    topk_i, sl, gl, w, r, k, m, n, img, req, pos = _combine_common_args(
        fn, topk_indices, query_start_loc, seq_lens, gather_lens, window_size, compress_ratio,
        topk, M, N, max_image_tokens)
    t = topk_i.shape[0]
    width = _cdiv(k + w + img, PREFILL_WIDTH_ALIGN) * PREFILL_WIDTH_ALIGN
    image_width = img if left_visible is not None else 0
    if left_visible is not None and right_visible is None:
        fail(fn, "right_visible", "must be given with left_visible")
    left, right = _visibility(fn, left_visible, right_visible, image_width > 0, t, pos)
    topk_len = torch.minimum(torch.div(pos + 1, r, rounding_mode="floor"), torch.full_like(pos, k))
    if t and bool((topk_len > topk_i.shape[1]).any()):
        (i,) = (int(x) for x in (topk_len > topk_i.shape[1]).nonzero()[0])
        fail(fn, "topk_indices", f"must have at least topk_len = {int(topk_len[i])} columns for token "
             f"{i} (the kernel would read past the row)", f"width {topk_i.shape[1]}")
    gather_start = (sl - gl)[req]
    swa_start = swa_window_start(pos, w, left, gather_start if window_start == CombineWindowStart.GATHERED else None)
    swa_len = (pos + right - swa_start + 1).clamp(min=0)  # below 0 only when clamped to gather_start
    swa_cap = _cdiv(w + image_width, w) * w
    written = torch.minimum(swa_len.clamp(min=0), torch.full_like(swa_len, swa_cap))
    if t and bool((topk_len + written > width).any()):
        fail(fn, "max_image_tokens", f"must make the row wide enough: a window of "
             f"{int(swa_len.max())} after up to {k} top-k entries does not fit {width} columns")
    cols = torch.arange(width, device=pos.device, dtype=torch.int64)[None, :]
    out = torch.full((t, width), -1, dtype=torch.int64, device=pos.device)
    base = (m * req)[:, None]
    kk = min(width, topk_i.shape[1])
    in_topk = cols[:, :kk] < topk_len[:, None]
    vals = topk_i[:, :kk] + base
    if invalid_topk == CombineInvalidTopk.BOUNDED_MINUS1:
        ok = (topk_i[:, :kk] >= 0) & (topk_i[:, :kk] < n)
        vals = torch.where(ok, vals, torch.full_like(vals, -1))
    out[:, :kk] = torch.where(in_topk, vals, out[:, :kk])
    j = cols - topk_len[:, None]
    in_swa = (j >= 0) & (j < written[:, None])
    swa_val = base + n + swa_start[:, None] + j - gather_start[:, None]
    out = torch.where(in_swa, swa_val, out)
    lens = topk_len + swa_len
    return to_int32(fn, "M", out), to_int32(fn, "seq_lens", lens)


def combine_topk_swa_indices_rocm(
    topk_indices: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    gather_lens: torch.Tensor,
    window_size: int,
    compress_ratio: int,
    topk: int,
    M: int,  # noqa: N803
    N: int,  # noqa: N803
    max_image_tokens: int = 0,
    left_visible: torch.Tensor | None = None,
    right_visible: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combined prefill rows, ROCm (validating) form.

    Models ``combine_topk_swa_indices`` of vLLM 0.33.0 ``models/deepseek_v4/amd/rocm.py:280-340``
    (kernel ``_combine_topk_swa_indices_kernel`` ``:197-278``), same argument names and order.
    Differences from the common form (:func:`combine_topk_swa_indices`):

    - a top-k entry outside ``[0, N)`` becomes ``-1`` (it stays inside the prefix and is counted
      by ``combined_lens``, a hole that FlashMLA-prefill-style consumers skip);
    - ``swa_start = max(max(p - (W-1) - left_add, 0), gather_start)``,
      ``swa_end = min(p + right + 1, seq_len)``, ``swa_len = max(swa_end - swa_start, 0)``, at most
      ``W + max_image_tokens`` window columns stored;
    - top-k reads past the input width are redirected to column 0 (the kernel's
      ``safe_topk_offset``), and only ``k < next_pow2(K)`` columns are stored: both modelled.
    - the image visibility is read whenever ``left_visible`` is given.

    Width ``ceil128(topk + W + max_image_tokens)``; ``combined_lens = topk_len + swa_len``.
    Returns ``(combined_indices int32 [T, width], combined_lens int32 [T])``.
    """
    fn = "combine_topk_swa_indices_rocm"
    if (left_visible is None) != (right_visible is None):
        fail(fn, "left_visible", "and right_visible must be provided together")
    topk_i, sl, gl, w, r, k, m, n, img, req, pos = _combine_common_args(
        fn, topk_indices, query_start_loc, seq_lens, gather_lens, window_size, compress_ratio,
        topk, M, N, max_image_tokens)
    t, kw = topk_i.shape
    swa_width = w + img
    width = _cdiv(k + swa_width, PREFILL_WIDTH_ALIGN) * PREFILL_WIDTH_ALIGN
    left, right = _visibility(fn, left_visible, right_visible, left_visible is not None, t, pos)
    topk_len = torch.minimum(torch.div(pos + 1, r, rounding_mode="floor"), torch.full_like(pos, k))
    if t and kw == 0 and bool((topk_len > 0).any()):
        fail(fn, "topk_indices", "must have at least one column when topk > 0")
    gather_start = (sl - gl)[req]
    swa_start = swa_window_start(pos, w, left, gather_start)
    swa_end = torch.minimum(pos + right + 1, sl[req])
    swa_len = (swa_end - swa_start).clamp(min=0)
    cols = torch.arange(width, device=pos.device, dtype=torch.int64)[None, :]
    out = torch.full((t, width), -1, dtype=torch.int64, device=pos.device)
    base = (m * req)[:, None]
    stored = min(width, _next_pow2(kw))
    if kw and t:
        src_col = torch.where(cols[:, :stored] < kw, cols[:, :stored], torch.zeros_like(cols[:, :stored]))
        vals = topk_i.gather(1, src_col.expand(t, stored))
        ok = (vals >= 0) & (vals < n)
        vals = torch.where(ok, vals + base, torch.full_like(vals, -1))
        in_topk = cols[:, :stored] < topk_len[:, None]
        out[:, :stored] = torch.where(in_topk, vals, out[:, :stored])
    j = cols - topk_len[:, None]
    in_swa = (j >= 0) & (j < swa_len[:, None]) & (j < swa_width)
    out = torch.where(in_swa, base + n + j + swa_start[:, None] - gather_start[:, None], out)
    lens = topk_len + swa_len
    return to_int32(fn, "M", out), to_int32(fn, "seq_lens", lens)
