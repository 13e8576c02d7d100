"""Adapters for SGLang 0.5.23's DeepSeek-V4 Triton kernels (``S:`` = the SGLang wheel,
``sglang/``; ``sglang/kernels/ops/attention/dsv4/``).

The sources reach a GPU machine without an SGLang install through
``dsv4-numerics stage-sglang --wheel sglang-0.5.23-*.whl DIR`` and ``DSV4_STAGED=DIR`` (the same
folder may hold the vLLM parts). Its stand-ins describe NVIDIA CUDA with OCP FP8
(``is_fp8_fnuz() = False``, every ``is_gfx*`` False). Each adapter converts the canonical
``Case`` inputs as SGLang's call sites do (int32 index buffers, contiguous page buffers,
caller-allocated outputs) and returns canonical outputs.

Entries:

==============================================  ================  ==========================================
entry                                           stage             production function
==============================================  ================  ==========================================
sglang.dequantize_k_cache_paged_dsv4            gather            ``dequant_k_cache.dequantize_k_cache_paged_dsv4`` (``KVLayout.V4``)
sglang.gather_dequant_requant_fp8               gather            ``dequant_k_cache.gather_dequant_requant_fp8_paged_dsv4``
sglang.combine_topk_swa_indices                 combine_prefill   ``sparse_prefill_kernels.combine_topk_swa_indices``
sglang.build_swa_token_ids                      swa_indices       ``sparse_prefill_kernels.build_swa_token_ids``
sglang.write_v4_paged_decode_indices            swa_indices       ``unified_kv_kernels.paged_decode_indices.write_v4_paged_decode_indices``
sglang.triton_sparse_decode                     decode            ``triton_sparse_decode.triton_fp8_attention_fwd``
sglang.kv_norm_rope_store                       kv_norm_rope_store ``kv_norm_rope_store.fused_k_norm_rope_uniform_fp8``
sglang.paged_prefill                            prefill           ``unified_kv_kernels.paged_prefill.sparse_attn_v4_paged_prefill``
sglang.paged_decode                             decode            ``unified_kv_kernels.paged_decode.sparse_attn_v4_paged_decode``
==============================================  ================  ==========================================

What SGLang does differently from vLLM / FlashMLA (read from the sources; each difference that a
stage can see is a declared policy or an ``UnsupportedCase``):

* ``KVLayout.V4`` is byte-for-byte the 584-byte MODEL1 page (``[bs x 576 data][bs x 8 scales]``,
  page padded to a multiple of 576: ``kv_layout.py:101-104``, ``dequant_k_cache.py:12-16``); its
  Triton readers decode a scale byte as ``exp2(s - 127)`` (0 -> 0.0, 255 -> +Inf: ``ue8m0 =
  triton``) and take ``page_table_1_flattened`` = SLOTS (token ids), not a block table: the
  adapter computes the gathered slots as ``build_swa_token_ids`` does (positions ``L - g + i``).
  A slot ``-1`` is not skipped (it would be read at page 0, entry ``-1``): out of contract.
* The V4.1 layouts of ``kv_layout.py`` exist in two byte orders: ``V41`` / ``V41_FP4`` are
  BLOCK-SPLIT (all data rows, then all scale rows: ``V41Layout.page_footer``) with pages padded to
  512 / 256 bytes, ``V41_NEW`` / ``V41_FP4_NEW`` INTERLEAVED (``V41Layout.interleaved``, vLLM's
  order) unpadded. Their dequantiser refuses anything below SM100 (``dequant_k_cache.py:118-126``)
  and no ``v41`` gather stage exists yet: no entry here.
* ``combine_topk_swa_indices``: a negative top-k entry becomes ``-1`` (``invalid_topk =
  kept_minus1``) where vLLM's common form shifts it to ``M*r - 1``; workspace bases per request and
  absolute positions are arguments; no image visibility (cases with it are skipped).
* ``triton_fp8_attention_fwd`` treats only ``-1`` as empty (``index_rule = minus1_only``; any other
  negative index is clamped to slot 0 and read), dequantises ``fp8.to(bf16) * exp2(s - 127).to(bf16)``
  and runs P@V with bf16 P (``attention_mode = bf16_p``), returns the natural, sink-free LSE with
  ``+inf`` for lonely rows, ``[b, s_q, h]`` (FlashMLA's is ``[b, h, s_q]``).
* ``fused_k_norm_rope_uniform_fp8``: RMSNorm (``tl.sum`` tree + ``tl.rsqrt``: exact on the stage's
  exact-norm rows with ``eps = 0``), RoPE of the fp32 normed row with the left product fused
  (``rope_arith = fma``), rounding to kv's dtype, a saturating unit-scale E4M3 store; a negative
  slot is NOT skipped: ``slot < 0`` writes row ``CACHE_ROWS + slot``, PyTorch's negative-index rule
  (``slot_skip = negative_wraps``).
* ``sparse_attn_v4_paged_prefill`` / ``sparse_attn_v4_paged_decode`` (AMD ATOM kernels; the Triton
  paths run on NVIDIA): a flat bf16 ``unified_kv`` pool with per-token ragged index lists. Prefill:
  the workspace is the pool, the extend region empty, negative indices skipped and any other index
  read (a case with one ``>= S`` is an ``UnsupportedCase``). Decode: no sentinel at all, so the
  adapter builds the pool from both exactly dequantised caches and keeps only the valid entries
  (``index_rule = any_out_of_range_invalid``). Both round P to bf16 (``bf16_p``) and return no LSE.

* ``gather_dequant_requant_fp8_paged_dsv4``: the same gather re-encoded as unit-scale E4M3 codes (the
  Q8KV8 prefill's FP8 workspace): ``gather_out = e4m3_requant`` on the ``gather`` stage, the codes
  read back as bf16 values.

Not mapped (no stage models them): the compressor
(``compress.py``: its C4/C128 state ``kv_buffer [num_indices, 8, head_dim*4]`` is SGLang's own ring
addressed by ``c_plan.cuh`` plans, ``ape`` is added in-kernel in the input dtype, and
``compress_forward`` returns the un-normalised compressed row; README "SGLang's compressor"); the
V4.1 gathers (SM100 only).

Triton is not importable on the CPU machine that wrote these adapters, so the kernels cannot run
through ``TRITON_INTERPRET=1`` here; every entry needs a GPU.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from pathlib import Path

import torch

from dsv4_numerics.reference.caches import model1 as cache_model1
from dsv4_numerics.reference.cases import Case
from dsv4_numerics.reference.constants import HEAD_DIM
from dsv4_numerics.reference.errors import INDEX_DTYPES, UnsupportedCase, check_dtype, check_int, check_rank, fail
from dsv4_numerics.reference.policies import (
    AttentionMode,
    CombineInvalidTopk,
    Fp8Flavour,
    GatherOutput,
    IndexRule,
    LseConvention,
    MissingLengths,
    NanPolicy,
    NonFinite,
    RopeArithmetic,
    SlotSkip,
    Ue8m0Consumer,
)

from dsv4_numerics.kernels import probe as P
from dsv4_numerics.kernels import staged
from dsv4_numerics.kernels.canonical import decode_inputs, prefill_inputs
from dsv4_numerics.kernels.flashmla.sparse import sparse_decode_call
from dsv4_numerics.kernels.registry import KernelEntry
from dsv4_numerics.kernels.convert import TRITON_PAGE_ALIGN, page_geometry, readable_pages
from dsv4_numerics.kernels.vllm.triton import index_case_builder, int32

__all__ = ["ENTRIES", "MODULES", "DEQUANT", "SPARSE_PREFILL", "PAGED_DECODE_INDICES", "SPARSE_DECODE", "NORM_ROPE_STORE", "PAGED_PREFILL", "PAGED_DECODE",
           "sglang_probe", "staged_sglang_reason", "gather_slots", "gather_args", "combine_args", "swa_token_ids_args",
           "paged_decode_indices_args", "norm_rope_store_args", "paged_prefill_args",
           "paged_decode_args"]

_DSV4 = "sglang.kernels.ops.attention.dsv4"
DEQUANT = f"{_DSV4}.dequant_k_cache"
SPARSE_PREFILL = f"{_DSV4}.sparse_prefill_kernels"
PAGED_DECODE_INDICES = f"{_DSV4}.unified_kv_kernels.paged_decode_indices"
SPARSE_DECODE = f"{_DSV4}.triton_sparse_decode"
NORM_ROPE_STORE = f"{_DSV4}.kv_norm_rope_store"
PAGED_PREFILL = f"{_DSV4}.unified_kv_kernels.paged_prefill"
PAGED_DECODE = f"{_DSV4}.unified_kv_kernels.paged_decode"
MODULES = (DEQUANT, SPARSE_PREFILL, PAGED_DECODE_INDICES, SPARSE_DECODE, NORM_ROPE_STORE, PAGED_PREFILL, PAGED_DECODE)


@functools.lru_cache(maxsize=None)
def staged_sglang_reason(module: str) -> str | None:
    """``None`` if the SGLang file of ``module`` is in a ``DSV4_STAGED`` folder or in an installed
    ``sglang`` package; else the command that stages it. Looked up as a FILE: finding the module
    spec would import its parent packages (``dsv4/__init__.py`` imports Triton and the JIT
    loaders), which is the import step's job."""
    problems = staged.activate()
    rel = module.replace(".", "/")
    for cand in (rel + ".py", rel + "/__init__.py"):
        if staged.staged_file(cand) is not None:
            return None
    try:
        spec = importlib.util.find_spec("sglang")
    except (ImportError, ValueError):
        spec = None
    for root in (spec.submodule_search_locations or []) if spec else []:
        base = Path(root).parent
        if (base / (rel + ".py")).is_file() or (base / rel / "__init__.py").is_file():
            return None
    return "; ".join(problems) if problems else staged.missing_hint(module, "sglang")


