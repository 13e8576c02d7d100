"""Pure layout / convention conversions between the canonical forms and what kernels take.

Everything here is plain torch on whatever device the tensors live on, CPU-testable, and exact
(integer and copy operations only; the one float conversion, ``lse_plus_inf_to_minus_inf``, only
replaces a sentinel). Conventions (docs/architecture.md "Canonical data conventions"; attention.md 1.2,
1.4, 2.2, 2.5):

* query heads are padded with zero rows and the sink with ``-inf`` (vLLM ``attention.py:248-250``
  fills the padded sink with ``-inf``; ``nvidia/flashmla.py:77-85`` pads to 64 or 128), then the
  padded heads are sliced off the outputs;
* top-k index rows are padded with ``-1`` to the kernel's block multiple (vLLM pads with ``-1``,
  attention.md 1.4 "Alignment constraints");
* a 584-byte paged cache is accepted as ``[num_blocks, page_stride]`` or the kernel views
  ``[num_blocks, bs, 584]`` / ``[num_blocks, bs, 1, 584]`` (strides ``(P, 584, [584,] 1)``);
* FlashMLA reports a lonely query's LSE as ``+inf``; the canonical LSE uses ``-inf``.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from dsv4_numerics.reference.constants import MLA_D_QK, RECORD_BYTES
from dsv4_numerics.reference.errors import (
    INDEX_DTYPES,
    InputError,
    UnsupportedCase,
    check_dtype,
    check_int,
    check_rank,
    check_tensor,
    fail,
)
from dsv4_numerics.reference.storage import clone_storage

FLASHMLA_HEADS = (64, 128)  # sparse_decode.h:327-334 (decode); vLLM pads prefill the same way
FLASHINFER_HEADS = (8, 16, 32, 64, 128)  # FI mla/_core.py:1107; vLLM flashinfer_sparse.py:78-89
# Alignment of a page start for 128-bit loads: FlashMLA SM90 loads 16-byte vectors at
# page + e*576 (splitkv_mla.cuh `load_128b_from_gmem`); FlashInfer SM120 / CAKE require a page
# stride that is a multiple of 16 (attention_validation.h:47-54, FI _core.py CAKE checks).
PAGE_ALIGN_BYTES = 16


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def padded_heads(h: int, supported: tuple[int, ...], kernel: str) -> int:
    """The smallest supported head count ``>= h`` (vLLM's padding rule); ``UnsupportedCase`` if
    ``h`` exceeds the largest."""
    check_int("padded_heads", "h", h, minimum=1)
    for s in supported:
        if h <= s:
            return s
    raise UnsupportedCase(f"{kernel} supports at most {max(supported)} query heads (got {h})")


def pad_heads(q: torch.Tensor, sink: torch.Tensor | None, hp: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``q [T, H, D]`` -> ``[T, hp, D]`` with zero rows appended; ``sink [H]`` -> ``[hp]`` float32
    with ``-inf`` appended (``None`` stays ``None``). Always returns fresh contiguous tensors."""
    fn = "pad_heads"
    check_rank(fn, "q", q, 3)
    t, h, d = q.shape
    check_int(fn, "hp", hp, minimum=h)
    qp = q.new_zeros((t, hp, d))
    qp[:, :h] = q
    sp = None
    if sink is not None:
        check_tensor(fn, "sink", sink)
        if sink.dim() != 1 or sink.shape[0] != h:
            fail(fn, "sink", f"must have shape [{h}] (one logit per query head)", tuple(sink.shape))
        sp = torch.full((hp,), float("-inf"), dtype=torch.float32, device=sink.device)
        sp[:h] = sink.to(torch.float32)
    return qp, sp


def pad_topk(idx: torch.Tensor, multiple: int, minimum: int = 0) -> torch.Tensor:
    """``idx [T, K]`` (int32/int64) -> int32 ``[T, K']``, ``K' = max(round_up(K, multiple),
    minimum)``, new columns ``-1``. Always a fresh contiguous tensor."""
    fn = "pad_topk"
    check_rank(fn, "idx", idx, 2)
    check_dtype(fn, "idx", idx, INDEX_DTYPES)
    check_int(fn, "multiple", multiple, minimum=1)
    t, k = idx.shape
    kp = max(round_up(k, multiple), minimum)
    if idx.dtype == torch.int64:
        lo, hi = int(torch.iinfo(torch.int32).min), int(torch.iinfo(torch.int32).max)
        if idx.numel() and (int(idx.min()) < lo or int(idx.max()) > hi):
            fail(fn, "idx", "must fit in int32 (kernels take int32 indices)")
    out = torch.full((t, kp), -1, dtype=torch.int32, device=idx.device)
    out[:, :k] = idx.to(torch.int32)
    return out


def lengths_int32(lens: torch.Tensor | None, t: int, fn: str, arg: str) -> torch.Tensor | None:
    """Per-token prefix lengths ``[T]`` as contiguous int32 (``None`` stays ``None``)."""
    if lens is None:
        return None
    check_dtype(fn, arg, lens, INDEX_DTYPES)
    if lens.dim() != 1 or lens.shape[0] != t:
        fail(fn, arg, f"must have shape [{t}]", tuple(lens.shape))
    if lens.numel() and int(lens.min()) < 0:
        fail(fn, arg, "must be >= 0 (a prefix length)")
    return lens.to(torch.int32).contiguous()


def lse_plus_inf_to_minus_inf(lse: torch.Tensor) -> torch.Tensor:
    """FlashMLA's empty-row sentinel ``+inf`` -> the canonical ``-inf`` (attention 2.2). Finite
    values and NaN are unchanged (a finite logit set never has ``lse = +inf``)."""
    check_tensor("lse_plus_inf_to_minus_inf", "lse", lse)
    return torch.where(lse == float("inf"), torch.full_like(lse, float("-inf")), lse)


def paged_cache_view(cache: torch.Tensor, block_size: int, fn: str = "paged_cache_view",
                     arg: str = "cache") -> torch.Tensor:
    """A 584-byte paged cache in any canonical form -> the kernel view ``[num_blocks, bs, 1, 584]``
    uint8 with strides ``(P, 584, 584, 1)`` over the same storage (no copy). ``P`` is the page
    stride in bytes (``cache.stride(0)``), which must be ``>= bs*584``."""
    check_int(fn, "block_size", block_size, minimum=1)
    check_dtype(fn, arg, cache, (torch.uint8,))
    if cache.dim() not in (2, 3, 4):
        fail(fn, arg, "must be [num_blocks, page_stride], [num_blocks, bs, 584] or "
                      "[num_blocks, bs, 1, 584]", tuple(cache.shape))
    if cache.stride(-1) != 1:
        fail(fn, arg, "must have a contiguous last dimension", tuple(cache.stride()))
    nb = cache.shape[0]
    page = cache.stride(0)
    if cache.dim() == 2:
        if cache.shape[1] < block_size * RECORD_BYTES:
            fail(fn, arg, f"pages must hold block_size*{RECORD_BYTES} = {block_size * RECORD_BYTES} bytes",
                 tuple(cache.shape))
    else:
        if cache.shape[1] != block_size or cache.shape[-1] != RECORD_BYTES:
            fail(fn, arg, f"kernel view must be [num_blocks, {block_size}, (1,) {RECORD_BYTES}]",
                 tuple(cache.shape))
        if cache.dim() == 4 and cache.shape[2] != 1:
            fail(fn, arg, "must have one KV head (dim 2 of size 1)", tuple(cache.shape))
        if cache.stride(1) != RECORD_BYTES:
            fail(fn, arg, f"rows of the kernel view must be {RECORD_BYTES} bytes apart", tuple(cache.stride()))
    if nb > 1 and page < block_size * RECORD_BYTES:
        fail(fn, arg, f"page stride {page} is smaller than block_size*{RECORD_BYTES}")
    return cache.as_strided((nb, block_size, 1, RECORD_BYTES), (page, RECORD_BYTES, RECORD_BYTES, 1),
                            cache.storage_offset())


def aligned_pages(view: torch.Tensor, align: int = PAGE_ALIGN_BYTES) -> torch.Tensor:
    """``view [nb, bs, 1, R]`` (R = 584, or 528 / 288 for the V4.1 records) unchanged if its base address and page stride are multiples of
    ``align`` bytes; otherwise a repacked copy with page stride ``round_up(P, align)`` holding the
    same ``bs*R`` bytes per page (the bytes a kernel reads are identical; only the padding
    between pages changes). Kernels that issue 128-bit loads at page starts need this: vLLM's
    allocator always gives multiples of 576 (datapath 1.2), test cases may use odd strides."""
    check_rank("aligned_pages", "view", view, 4)
    nb, bs, rb = view.shape[0], view.shape[1], view.shape[-1]  # rb: 584, or a V4.1 record's 528 / 288
    page = view.stride(0)
    if page % align == 0 and view.data_ptr() % align == 0:
        return view
    new_page = round_up(max(page, bs * rb), align)
    flat = torch.zeros((nb, new_page), dtype=torch.uint8, device=view.device)
    src = view.as_strided((nb, bs * rb), (page, 1), view.storage_offset())
    flat[:, : bs * rb] = src
    return flat.as_strided((nb, bs, 1, rb), (new_page, rb, rb, 1))


def slot_count(view: torch.Tensor) -> int:
    """Number of addressable slots ``num_blocks * bs`` of a ``[nb, bs, 1, 584]`` view."""
    return int(view.shape[0]) * int(view.shape[1])


def in_prefix(idx: torch.Tensor, lens: torch.Tensor | None) -> torch.Tensor:
    """bool ``[T, K]``: column ``c`` of row ``t`` lies inside the row's length prefix
    (``c < lens[t]``; every column when ``lens`` is None)."""
    if lens is None:
        return torch.ones(idx.shape, dtype=torch.bool, device=idx.device)
    cols = torch.arange(idx.shape[1], device=idx.device).unsqueeze(0)
    return cols < lens.to(idx.device).unsqueeze(1)


def out_of_contract_indices(idx: torch.Tensor, lens: torch.Tensor | None, n: int,
                            allow_minus1_only: bool) -> int:
    """How many index values inside each row's prefix (``c < lens[t]``, or all columns when
    ``lens`` is None) break a consumer's contract: with ``allow_minus1_only`` any value that is
    neither ``-1`` nor in ``[0, n)`` (FlashMLA decode uses such values as addresses, attention
    2.4 / H2); otherwise none (the consumer masks every out-of-range value)."""
    if not allow_minus1_only or idx.numel() == 0:
        return 0
    bad = ((idx < -1) | (idx >= n)) & in_prefix(idx, lens)
    return int(bad.sum())


def refuse_non_minus1(idx: torch.Tensor, lens: torch.Tensor | None, n: int, who: str, name: str) -> None:
    """``UnsupportedCase`` when a consumer that treats only ``-1`` as empty
    (``IndexRule.minus1_only``: FlashMLA decode, vLLM's CPU attention) would read an index inside
    a row's length prefix that is neither ``-1`` nor a slot in ``[0, n)`` as an address."""
    from dsv4_numerics.reference.errors import UnsupportedCase

    bad = out_of_contract_indices(idx, lens, n, allow_minus1_only=True)
    if bad:
        raise UnsupportedCase(
            f"{who} treats only -1 as an invalid index (IndexRule.minus1_only); {bad} {name} index "
            f"value(s) inside the length prefix are neither -1 nor a slot in [0, {n}) and would be used "
            "as addresses (attention 2.4, H2)")


__all__ = [
    "FLASHINFER_HEADS", "FLASHMLA_HEADS", "InputError", "PAGE_ALIGN_BYTES", "aligned_pages",
    "lengths_int32", "lse_plus_inf_to_minus_inf", "in_prefix", "out_of_contract_indices", "pad_heads", "pad_topk", "refuse_non_minus1",
    "padded_heads", "paged_cache_view", "round_up", "slot_count",
]


# --------------------------------------------------------------------------- 584-byte pages as kernels take them


def page_geometry(fn: str, cache: torch.Tensor, block_size: int) -> tuple[int, int]:
    """Validate a canonical 584-byte cache; return ``(num_blocks, page_stride)``."""
    check_dtype(fn, "cache", cache, (torch.uint8,))
    check_rank(fn, "cache", cache, (2, 3, 4))
    check_int(fn, "block_size", block_size, minimum=1)
    nb, page = cache.shape[0], cache.stride(0)
    need = block_size * RECORD_BYTES
    if cache.stride(-1) != 1:
        fail(fn, "cache", "must have a unit byte stride in the last dimension", tuple(cache.stride()))
    if cache.dim() == 2:
        if cache.shape[1] < need:
            fail(fn, "cache", f"2-D pages must hold block_size*584 = {need} bytes", tuple(cache.shape))
        page = max(page, cache.shape[1]) if nb == 1 else page
    else:
        ok = cache.shape[1] == block_size and cache.shape[-1] == RECORD_BYTES
        ok = ok and (block_size == 1 or cache.stride(1) == RECORD_BYTES)
        ok = ok and (cache.dim() == 3 or cache.shape[2] == 1)
        if not ok:
            fail(fn, "cache", f"kernel view must be [num_blocks, {block_size}, (1,) 584] with strides "
                 "(page_stride, 584, (.,) 1)", f"shape {tuple(cache.shape)} strides {cache.stride()}")
        page = max(page, need) if nb == 1 else page
    if page < need:
        fail(fn, "cache", f"page stride (stride(0)) must be >= block_size*584 = {need}", page)
    avail = cache.untyped_storage().nbytes() - cache.storage_offset()
    if avail < nb * page:
        fail(fn, "cache", f"storage must hold num_blocks*page_stride = {nb * page} bytes (vLLM "
             "allocates whole pages)", f"{avail} bytes")
    return nb, page


def paged_cache_2d(cache: torch.Tensor, block_size: int) -> torch.Tensor:
    """``[num_blocks, page_stride]`` uint8 view (no copy) of a canonical 584-byte cache: what
    ``swa_kv_cache.view(swa_kv_cache.shape[0], -1)`` hands the SWA writer (attention.py:803)."""
    nb, page = page_geometry("paged_cache_2d", cache, block_size)
    return torch.as_strided(cache, (nb, page), (page, 1), cache.storage_offset())


def paged_cache_3d(cache: torch.Tensor, block_size: int) -> torch.Tensor:
    """``[num_blocks, bs, 584]`` uint8 kernel view with strides ``(page_stride, 584, 1)`` (no copy):
    the layer's ``kv_cache`` as vLLM's Triton kernels and the KV-only op receive it."""
    nb, page = page_geometry("paged_cache_3d", cache, block_size)
    return torch.as_strided(cache, (nb, block_size, RECORD_BYTES), (page, RECORD_BYTES, 1),
                            cache.storage_offset())


# Page alignment the production kernels need (bytes). vLLM's allocator gives multiples of 576
# (datapath 1.2), so production never sees less; canonical cases may use any stride >= bs*584.
# The CUDA writer stores 16-byte vectors (uint4) at page + e*576 + 16*lane (IDX @00ce99f0
# processDeepseekV4Slot); the Triton kernels access the bf16 RoPE lanes through a bf16 pointer
# (2-byte alignment; their alignment analysis follows the actual stride).
CUDA_PAGE_ALIGN = 16
TRITON_PAGE_ALIGN = 2


def writable_pages(cache: torch.Tensor, block_size: int, align: int) -> tuple[torch.Tensor, Callable[[], torch.Tensor]]:
    """A ``[num_blocks, page_stride']`` uint8 page buffer for an in-place writer, and
    ``finish() -> cache`` that returns the written cache in the input's own form (sizes,
    strides, storage offset), never touching the caller's tensor.

    When the case's page stride (or base) is not a multiple of ``align`` -- a stride no vLLM
    allocator produces, on which the kernel would fault -- the pages are repacked to
    ``page_stride' = round_up(page_stride, align)`` for the call and the ``bs*584`` record bytes
    of every page are copied back afterwards. Writers address bytes page-relative and never touch
    ``[bs*584, page_stride)`` (datapath 1.2), so the result is the bytes the kernel writes at the
    original stride."""
    fn = "writable_pages"
    check_int(fn, "align", align, minimum=1)
    nb, page = page_geometry(fn, cache, block_size)
    out = clone_storage(cache)
    pages = paged_cache_2d(out, block_size)
    if page % align == 0 and pages.data_ptr() % align == 0:
        return pages, lambda: out
    used = block_size * RECORD_BYTES
    new_page = -(-page // align) * align
    buf = torch.zeros((nb, new_page), dtype=torch.uint8, device=cache.device)
    buf[:, :used] = pages[:, :used]

    def finish() -> torch.Tensor:
        pages[:, :used] = buf[:, :used]
        return out

    return buf, finish


def readable_pages(cache: torch.Tensor, block_size: int, align: int) -> torch.Tensor:
    """The ``[num_blocks, bs, 584]`` kernel view for a kernel that only READS the cache: the
    case's own bytes when the stride and base are multiples of ``align``, else a repacked copy
    with ``page_stride' = round_up(page_stride, align)`` holding the same record bytes."""
    fn = "readable_pages"
    check_int(fn, "align", align, minimum=1)
    nb, page = page_geometry(fn, cache, block_size)
    view = paged_cache_3d(cache, block_size)
    if page % align == 0 and view.data_ptr() % align == 0:
        return view
    used = block_size * RECORD_BYTES
    new_page = -(-page // align) * align
    buf = torch.zeros((nb, new_page), dtype=torch.uint8, device=cache.device)
    buf[:, :used] = paged_cache_2d(cache, block_size)[:, :used]
    return torch.as_strided(buf, (nb, block_size, RECORD_BYTES), (new_page, RECORD_BYTES, 1))


# --------------------------------------------------------------------------- dense MLA decode

LN2 = math.log(2.0)


def base2_lse_to_natural(lse2: torch.Tensor) -> torch.Tensor:
    """A base-2 LSE (``log2 sum 2**(s * log2 e)``, TokenSpeed / trtllm-gen default) -> natural log
    (multiply by ``ln 2``); ``+-inf`` unchanged."""
    check_tensor("base2_lse_to_natural", "lse2", lse2)
    return lse2.to(torch.float32) * LN2


def pad_block_table(bt: torch.Tensor, multiple: int, fill: torch.Tensor | int = 0) -> torch.Tensor:
    """``bt [B, M]`` int -> int32 ``[B, round_up(M, multiple)]``; new column ``j`` of row ``r``
    holds ``fill`` (an int, or a ``[B]`` tensor of per-row page ids). Columns a request never
    reads (``>= ceil(seq_len / bs)``) are never dereferenced by a correct kernel."""
    fn = "pad_block_table"
    check_rank(fn, "bt", bt, 2)
    b, m = bt.shape
    mp = round_up(max(m, 1), multiple)
    out = torch.empty((b, mp), dtype=torch.int32, device=bt.device)
    out[:, :m] = bt.to(torch.int32)
    if mp > m:
        if isinstance(fill, torch.Tensor):
            out[:, m:] = fill.to(torch.int32).view(b, 1).to(bt.device)
        else:
            out[:, m:] = int(fill)
    return out.contiguous()


def dense_mla_inputs(case) -> tuple:
    """``(inputs, q, kv_cache, block_size, block_table int32, seq_lens int32)`` of a canonical dense
    MLA decode case (``reference.cases.mla``); ``UnsupportedCase`` unless ``q`` is
    ``[b, s_q, h, 576]`` and the cache shares its dtype."""
    inp = case.inputs
    q, kv = inp["q"], inp["kv_cache"]
    if q.dim() != 4 or q.shape[-1] != MLA_D_QK:
        raise UnsupportedCase(f"MLA decode kernels take q [b, s_q, h, {MLA_D_QK}] (got {tuple(q.shape)})")
    if kv.dtype != q.dtype:
        raise UnsupportedCase(f"q and kv_cache must share a dtype (got {q.dtype}, {kv.dtype})")
    bs = int(inp["block_size"])
    bt = inp["block_table"].to(torch.int32).contiguous()
    seq = inp["seq_lens"].to(torch.int32).contiguous()
    return inp, q, kv, bs, bt, seq
