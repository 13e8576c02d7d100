"""FlashMLA sparse attention (MODEL1 = DSv4) as vLLM 0.33.0 ships and calls it.

Source: ``vllm.third_party.flashmla.flash_mla_interface`` (vendored FlashMLA, "vFMLA"; the
compiled ops live in ``vllm/_flashmla_C.abi3.so``), reachable on a GPU machine without vLLM via
``dsv4-numerics stage-vllm --wheel vllm-0.33.0-*.whl DEST --parts flashmla`` and ``DSV4_STAGED=DEST``.

Entries (one canonical call per stage; attention.md 5 gives the argument mapping):

``flashmla.sparse_decode.sm90`` / ``.sm100`` -- ``flash_mla_with_kvcache`` (stage ``decode``).
    Called as vLLM's ``DeepseekV4FlashMLAAttention._forward_decode`` does
    (``V:models/deepseek_v4/nvidia/flashmla.py:174-264``): every query token is its own batch row
    (``q.unsqueeze(1)``: ``b = T``, ``s_q = 1``), so ``topk_length [b]`` and
    ``extra_topk_length [b]`` are per token (FlashMLA decode lengths are per batch row,
    ``sparse_decode.h:307,310``); main cache = SWA cache ``[nb, bs, 1, 584]`` (stride(1) must be
    584, ``sparse_decode.h:296-303``), extra cache = compressed cache; ``head_dim_v = 512``,
    ``is_fp8_kvcache = True``, ``block_table = cache_seqlens = None``, a fresh
    ``get_mla_metadata()`` schedule per call (a schedule may only be reused for identical shapes
    *and* lengths, ``flash_mla_interface.py:89``, H17).
``flashmla.sparse_decode_sq3.sm90`` -- the same kernel with ``s_q = 3`` query tokens per batch row
    (FlashMLA's own test varies s_q in {1, 3}; vLLM flattens its tokens to ``s_q = 1``, other
    callers do not). ``T`` canonical tokens become ``b = ceil(T / 3)`` rows of 3 (the last row
    padded with lonely tokens: zero q, every index ``-1``, outputs dropped). FlashMLA's lengths
    are per batch row (``topk_length [b]``, ``flash_mla_interface.py:99``) while canonical lengths
    are per token, so each token's columns past its own length become ``-1`` and the row's length
    is the largest of its tokens' (the same attended set under ``-1``-only indices).
``flashmla.sparse_prefill.sm90`` / ``.sm100`` -- ``flash_mla_sparse_fwd`` (stage ``prefill``).
    On the gathered bf16 rows ``kv [S, 1, 512]`` with ``indices [T, 1, K]`` and
    ``topk_length [T]`` (``V:.../nvidia/flashmla.py:390-398``).

Conversions both ways (done here, so the judge sees the oracle's conventions):
    * heads padded to 64 or 128 (vLLM ``get_padded_num_q_heads``, ``flashmla.py:77-85``) with
      zero q and ``-inf`` sink, padded heads sliced off the outputs;
    * index tables padded with ``-1`` to a multiple of 64 (decode main and extra,
      ``splitkv_mla.cuh:689`` ``topk % TOPK_BLOCK_SIZE``) or 128 (prefill; vLLM pads the
      combined width to 128, ``flashmla.py:316``), indices cast to int32;
    * LSE: decode returns a ``[b, h_q, s_q]`` transposed view, prefill ``[s_q, h_q]``; both
      natural log, sink-free, ``+inf`` for a query without any valid key (attention 2.2).
      Returned as ``lse [T, H]`` float32 with ``-inf`` for lonely queries (the oracle's
      convention); prefill also returns ``max_logits [T, H]`` (already ``-inf`` when lonely);
    * ``out`` is the kernel's bf16 ``[T, H, 512]``.

Cases outside the kernels' contract raise ``UnsupportedCase`` (a skip, never a pass):
    * decode: an index inside a row's length prefix that is neither ``-1`` nor a slot of the
      cache -- FlashMLA decode uses it as an address (``splitkv_mla.cuh:531-540``, H2);
    * prefill: a *valid* index after ``topk_length`` pointing at a row with NaN -- the documented
      "extremely rare" NaN leak (``flash_mla_interface.py:239-240``);
    * more than 128 query heads.
Page starts must be 16-byte aligned for the kernel's 128-bit loads; a case whose page stride is
not a multiple of 16 is repacked (same record bytes, different inter-page padding).
"""