def sglang_probe(module: str, archs: tuple[str, ...] = ("any-gpu",)) -> P.Probe:
    """Probe, in the order a user fixes them: the SGLang file ``module`` staged (``stage-sglang``,
    ``DSV4_STAGED``; found without importing), a GPU of ``archs``, Triton importable, then the
    import itself (with the staged stand-ins; the loader's message verbatim)."""
    return P.chain(lambda: staged_sglang_reason(module), P.needs_arch(*archs), P.needs_module("triton"),
                   P.needs_import(module))


def triton_fn(module: str, name: str):
    return getattr(importlib.import_module(module), name)


# --------------------------------------------------------------------------- gather


def gather_slots(inputs: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The canonical gather's rows as SGLang's flat slot list: for request ``b`` (``L =
    seq_lens[b]``, ``g = gather_lens[b]`` or ``L``) and ``i < g``, slot ``block_table[b, p // bs] *
    bs + p % bs`` at ``p = L - g + i`` (what ``build_swa_token_ids`` + ``req_to_token`` produce).
    Returns ``(slots int32 [sum g], request [sum g], row [sum g])`` with ``row = offset + i``, the
    output row of the canonical ``[R, offset + max g, 512]``. A table too short or holding a page
    outside the cache for a gathered position raises InputError (the kernel would read out of
    bounds: it has no ``-1`` handling)."""
    fn = "sglang.gather_slots"
    bs = check_int(fn, "block_size", inputs["block_size"], minimum=1)
    nb, _ = page_geometry(fn, inputs["cache"], bs)
    bt = inputs["block_table"]
    check_dtype(fn, "block_table", bt, INDEX_DTYPES)
    check_rank(fn, "block_table", bt, 2)
    seq = inputs["seq_lens"].to(torch.int64).cpu()
    gl = inputs.get("gather_lens")
    g = seq.clone() if gl is None else gl.to(torch.int64).cpu()
    r = bt.shape[0]
    if seq.shape != (r,) or g.shape != (r,) or bool(((g < 0) | (g > seq)).any()):
        fail(fn, "gather_lens", f"seq_lens and gather_lens must be [{r}] with 0 <= gather_lens <= seq_lens")
    offset = check_int(fn, "offset", inputs.get("offset", 0), minimum=0)
    req = torch.repeat_interleave(torch.arange(r), g)
    i = torch.arange(int(g.sum())) - (torch.cumsum(g, 0) - g)[req]
    pos = (seq - g)[req] + i
    blk = pos // bs
    if blk.numel() and int(blk.max()) >= bt.shape[1]:
        fail(fn, "block_table", f"has {bt.shape[1]} columns; a gathered position needs block {int(blk.max())}")
    pages = bt.to(torch.int64).cpu()[req, blk]
    if bool(((pages < 0) | (pages >= nb)).any()):
        fail(fn, "block_table", f"gathered positions must map to pages in [0, {nb})")
    return (pages * bs + pos % bs).to(torch.int32), req, offset + i


def gather_args(inputs: dict) -> dict:
    """Canonical ``gather`` inputs -> ``dequantize_k_cache_paged_dsv4`` arguments: the contiguous
    2-D page buffer ``[num_blocks, page_stride]`` (SGLang asserts ``is_contiguous()`` and reads
    the page stride as ``shape[-1]``; an odd stride is repacked to an even one, which its bf16
    view needs), int32 slots, ``page_size``, ``layout="v4"``; plus ``_req`` / ``_row`` to scatter
    the ``[N, 1, 512]`` result into the canonical ``[R, offset + max g, 512]`` (zeros elsewhere)."""
    bs = inputs["block_size"]
    slots, req, row = gather_slots(inputs)
    view = readable_pages(inputs["cache"], bs, TRITON_PAGE_ALIGN)  # [nb, bs, 584], strides (P', 584, 1)
    nb, p = view.shape[0], view.stride(0)
    pages = torch.as_strided(view, (nb, p), (p, 1))  # the allocation holds nb * P' bytes (docs/architecture.md)
    r = inputs["block_table"].shape[0]
    g = inputs.get("gather_lens")
    g = inputs["seq_lens"] if g is None else g
    width = inputs.get("offset", 0) + (int(g.max()) if r else 0)
    return dict(quant_k_cache=pages, page_table_1_flattened=slots.to(view.device), page_size=bs, layout="v4",
                _req=req, _row=row, _shape=(r, width, HEAD_DIM))


def _call_requant_gather(case: Case) -> dict:
    """``gather_dequant_requant_fp8_paged_dsv4`` on the gather's slot list: its E4M3 ``[N, 1, 512]``
    workspace read as values (bf16, exact) and scattered into the canonical ``[R, offset + max g, 512]``."""
    a = gather_args(case.inputs)
    req, row, shape = a.pop("_req"), a.pop("_row"), a.pop("_shape")
    a.pop("layout")
    got = triton_fn(DEQUANT, "gather_dequant_requant_fp8_paged_dsv4")(**a)  # [N, 1, 512] float8_e4m3fn
    out = torch.zeros(shape, dtype=torch.bfloat16, device=got.device)
    out[req.to(got.device), row.to(got.device)] = got[:, 0].to(torch.bfloat16)
    return {"out": out}


def _call_gather(case: Case) -> dict:
    a = gather_args(case.inputs)
    req, row, shape = a.pop("_req"), a.pop("_row"), a.pop("_shape")
    got = triton_fn(DEQUANT, "dequantize_k_cache_paged_dsv4")(**a)  # [N, 1, 512] bf16
    out = torch.zeros(shape, dtype=torch.bfloat16, device=got.device)
    out[req.to(got.device), row.to(got.device)] = got[:, 0]
    return {"out": out}


# --------------------------------------------------------------------------- index builders


def combine_args(inputs: dict) -> dict:
    """``combine_topk_swa_indices`` inputs with SGLang's dtypes: every index tensor int32 (the
    wrapper asserts it), ints as given."""
    fn = "sglang.combine_args"
    out = {k: int32(fn, k, inputs[k]) for k in ("topk_indices", "query_start_loc", "query_pos", "seq_lens",
                                                 "gather_lens", "compressed_base", "swa_base")}
    for k in ("window_size", "compress_ratio", "topk"):
        out[k] = check_int(fn, k, inputs[k], minimum=0)
    return out


def swa_token_ids_args(inputs: dict) -> dict:
    """``build_swa_token_ids`` inputs: int32 lengths, pool rows and ``req_to_token``, int64
    ``full_to_swa`` (asserted by the wrapper), and ``total_swa`` = the sum of the gather lengths
    (the caller's CPU count)."""
    fn = "sglang.swa_token_ids_args"
    seq, ext = int32(fn, "seq_lens", inputs["seq_lens"]), int32(fn, "extend_seq_lens", inputs["extend_seq_lens"])
    w = check_int(fn, "swa_window", inputs["swa_window"], minimum=1)
    total = int(torch.minimum(seq.to(torch.int64), ext.to(torch.int64) + (w - 1)).sum())
    f2s = inputs["full_to_swa"]
    check_dtype(fn, "full_to_swa", f2s, INDEX_DTYPES)
    return dict(seq_lens=seq, extend_seq_lens=ext, req_pool_indices=int32(fn, "req_pool_indices", inputs["req_pool_indices"]),
                req_to_token=int32(fn, "req_to_token", inputs["req_to_token"]).contiguous(),
                full_to_swa=f2s.to(torch.int64).contiguous(), swa_window=w, total_swa=total)


def paged_decode_indices_args(inputs: dict) -> dict:
    """``write_v4_paged_decode_indices`` keyword arguments: int32 buffers, COPIES of the three
    output buffers (written in place; their fill shows what the kernel left alone)."""
    fn = "sglang.paged_decode_indices_args"
    out = {k: int32(fn, k, inputs[k]) for k in ("state_slot_per_seq", "batch_id_per_token", "swa_indptr",
                                                 "csa_indptr", "hca_indptr")}
    out["positions"] = int32(fn, "positions", inputs["positions"])
    for k in ("swa_indices", "csa_indices", "hca_indices"):
        out[k] = int32(fn, k, inputs[k]).clone()
    for k in ("T", "win", "ring_stride"):
        out[k] = check_int(fn, k, inputs[k], minimum=0)
    return out


def _call_combine(case: Case) -> dict:
    index_case_builder(case, "combine_topk_swa_indices_sglang")
    idx, lens = triton_fn(SPARSE_PREFILL, "combine_topk_swa_indices")(**combine_args(case.inputs))
    return {"combined_indices": idx, "combined_lens": lens}


def _call_swa_token_ids(case: Case) -> dict:
    index_case_builder(case, "build_swa_token_ids")
    res = triton_fn(SPARSE_PREFILL, "build_swa_token_ids")(**swa_token_ids_args(case.inputs))
    return dict(zip(("swa_token_ids", "swa_first_pos", "swa_gather_lens", "swa_offsets"), res))


def _call_paged_decode_indices(case: Case) -> dict:
    index_case_builder(case, "v4_paged_decode_indices")
    a = paged_decode_indices_args(case.inputs)
    triton_fn(PAGED_DECODE_INDICES, "write_v4_paged_decode_indices")(**a)
    return {k: a[k] for k in ("swa_indices", "csa_indices", "hca_indices")}


# --------------------------------------------------------------------------- sparse decode


def _call_sparse_decode(case: Case) -> dict:
    """``triton_fp8_attention_fwd`` with the keyword dict SGLang builds for
    ``flash_mla_with_kvcache`` (the FlashMLA adapter's call, ``kernels.flashmla``: heads padded to
    64/128, ``b = T`` rows of ``s_q = 1``, ``[nb, bs, 1, 584]`` caches, per-row lengths); its LSE
    comes back ``[b, s_q, h]``."""
    return sparse_decode_call(case, 1, attend=triton_fn(SPARSE_DECODE, "triton_fp8_attention_fwd"),
                              lse_heads_last=True, fn="sglang.triton_sparse_decode")


# --------------------------------------------------------------------------- unified-pool paged prefill


def paged_prefill_args(case: Case) -> dict:
    """Canonical ``prefill`` case -> ``sparse_attn_v4_paged_prefill`` arguments: the bf16 workspace
    as the ``unified_kv`` pool ``[S, 512]``, each token's first ``topk_length`` columns (all ``K``
    without lengths) as its flat ``kv_indices_prefix`` list with an int32 ``kv_indptr_prefix``; an
    empty extend region (one row of ``kv``, no indices); ``attn_sink`` fp32 ``[H]`` (``-inf``
    without a sink: adds nothing to the denominator). The kernel skips negative indices and reads
    any other value, so a case with an index ``>= S`` inside its lengths is an ``UnsupportedCase``."""
    fn = "sglang.paged_prefill_args"
    p = prefill_inputs(case, fn)
    t, k = p.idx.shape
    s_kv = p.kv.shape[0]
    ln = torch.full((t,), k, dtype=torch.int64) if p.length is None else p.length.to(torch.int64).cpu().clamp(0, k)
    idx = p.idx.to(torch.int64).cpu()
    keep = torch.arange(k)[None, :] < ln[:, None]
    if bool(((idx >= s_kv) & keep).any()):
        raise UnsupportedCase(f"an index >= S = {s_kv} inside topk_length: sparse_attn_v4_paged_prefill skips only "
                              "negative indices and would read past the pool")
    dev = p.q.device
    indptr = torch.zeros(t + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(ln, 0).to(torch.int32)
    sink = p.sink.to(torch.float32) if p.sink is not None else torch.full((p.q.shape[1],), float("-inf"))
    return dict(q=p.q.contiguous(), unified_kv=p.kv.contiguous(), kv_indices_prefix=idx[keep].to(torch.int32).to(dev),
                kv_indptr_prefix=indptr.to(dev), kv=p.kv[:1].contiguous(),
                kv_indices_extend=torch.zeros(0, dtype=torch.int32, device=dev),
                kv_indptr_extend=torch.zeros(t + 1, dtype=torch.int32, device=dev),
                attn_sink=sink.contiguous().to(dev), softmax_scale=p.scale)


def _call_paged_prefill(case: Case) -> dict:
    return {"out": triton_fn(PAGED_PREFILL, "sparse_attn_v4_paged_prefill")(**paged_prefill_args(case))}


def paged_decode_args(case: Case) -> dict:
    """Canonical ``decode`` case -> ``sparse_attn_v4_paged_decode`` arguments. The unified pool is
    the SWA cache's slots then the compressed cache's, each dequantised exactly to bf16
    (``cache_model1.dequantize_all``: the rows the oracle attends over); each token's list is its
    SWA entries then its compressed entries (offset by the SWA slot count), the columns inside its
    lengths that address a slot of their cache -- the ragged, sentinel-free form the kernel requires
    ("All entries MUST be valid slot ids", built in production by ``write_v4_paged_decode_indices``),
    so every other value is invalid (``index_rule = any_out_of_range_invalid``). ``attn_sink`` fp32
    ``[H]`` (``-inf`` without a sink)."""
    fn = "sglang.paged_decode_args"
    d = decode_inputs(case, fn)
    t = d.q.shape[0]
    pools, per_token, base = [], [[] for _ in range(t)], 0
    for seg in (d.main, d.extra):
        if seg is None:
            continue
        rows = cache_model1.dequantize_all(seg.cache, seg.block_size)
        n = rows.shape[0]
        idx = seg.idx.to(torch.int64).cpu()
        k = idx.shape[1]
        ln = torch.full((t,), k, dtype=torch.int64) if seg.length is None else seg.length.to(torch.int64).cpu().clamp(0, k)
        keep = (torch.arange(k)[None, :] < ln[:, None]) & (idx >= 0) & (idx < n)
        for i in range(t):
            per_token[i].append(idx[i][keep[i]] + base)
        pools.append(rows)
        base += n
    dev = d.q.device
    flat = torch.cat([torch.cat(lst) for lst in per_token]) if t else torch.zeros(0, dtype=torch.int64)
    indptr = torch.zeros(t + 1, dtype=torch.int64)
    indptr[1:] = torch.cumsum(torch.tensor([sum(x.numel() for x in lst) for lst in per_token], dtype=torch.int64), 0)
    sink = d.sink.to(torch.float32) if d.sink is not None else torch.full((d.q.shape[1],), float("-inf"))
    return dict(q=d.q.contiguous(), unified_kv=torch.cat(pools).to(dev).contiguous(),
                kv_indices=flat.to(torch.int32).to(dev), kv_indptr=indptr.to(torch.int32).to(dev),
                attn_sink=sink.contiguous().to(dev), softmax_scale=d.scale)


def _call_paged_decode(case: Case) -> dict:
    return {"out": triton_fn(PAGED_DECODE, "sparse_attn_v4_paged_decode")(**paged_decode_args(case))}


# --------------------------------------------------------------------------- kv norm + RoPE + E4M3 store


def norm_rope_store_args(inputs: dict) -> dict:
    """Canonical ``kv_norm_rope_store`` inputs -> ``fused_k_norm_rope_uniform_fp8`` arguments: the
    cos/sin table as SGLang's ``freqs_cis`` (complex64 ``[max_pos, 32]``, ``cos + i*sin``: the
    kernel reads ``view_as_real`` pairs ``(cos_j, sin_j)``), contiguous int positions / slots, and
    a COPY of the pool viewed as ``float8_e4m3fn`` ``[rows, 512]`` (written in place)."""
    fn = "sglang.norm_rope_store_args"
    cos_sin = inputs["cos_sin"]
    check_dtype(fn, "cos_sin", cos_sin, (torch.float32,))
    check_rank(fn, "cos_sin", cos_sin, 2)
    half = cos_sin.shape[1] // 2
    freqs = torch.complex(cos_sin[:, :half].contiguous(), cos_sin[:, half:].contiguous())
    cache = inputs["cache"]
    check_dtype(fn, "cache", cache, (torch.uint8, torch.float8_e4m3fn))
    raw = cache.view(torch.uint8) if cache.dtype != torch.uint8 else cache
    for k in ("positions", "slots"):
        check_dtype(fn, k, inputs[k], INDEX_DTYPES)
    return dict(kv=inputs["kv"].contiguous(), weight=inputs["weight"].contiguous(), eps=float(inputs["eps"]),
                freqs_cis=freqs, positions=inputs["positions"].contiguous(), loc=inputs["slots"].contiguous(),
                cache=raw.clone().contiguous().view(torch.float8_e4m3fn))


def _call_norm_rope_store(case: Case) -> dict:
    a = norm_rope_store_args(case.inputs)
    triton_fn(NORM_ROPE_STORE, "fused_k_norm_rope_uniform_fp8")(**a)
    return {"cache": a["cache"].view(torch.uint8)}


# --------------------------------------------------------------------------- entries

_ARCHS = ("any-gpu",)
_probe = sglang_probe
# The unified-KV paged decode is ROCm-only in SGLang: its backend is dispatched only under
# ``is_hip()`` (``SG:srt/layers/attention/dsv4/unified_kv_gate.py``, ``is_unified_kv_triton``) and
# the kernel asks ROCm's ``aiter`` for the CU count in two places (``unified_kv_kernels/
# paged_decode.py:136-148`` split heuristic, ``:898`` reduce grid): on an H200 every case raised
# ``ModuleNotFoundError: No module named 'aiter'``. The paged prefill's Triton path needs no aiter
# (it only prefers aiter's OPUS kernel when importable) and runs on CUDA too.
_PAGED_DECODE_ARCHS = ("gfx942", "gfx950")

ENTRIES: list[KernelEntry] = [
    KernelEntry(
        name="sglang.dequantize_k_cache_paged_dsv4",
        stage="gather",
        family="sglang",
        source=f"{DEQUANT}.dequantize_k_cache_paged_dsv4(layout=KVLayout.V4)",
        archs=_ARCHS,
        dtypes=("uint8",),
        policies={"fp8": Fp8Flavour.E4M3FN.value, "ue8m0": Ue8m0Consumer.TRITON.value},
        tolerance_scope="sglang.dequantize_k_cache_paged_dsv4",
        probe=_probe(DEQUANT),
        call=_call_gather,
        notes="SGLang's bf16 gather of the V4 (584-byte MODEL1) page by slot list (the adapter turns the "
              "block table into slots as build_swa_token_ids does). Scale byte 0 -> 0.0, 255 -> +Inf "
              "(tl.exp2). Output rows not gathered stay 0 (the reference's convention).",
    ),
    KernelEntry(
        name="sglang.gather_dequant_requant_fp8",
        stage="gather",
        family="sglang",
        source=f"{DEQUANT}.gather_dequant_requant_fp8_paged_dsv4",
        archs=_ARCHS,
        dtypes=("uint8",),
        policies={"fp8": Fp8Flavour.E4M3FN.value, "ue8m0": Ue8m0Consumer.TRITON.value,
                  "gather_out": GatherOutput.E4M3_REQUANT.value},
        tolerance_scope="sglang.gather_dequant_requant_fp8",
        probe=_probe(DEQUANT),
        call=_call_requant_gather,
        notes="The Q8KV8 prefill's FP8 workspace: each gathered value (NoPE fp8 * exp2(s - 127) in fp32, "
              "RoPE bf16) re-encoded as a unit-scale E4M3 code by the store cast (satfinite). The workspace "
              "is read back as bf16 values (exact) for the gather stage's bit-exact judge.",
    ),
    KernelEntry(
        name="sglang.combine_topk_swa_indices",
        stage="combine_prefill",
        family="sglang",
        source=f"{SPARSE_PREFILL}.combine_topk_swa_indices",
        archs=_ARCHS,
        dtypes=("int32",),
        policies={"combine_form": "sglang", "invalid_topk": CombineInvalidTopk.KEPT_MINUS1.value},
        tolerance_scope="sglang.combine_topk_swa_indices",
        probe=_probe(SPARSE_PREFILL),
        call=_call_combine,
        notes="A negative top-k entry inside topk_len becomes -1 (vLLM's common form: M*r - 1); rows past "
              "the last request are -1 with length 0. Runs the cases of builder "
              "combine_topk_swa_indices_sglang.",
    ),
    KernelEntry(
        name="sglang.build_swa_token_ids",
        stage="swa_indices",
        family="sglang",
        source=f"{SPARSE_PREFILL}.build_swa_token_ids",
        archs=_ARCHS,
        dtypes=("int32",),
        policies={},
        tolerance_scope="sglang.build_swa_token_ids",
        probe=_probe(SPARSE_PREFILL),
        call=_call_swa_token_ids,
        notes="SWA-cache token ids of each request's union of query windows, through req_to_token and "
              "full_to_swa (int64 -> int32).",
    ),
    KernelEntry(
        name="sglang.write_v4_paged_decode_indices",
        stage="swa_indices",
        family="sglang",
        source=f"{PAGED_DECODE_INDICES}.write_v4_paged_decode_indices",
        archs=_ARCHS,
        dtypes=("int32",),
        policies={},
        tolerance_scope="sglang.write_v4_paged_decode_indices",
        probe=_probe(PAGED_DECODE_INDICES),
        call=_call_paged_decode_indices,
        notes="Ring offsets slot * ring_stride + pos % ring_stride, ragged (no -1 padding) into the "
              "SWA / CSA / HCA buffers; padding tokens (batch id < 0) untouched.",
    ),
    KernelEntry(
        name="sglang.triton_sparse_decode",
        stage="decode",
        family="sglang",
        source=f"{SPARSE_DECODE}.triton_fp8_attention_fwd",
        archs=_ARCHS,
        dtypes=("bfloat16", "uint8"),
        policies={"index_rule": IndexRule.MINUS1_ONLY.value, "lse": LseConvention.NATURAL_SINKFREE.value,
                  "nan": NanPolicy.PROPAGATE.value, "attention_mode": AttentionMode.BF16_P.value,
                  "fp8": Fp8Flavour.E4M3FN.value, "ue8m0": Ue8m0Consumer.TRITON.value,
                  "output_inv_roped": "false"},
        tolerance_scope="rocm_triton.sparse_decode",
        probe=_probe(SPARSE_DECODE),
        call=_call_sparse_decode,
        notes="SGLANG_HACK_FLASHMLA_BACKEND=triton path, called with FlashMLA's keyword dict. Judged with "
              "the bf16-P Triton decode tolerance (the ROCm Triton decode's scope: same arithmetic class, "
              "bf16 dequant x bf16 scale, bf16 P, fp32 accumulation). Indices other than -1 outside the "
              "cache are skipped (UnsupportedCase: the kernel would read them).",
    ),
    KernelEntry(
        name="sglang.kv_norm_rope_store",
        stage="kv_norm_rope_store",
        family="sglang",
        source=f"{NORM_ROPE_STORE}.fused_k_norm_rope_uniform_fp8",
        archs=_ARCHS,
        dtypes=("bfloat16", "float32", "uint8"),
        policies={"rope_arith": RopeArithmetic.FMA.value, "slot_skip": SlotSkip.NEGATIVE_WRAPS.value,
                  "nonfinite": NonFinite.FINITE.value},
        tolerance_scope="sglang.kv_norm_rope_store",
        probe=_probe(NORM_ROPE_STORE),
        call=_call_norm_rope_store,
        notes="RMSNorm (eps=0 exact-norm rows: tl.sum and tl.rsqrt exact) + RoPE of the fp32 normed row "
              "(re = even*c - odd*s, im = even*s + odd*c: the left product fused, rope_arith=fma), rounded to "
              "kv's dtype, stored as unit-scale E4M3 (satfinite). A negative slot s writes row rows + s "
              "(slot_skip=negative_wraps), not skipped.",
    ),
    KernelEntry(
        name="sglang.paged_prefill",
        stage="prefill",
        family="sglang",
        source=f"{PAGED_PREFILL}.sparse_attn_v4_paged_prefill",
        archs=_ARCHS,
        dtypes=("bfloat16",),
        policies={"index_rule": IndexRule.ANY_OUT_OF_RANGE_INVALID.value, "lse": LseConvention.NONE.value,
                  "nan": NanPolicy.PROPAGATE.value, "attention_mode": AttentionMode.BF16_P.value,
                  "missing_lengths": MissingLengths.ALL_COLUMNS.value},
        tolerance_scope="rocm_triton.sparse_prefill",
        probe=_probe(PAGED_PREFILL),
        call=_call_paged_prefill,
        notes="The unified-pool prefill (from AMD's ATOM; the Triton kernel off gfx950) with the workspace as "
              "unified_kv and an empty extend region. Negative indices skipped, others read (cases with an "
              "index >= S are skipped), p rounded to bf16 before P@V (bf16_p), no LSE. Judged with the "
              "ROCm Triton prefill's tolerance scope (same arithmetic class: bf16 QK^T and P@V, fp32 online "
              "softmax).",
    ),
    KernelEntry(
        name="sglang.paged_decode",
        stage="decode",
        family="sglang",
        source=f"{PAGED_DECODE}.sparse_attn_v4_paged_decode",
        archs=_PAGED_DECODE_ARCHS,
        dtypes=("bfloat16",),
        policies={"index_rule": IndexRule.ANY_OUT_OF_RANGE_INVALID.value, "lse": LseConvention.NONE.value,
                  "nan": NanPolicy.PROPAGATE.value, "attention_mode": AttentionMode.BF16_P.value,
                  "fp8": Fp8Flavour.E4M3FN.value, "ue8m0": Ue8m0Consumer.EXACT.value,
                  "output_inv_roped": "false"},
        tolerance_scope="rocm_triton.sparse_decode",
        probe=_probe(PAGED_DECODE, _PAGED_DECODE_ARCHS),
        call=_call_paged_decode,
        notes="The unified-pool decode (from AMD's ATOM; Triton split-K / fused paths off gfx1250) over a bf16 "
              "pool: the SWA and compressed caches dequantised exactly and concatenated, each token's valid "
              "entries as a ragged list (the kernel takes no sentinels). exp2 online softmax, p rounded to bf16 "
              "before P@V (bf16_p), no LSE. The fp8 pool (e4m3fnuz + 1x64 fp32 scales) is gfx942-only: not "
              "exercised. ROCm only: SGLang dispatches it only under is_hip() and it asks aiter for the CU "
              "count (on an H200: ModuleNotFoundError 'aiter').",
    ),
]


# The releases each entry is written for (``KernelEntry.releases``, set by ``registry.assemble``), from the survey (``python -m
# dsv4_numerics.staging.survey``): ``kernels/ops/attention/dsv4/`` from 0.5.16 (0.5.12-0.5.15 keep the kernels
# under ``srt/layers/attention/dsv4/``, another module the adapters do not import); 0.5.16-0.5.20's dsv4
# package imports engine utilities the staged stand-ins do not carry; ``kv_splits`` from 0.5.21; the norm-rope
# store from 0.5.22; the rest 0.5.23.
RELEASE_RANGES = {
    "sglang.write_v4_paged_decode_indices": "sglang>=0.5.21",
    "sglang.paged_prefill": "sglang>=0.5.21",
    "sglang.paged_decode": "sglang>=0.5.21",
    "sglang.kv_norm_rope_store": "sglang>=0.5.22",
    "sglang.dequantize_k_cache_paged_dsv4": "sglang>=0.5.23",
    "sglang.gather_dequant_requant_fp8": "sglang>=0.5.23",
    "sglang.combine_topk_swa_indices": "sglang>=0.5.23",
    "sglang.build_swa_token_ids": "sglang>=0.5.23",
    "sglang.triton_sparse_decode": "sglang>=0.5.23",
}