from __future__ import annotations

import functools

import torch

from dsv4_numerics.reference.caches.model1 import kernel_view
from dsv4_numerics.reference.errors import UnsupportedCase
from dsv4_numerics.reference.policies import IndexRule, LseConvention, NanPolicy, Ue8m0Consumer

from dsv4_numerics.kernels import probe as P
from dsv4_numerics.kernels.canonical import PagedSegment, decode_inputs, prefill_inputs
from dsv4_numerics.kernels.convert import (
    FLASHMLA_HEADS,
    aligned_pages,
    in_prefix,
    lengths_int32,
    lse_plus_inf_to_minus_inf,
    pad_heads,
    pad_topk,
    padded_heads,
    refuse_non_minus1,
)
from dsv4_numerics.kernels.registry import KernelEntry

INTERFACE = "vllm.third_party.flashmla.flash_mla_interface"
SO_MODULE = "vllm._flashmla_C"
DECODE_TOPK_BLOCK = 64  # SM90 decode TOPK_BLOCK_SIZE; SM100 head64 B_TOPK (kernel.cuh:859-860)
PREFILL_TOPK_BLOCK = 128  # SM90 prefill phase1.cuh:577; vLLM rounds the combined width to 128


def flashmla_probe(*archs: str) -> P.Probe:
    return P.chain(
        P.needs_arch(*archs),
        P.needs_staged_vllm(INTERFACE),
        P.needs_import(SO_MODULE),  # the .so loads into this torch (OSError reported verbatim)
        P.needs_import(INTERFACE),
    )


def flashmla_interface():
    from importlib import import_module

    return import_module(INTERFACE)


def _cache_for_kernel(seg: PagedSegment) -> torch.Tensor:
    """``[nb, bs, 1, 584]`` view (stride(1) == 584), 16-byte aligned pages."""
    view = kernel_view(seg.cache, seg.block_size).unsqueeze(2)
    return aligned_pages(view)


def _check_minus1_only(seg: PagedSegment, name: str, who: str = "FlashMLA decode") -> None:
    refuse_non_minus1(seg.idx, seg.length, seg.num_slots, who, name)


DECODE_SQ = 3  # the s_q > 1 value of FlashMLA's sparse decode test


def _rows_of(x: torch.Tensor, b: int, s_q: int, fill: float | int) -> torch.Tensor:
    """``x [T, ...]`` padded with ``fill`` to ``b * s_q`` rows and viewed ``[b, s_q, ...]``."""
    t = x.shape[0]
    if b * s_q > t:
        x = torch.cat([x, x.new_full((b * s_q - t, *x.shape[1:]), fill)])
    return x.reshape(b, s_q, *x.shape[1:]).contiguous()


def _grouped(seg: PagedSegment, b: int, s_q: int, fn: str, arg: str):
    """A segment's ``[b, s_q, K']`` indices and ``[b]`` lengths for ``s_q`` tokens per batch row
    (module docstring): columns past a token's own length are ``-1``, the row's length is the
    largest of its tokens'; s_q = 1 passes the tokens' lengths and indices through unchanged."""
    t = seg.idx.shape[0]
    idx = pad_topk(seg.idx, DECODE_TOPK_BLOCK)
    if s_q == 1:
        return idx.unsqueeze(1), lengths_int32(seg.length, t, fn, arg)
    ln = None
    if seg.length is not None:
        cols = torch.arange(idx.shape[1], device=idx.device)
        idx = torch.where(cols[None, :] < seg.length.to(idx.device)[:, None], idx, torch.full_like(idx, -1))
        ln = _rows_of(seg.length.to(torch.int32), b, s_q, 0).amax(dim=1).contiguous()
    return _rows_of(idx, b, s_q, -1), ln


def sparse_decode_call(case, s_q: int = 1, attend=None, who: str | None = None, check=None,
                       lse_heads_last: bool = False, fn: str = "flashmla.sparse_decode") -> dict[str, torch.Tensor]:
    """Canonical ``decode`` case -> ``{"out": bf16 [T,H,512], "lse": f32 [T,H]}`` via
    ``flash_mla_with_kvcache`` with ``s_q`` query tokens per batch row (module docstring).

    ``attend``: another function taking ``flash_mla_with_kvcache``'s keyword arguments (SGLang's
    Triton ``triton_fp8_attention_fwd``, ``kernels.sglang``; its TileLang
    ``dpsk_v4_fp8_attention_fwd``, ``kernels.sglang_jit``); it gets ``tile_scheduler_metadata=None``
    and is named ``who`` (default ``fn``) in refusals. ``check(decode_inputs)`` may refuse further
    cases (``UnsupportedCase``). ``lse_heads_last``: its LSE is ``[b, s_q, h]`` (FlashMLA's is a
    ``[b, h, s_q]`` view). None: FlashMLA itself, a fresh schedule per call."""
    d = decode_inputs(case, fn)
    t, h = d.q.shape[0], d.q.shape[1]
    who = who or ("FlashMLA decode" if attend is None else fn)
    _check_minus1_only(d.main, "SWA", who)
    if d.extra is not None:
        _check_minus1_only(d.extra, "compressed", who)
    if check is not None:
        check(d)
    hp = padded_heads(h, FLASHMLA_HEADS, "FlashMLA sparse decode" if attend is None else who)
    if d.main.idx.shape[1] == 0 and attend is None:
        raise UnsupportedCase("FlashMLA sparse decode needs a main segment with topk > 0 "
                              "(sparse_decode.h TORCH_CHECK(topk > 0))")
    q, sink = pad_heads(d.q, d.sink, hp)
    b = -(-t // s_q)
    q = _rows_of(q, b, s_q, 0.0)  # [b, s_q, hp, 512], contiguous (s_q = 1: b = T, vLLM's call)
    indices, topk_length = _grouped(d.main, b, s_q, fn, "swa_lens")  # [b, s_q, K'], [b]
    kw = {}
    if d.extra is not None and d.extra.idx.shape[1] > 0:
        e_idx, e_len = _grouped(d.extra, b, s_q, fn, "extra_lens")
        kw = dict(extra_k_cache=_cache_for_kernel(d.extra), extra_indices_in_kvcache=e_idx, extra_topk_length=e_len)
    sched = None
    if attend is None:
        fm = flashmla_interface()
        sched, _ = fm.get_mla_metadata()
        attend = fm.flash_mla_with_kvcache
    out, lse = attend(
        q=q,
        k_cache=_cache_for_kernel(d.main),
        block_table=None,
        cache_seqlens=None,
        head_dim_v=q.shape[-1],
        tile_scheduler_metadata=sched,
        softmax_scale=d.scale,
        is_fp8_kvcache=True,
        indices=indices,
        attn_sink=sink,
        topk_length=topk_length,
        **kw,
    )
    # out [b, s_q, hp, 512]; lse is a [b, hp, s_q] view of a [b, s_q, hp] buffer
    lse = lse if lse_heads_last else lse.transpose(1, 2)
    return {
        "out": out.reshape(b * s_q, hp, -1)[:t, :h],
        "lse": lse_plus_inf_to_minus_inf(lse.reshape(b * s_q, hp)[:t, :h].float()),
    }


def sparse_decode_sq_call(case) -> dict[str, torch.Tensor]:
    """``sparse_decode_call`` with ``s_q = DECODE_SQ`` tokens per batch row."""
    return sparse_decode_call(case, DECODE_SQ)


def _check_prefill_nan_leak(kv: torch.Tensor, idx: torch.Tensor, length: torch.Tensor | None) -> None:
    if length is None or idx.numel() == 0:
        return
    s = kv.shape[0]
    beyond = ~in_prefix(idx, length)
    i64 = idx.to(torch.int64)
    valid = (i64 >= 0) & (i64 < s) & beyond
    if not bool(valid.any()):
        return
    nan_rows = torch.isnan(kv.float()).any(dim=1)
    hits = nan_rows[i64.clamp(0, max(s - 1, 0))] & valid
    if bool(hits.any()):
        raise UnsupportedCase(
            f"{int(hits.sum())} valid index(es) after topk_length point at rows containing NaN: "
            "FlashMLA prefill documents that its output may then contain NaN "
            "(flash_mla_interface.py:239-240, attention 2.5) -- outside the kernel's contract")


def sparse_prefill_call(case) -> dict[str, torch.Tensor]:
    """Canonical ``prefill`` case -> ``{"out": bf16 [T,H,512], "lse": f32 [T,H],
    "max_logits": f32 [T,H]}`` via ``flash_mla_sparse_fwd`` (module docstring)."""
    fn = "flashmla.sparse_prefill"
    p = prefill_inputs(case, fn)
    t, h = p.q.shape[0], p.q.shape[1]
    _check_prefill_nan_leak(p.kv, p.idx, p.length)
    hp = padded_heads(h, FLASHMLA_HEADS, "FlashMLA sparse prefill")
    q, sink = pad_heads(p.q, p.sink, hp)
    if p.kv.shape[0] == 0:
        raise UnsupportedCase("FlashMLA sparse prefill needs at least one kv row (s_kv > 0)")
    lo, hi = int(torch.iinfo(torch.int32).min), int(torch.iinfo(torch.int32).max)
    if p.idx.numel() and (int(p.idx.min()) < lo or int(p.idx.max()) > hi):
        raise UnsupportedCase("FlashMLA sparse prefill takes int32 indices; the case has values "
                              "outside int32")
    idx = pad_topk(p.idx, PREFILL_TOPK_BLOCK, minimum=PREFILL_TOPK_BLOCK).unsqueeze(1)  # [T, 1, K']
    kv = p.kv
    if kv.stride(-1) != 1:
        kv = kv.contiguous()
    fm = flashmla_interface()
    out, max_logits, lse = fm.flash_mla_sparse_fwd(
        q=q,
        kv=kv.unsqueeze(1),
        indices=idx,
        sm_scale=p.scale,
        d_v=q.shape[-1],
        attn_sink=sink,
        topk_length=lengths_int32(p.length, t, fn, "topk_length"),
    )
    return {
        "out": out[:, :h],
        "lse": lse_plus_inf_to_minus_inf(lse[:, :h].float()),
        "max_logits": max_logits[:, :h].float(),
    }


_COMMON = {
    "lse": LseConvention.NATURAL_SINKFREE.value,
    "nan": NanPolicy.PROPAGATE.value,
    "output_inv_roped": "false",
}
_DECODE_POLICIES = {**_COMMON, "index_rule": IndexRule.MINUS1_ONLY.value,
                    "ue8m0": Ue8m0Consumer.FLASHMLA.value}
_PREFILL_POLICIES = {**_COMMON, "index_rule": IndexRule.ANY_OUT_OF_RANGE_INVALID.value}

_SM100 = ("sm100", "sm103")

ENTRIES: list[KernelEntry] = [
    KernelEntry(
        name="flashmla.sparse_decode.sm90",
        stage="decode",
        family="CUDA",
        source=f"{INTERFACE}.flash_mla_with_kvcache (sm90/decode/sparse_fp8, MODEL1)",
        archs=("sm90",),
        dtypes=("bfloat16", "uint8"),
        policies=dict(_DECODE_POLICIES),
        tolerance_scope="flashmla.sparse_decode",
        probe=flashmla_probe("sm90"),
        call=sparse_decode_call,
        notes="h_q padded to 64/128; b = T tokens with s_q = 1 (vLLM's call); lengths per batch row",
    ),
    KernelEntry(
        name="flashmla.sparse_decode.sm100",
        stage="decode",
        family="CUDA",
        source=f"{INTERFACE}.flash_mla_with_kvcache (sm100/decode/head64, head128 small-topk)",
        archs=_SM100,
        dtypes=("bfloat16", "uint8"),
        policies=dict(_DECODE_POLICIES),
        tolerance_scope="flashmla.sparse_decode",
        probe=flashmla_probe(*_SM100),
        call=sparse_decode_call,
        notes="SM100 uses lazy rescaling (attention 4.1); same call as sm90",
    ),
    KernelEntry(
        name="flashmla.sparse_decode_sq3.sm90",
        stage="decode",
        family="CUDA",
        source=f"{INTERFACE}.flash_mla_with_kvcache (sm90/decode/sparse_fp8, MODEL1, s_q = 3)",
        archs=("sm90",),
        dtypes=("bfloat16", "uint8"),
        policies=dict(_DECODE_POLICIES),
        tolerance_scope="flashmla.sparse_decode",
        probe=flashmla_probe("sm90"),
        call=sparse_decode_sq_call,
        notes="b = ceil(T/3) rows of s_q = 3 tokens (FlashMLA's own s_q > 1 path; not vLLM's call); "
              "per-token lengths as -1 past each token's length, the row's largest as its length",
    ),
    KernelEntry(
        name="flashmla.sparse_prefill.sm90",
        stage="prefill",
        family="CUDA",
        source=f"{INTERFACE}.flash_mla_sparse_fwd (sm90/prefill/sparse)",
        archs=("sm90",),
        dtypes=("bfloat16",),
        policies=dict(_PREFILL_POLICIES),
        tolerance_scope="flashmla.sparse_prefill",
        probe=flashmla_probe("sm90"),
        call=sparse_prefill_call,
        notes="top-k padded to a multiple of 128 with -1",
    ),
    KernelEntry(
        name="flashmla.sparse_prefill.sm100",
        stage="prefill",
        family="CUDA",
        source=f"{INTERFACE}.flash_mla_sparse_fwd (sm100/prefill/sparse head64/head128)",
        archs=_SM100,
        dtypes=("bfloat16",),
        policies=dict(_PREFILL_POLICIES),
        tolerance_scope="flashmla.sparse_prefill",
        probe=flashmla_probe(*_SM100),
        call=sparse_prefill_call,
        notes="top-k padded to a multiple of 128 with -1",
    ),
]


# The releases each entry is written for (``KernelEntry.releases``, set by ``registry.assemble``), from the survey (``python -m
# dsv4_numerics.staging.survey``): ``flash_mla_sparse_fwd`` unchanged from 0.22.0; ``flash_mla_with_kvcache``
# gains ``enable_batch_invariant`` in 0.33.0, which the adapter never passes. Whether an older ``_flashmla_C``
# library runs the MODEL1 path only the GPU tells.
RELEASE_RANGES = {
    "flashmla.sparse_decode.sm90": "vllm>=0.22.0",
    "flashmla.sparse_decode.sm100": "vllm>=0.22.0",
    "flashmla.sparse_decode_sq3.sm90": "vllm>=0.22.0",
    "flashmla.sparse_prefill.sm90": "vllm>=0.22.0",
    "flashmla.sparse_prefill.sm100": "vllm>=0.22.0",
}
