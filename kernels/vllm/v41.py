"""Adapters for vLLM 0.33.0's DeepSeek-V4.1 Triton ops (``vllm/models/deepseek_v41/common/ops/``:
``cache_utils.py``, ``fused_compress_quant_cache.py``; datapath 1.6, 4.1, 4.5, hazard H13).

The files reach a GPU machine without a vLLM install through ``dsv4-numerics stage-vllm --wheel
vllm-0.33.0-*.whl DIR --parts v41`` and ``DSV4_STAGED=DIR``. Each adapter converts the canonical
``Case`` inputs as vLLM's call sites do (contiguous bf16 rows, int64 slot mappings, int32 index
buffers, the ``[num_blocks, block_size, R]`` cache view whose last dimension names the record, a
COPY of any cache a kernel writes in place, a zeroed caller-allocated workspace) and returns
canonical outputs.

Entries (``V:`` = the vLLM 0.33.0 wheel, ``.../ops/`` = ``models/deepseek_v41/common/ops/``):

=================================================  ================  =====================================
entry                                              stage             production function
=================================================  ================  =====================================
vllm_v41.quantize_and_insert_k_cache.mxfp8         v41_write         ``cache_utils.quantize_and_insert_k_cache``
                                                                     (``bytes_per_token=528``)
vllm_v41.rope_quant_insert.mxfp8                   v41_write         ``fused_compress_quant_cache.rope_quant_insert``
vllm_v41.rope_quant_insert.nvfp4                   v41_write         same, 288-byte cache (sm100+: PTX e2m1x2)
vllm_v41.fused_save_compress_norm.mxfp8            v41_compress_insert ``fused_compress_quant_cache.fused_save_compress_norm``
                                                                     + ``rope_quant_insert`` (528-byte cache)
vllm_v41.fused_save_compress_norm.nvfp4            v41_compress_insert same, 288-byte cache (sm100+: PTX e2m1x2)
vllm_v41.fused_save_compress_norm.fp8_584          v41_compress_insert same, 584-byte V4 record
vllm_v41.fused_save_compress_norm.plain            v41_compress_insert same, plain bf16 / per-tensor FP8 rows
vllm_v41.indexer_k_norm_rope_store.fp8             v41_indexer_k_store ``indexer_k_store.indexer_k_norm_rope_store``
                                                                     (FP8 + fp32 scale; not where MX scales are on)
vllm_v41.indexer_k_norm_rope_store.mxfp4           v41_indexer_k_store same, MXFP4 (sm100+: PTX e2m1x2)
vllm_v41.dequantize_and_gather_k_cache.mxfp8       v41_gather        ``cache_utils.dequantize_and_gather_k_cache_triton``
vllm_v41.dequantize_and_gather_k_cache.nvfp4       v41_gather        same, 288-byte cache
vllm_v41.dequantize_and_gather_k_cache.two_pass    gather            same, 584-byte cache (CUDA: per-block kernel)
vllm_v41.dequantize_and_gather_k_cache.one_pass    gather            ``_dequantize_and_gather_k_one_pass_kernel``
                                                                     (ROCm's choice, launched directly)
vllm_v41.compute_global_topk_indices_and_lens      topk_global       ``cache_utils.compute_global_topk_indices_and_lens``
vllm_v41.combine_topk_swa_indices                  combine_prefill   ``cache_utils.combine_topk_swa_indices``
vllm_v41.build_flashinfer_mixed_sparse_indices     flashinfer_mixed  ``cache_utils.build_flashinfer_mixed_sparse_indices``
=================================================  ================  =====================================

Declared quantisation rules, derived from the sources:

* MXFP8 writers (``_quantize_and_insert_k_mxfp8_kernel``, ``cache_utils.py:184-240``;
  ``_rope_quant_insert_mxfp8_kernel``, ``fused_compress_quant_cache.py:426-477``): ``amax`` floored at
  1e-4, ``e = ceil(log2(amax * (1/448)))`` (``ScaleRule.AMAX_CLAMP``), codes
  ``float8e4nv(clamp(x * 2**-e, +-448))`` (RNE, ``cvt.rn.satfinite``), byte ``clamp(e + 127, 0, 255)``;
  NaN / Inf: ``NonFinite.TRITON`` (``maxnum`` amax, NaN codes 0x7E). ``SANITIZE_CACHE_NANS`` is gfx950
  only (False here).
* NVFP4 writer (``_rope_quant_insert_nvfp4_kernel``, ``:480-531``): scale
  ``float8e4nv(clamp(amax * fl32(1/6), 2**-9, 448))`` (``Nvfp4ScaleRule.RECIP_MUL``; subnormal E4M3
  scales kept), ``div_rn`` by the decoded scale, ``cvt.rn.satfinite.e2m1x2.f32`` (E2M1 RNE ties to
  even, saturating at 6); a zero group writes scale 0x01; NaN / Inf ``Nvfp4NonFinite.TRITON``.
  Both writers keep each token's scales after its own data (``V41Layout.INTERLEAVED``); FlashInfer
  0.7.2 writes the page-footer order with ``SCALE_CLAMP`` / ``DIV_RN`` / ``POISON``
  (``reference.caches.v41.PRODUCERS``), a different producer, never declared here.
* Gathers: MXFP8 ``fp8 * exp2(b - 127)`` in fp32 (``Ue8m0Consumer.TRITON``: byte 0 -> 0.0 under
  ``ex2.approx.ftz``, 255 -> +Inf), NVFP4 ``e2m1 * float(e4m3 scale)`` in fp32 (exact), one bf16
  rounding; both read the interleaved order.

``rope_quant_insert`` is fed an identity RoPE table (``cos = 1, sin = 0``) at position 0 with
``compress_ratio = 1``: every token is a boundary token and the kernels rotate ALL 256 pairs (the
NoPE pairs load ``(1, 0)`` too), so the stage's ``writer_rope = identity_all`` models the signed
zeros and NaN partners that rotation produces (``oracles.stages.identity_rotated_pairs``).

``fused_save_compress_norm`` (the ring-buffer compressor: its state is not the ``compressor``
stage's) is judged with the ``rope_quant_insert`` call that publishes its latent, on its own stage
``v41_compress_insert`` (``oracles.stages.v41_compress``; ``prev_rows`` / PCP not exercised).

``indexer_k_norm_rope_store`` is judged on ``v41_indexer_k_store`` (``oracles.stages.v41_indexer``):
bit-exact on exact-norm rows, fp32 scales only (``IndexerKScale``), row-major pages (CUDA).

Not covered here: the ``use_fnuz=True`` MXFP8 flavours (gfx942 only), the indexer's ROCm tiled
value order, and the FlashMLA / query-quantiser V4.1 attention side (``oracles.stages.v41_attention``).
"""

from __future__ import annotations

from typing import Callable

import torch

from dsv4_numerics.reference.caches import v41 as cache_v41
from dsv4_numerics.reference.cases import Case
from dsv4_numerics.reference.constants import HEAD_DIM, NOPE_DIM, ROPE_DIM
from dsv4_numerics.reference.errors import INDEX_DTYPES, UnsupportedCase, check_dtype, check_int, check_rank, fail
from dsv4_numerics.reference.policies import (
    Fp8Flavour,
    IndexerKScale,
    NonFinite,
    Nvfp4ScaleRule,
    RopeArithmetic,
    ScaleRule,
    SlotSkip,
    Ue8m0Consumer,
    V41Layout,
    V41Record,
)

from dsv4_numerics.kernels.probe import chain, needs_arch
from dsv4_numerics.kernels.registry import KernelEntry
from dsv4_numerics.reference.pipeline.rope import identity_cos_sin
from dsv4_numerics.reference.storage import clone_storage
from dsv4_numerics.kernels.vllm.triton import call_index, triton_fn, combine_args, flashinfer_mixed_args, gather_args, int32, staged_triton_probe, topk_global_args

__all__ = [
    "ENTRIES",
    "V41_CACHE_UTILS",
    "V41_COMPRESS",
    "NVFP4_WRITER_ARCHS",
    "v41_cache_view",
    "v41_writer_args",
    "v41_gather_args",
    "combine_v41_args",
    "flashinfer_mixed_v41_args",
]

V41_CACHE_UTILS = "vllm.models.deepseek_v41.common.ops.cache_utils"
V41_COMPRESS = "vllm.models.deepseek_v41.common.ops.fused_compress_quant_cache"
V41_INDEXER = "vllm.models.deepseek_v41.common.ops.indexer_k_store"

# ``cvt.rn.satfinite.e2m1x2.f32`` (the inline PTX of ``_fp32x2_to_fp4x2``,
# ``V:models/deepseek_v4/common/ops/fused_indexer_q.py:39-54``) exists only on the
# arch-specific Blackwell targets (sm_100a / sm_103a / sm_120a / sm_121a): ptxas rejects it on sm_90a.
NVFP4_WRITER_ARCHS = ("sm100", "sm103", "sm120", "sm121")


def _record_of(fn: str, case: Case, want: V41Record) -> V41Record:
    got = case.inputs.get("record")
    if got != want.value:
        raise UnsupportedCase(f"case {case.name!r} holds {got!r} records; this entry handles {want.value!r} only")
    return want


def v41_cache_view(fn: str, cache: torch.Tensor, block_size: int, record: V41Record, copy: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(owner, view)``: the ``[num_blocks, block_size, R]`` kernel view (strides ``(P, R, 1)``,
    ``R = 528 | 288`` -- vLLM reads the record off ``shape[-1]`` and the page stride off
    ``stride(0)``) over ``cache``'s own bytes, or over a copy of its storage when ``copy`` (for
    in-place writers; ``owner`` is then the copy in the input's form)."""
    nb, bs, p = cache_v41.cache_geometry(fn, cache, block_size, record)
    owner = clone_storage(cache) if copy else cache
    rb = cache_v41.record_bytes(record)
    return owner, torch.as_strided(owner, (nb, bs, rb), (p, rb, 1), owner.storage_offset())


def v41_writer_args(fn: str, inputs: dict, record: V41Record, slot_skip: SlotSkip) -> dict:
    """Canonical ``v41_write`` inputs -> the common writer arguments: contiguous bf16 ``k``, int64
    ``slot_mapping``, the cache copy ``owner`` and its kernel ``view``. Under ``MINUS1_ONLY`` (the
    ``quantize_and_insert_k_cache`` kernels skip only ``-1``, ``cache_utils.py:207-209``) other
    negative slots raise ``UnsupportedCase`` before any launch (they would be written out of
    bounds); slots past the cache raise InputError."""
    k = inputs["k"]
    check_dtype(fn, "k", k, (torch.bfloat16,))
    check_rank(fn, "k", k, 2)
    if k.shape[1] != HEAD_DIM:
        fail(fn, "k", f"must have shape [N, {HEAD_DIM}]", tuple(k.shape))
    bs = check_int(fn, "block_size", inputs["block_size"], minimum=1)
    slots = inputs["slot_mapping"]
    check_dtype(fn, "slot_mapping", slots, INDEX_DTYPES)
    check_rank(fn, "slot_mapping", slots, 1)
    if slots.shape[0] > k.shape[0]:
        fail(fn, "slot_mapping", f"must not be longer than k (N = {k.shape[0]})", slots.shape[0])
    owner, view = v41_cache_view(fn, inputs["cache"], bs, record, copy=True)
    if slots.numel():
        if slot_skip is SlotSkip.MINUS1_ONLY and bool(((slots < 0) & (slots != -1)).any()):
            raise UnsupportedCase("slot_mapping holds negative slots other than -1: the V4.1 MXFP8 "
                                  "quantize_and_insert kernel would write them out of bounds (cache_utils.py:207-209)")
        if int(slots.max()) >= view.shape[0] * bs:
            fail(fn, "slot_mapping", f"must be < num_blocks*block_size = {view.shape[0] * bs}", int(slots.max()))
    return dict(k=k.contiguous(), slot_mapping=slots.to(torch.int64).contiguous(), block_size=bs, owner=owner, view=view)


def _call_qins_mxfp8(case: Case) -> dict:
    rec = _record_of("vllm_v41.quantize_and_insert_k_cache", case, V41Record.MXFP8)
    a = v41_writer_args("v41_writer_args", case.inputs, rec, SlotSkip.MINUS1_ONLY)
    # The 2-D [num_blocks, page_stride] form the callers pass; bytes_per_token picks the record.
    pages = torch.as_strided(a["view"], (a["view"].shape[0], a["view"].stride(0)), (a["view"].stride(0), 1))
    triton_fn(V41_CACHE_UTILS, "quantize_and_insert_k_cache")(
        a["k"], pages, a["slot_mapping"], block_size=a["block_size"], is_ue8m0=True, use_fnuz=False,
        bytes_per_token=cache_v41.record_bytes(rec))
    return {"cache": a["owner"]}


def _call_rope_insert(record: V41Record) -> Callable[[Case], dict]:
    def call(case: Case) -> dict:
        _record_of("vllm_v41.rope_quant_insert", case, record)
        a = v41_writer_args("v41_writer_args", case.inputs, record, SlotSkip.ALL_NEGATIVE)
        n = a["k"].shape[0]
        if a["slot_mapping"].numel():
            triton_fn(V41_COMPRESS, "rope_quant_insert")(
                a["k"], torch.zeros(n, dtype=torch.int64, device=a["k"].device), identity_cos_sin(1, a["k"].device),
                a["view"], a["slot_mapping"], compress_ratio=1)
        return {"cache": a["owner"]}

    return call


def compress_insert_args(fn: str, inputs: dict) -> dict:
    """Canonical ``v41_compress_insert`` inputs -> ``fused_save_compress_norm`` and
    ``rope_quant_insert`` arguments as the V4.1 attention layer passes them: contiguous fp32
    ``kv_score``, int64 ``positions`` / slot mappings, a COPY of the fp32 ring (ratio 2; written in
    place), int32 ``query_start_loc`` / ``token_to_req_indices``, a zeroed bf16 ``latent_out``
    ``[T, 512]``, fp32 ``cos_sin``, and a copy of the cache in the kernel's form: the
    ``[num_blocks, block_size, R]`` view (R = 528 / 288 / 584 picks the record), a bf16 or
    float8_e4m3fn ``[num_blocks, block_size, 512]`` plain cache, with its fp32 ``fp8_scale``."""
    from dsv4_numerics.reference.caches import model1 as cache_model1

    ratio = check_int(fn, "compress_ratio", inputs["compress_ratio"], minimum=1)
    kv = inputs["kv_score"]
    check_dtype(fn, "kv_score", kv, (torch.float32,))
    dev = kv.device
    state = inputs.get("state_cache")
    a = dict(kv_score=kv.contiguous(), positions=inputs["positions"].to(torch.int64).contiguous(),
             state_cache=None if state is None else state.clone().contiguous(),
             slot_mapping=inputs["state_slots"].to(torch.int64).contiguous(),
             query_start_loc=int32(fn, "query_start_loc", inputs.get("query_start_loc")),
             token_to_req_indices=int32(fn, "token_to_req_indices", inputs.get("token_to_req_indices")),
             rms_norm_weight=inputs["norm_weight"].to(torch.bfloat16).contiguous(), rms_norm_eps=float(inputs["eps"]),
             compress_ratio=ratio,
             latent_out=torch.zeros((kv.shape[0], HEAD_DIM), dtype=torch.bfloat16, device=dev))
    record, bs, cache = inputs["record"], check_int(fn, "block_size", inputs["block_size"], minimum=1), inputs["cache"]
    fp8_scale = None
    if record in (V41Record.MXFP8.value, V41Record.NVFP4.value):
        owner, view = v41_cache_view(fn, cache, bs, V41Record(record), copy=True)
    elif record == "model1_584":
        owner = clone_storage(cache)
        view = cache_model1.kernel_view(owner, bs)
    elif record == "plain_bf16":
        owner = view = cache.clone()
    elif record == "plain_fp8":
        owner = cache.clone()
        view = owner.view(torch.float8_e4m3fn)
        fp8_scale = torch.tensor([float(inputs["fp8_scale"])], dtype=torch.float32, device=dev)
    else:
        fail(fn, "record", "must be mxfp8_528, nvfp4_288, model1_584, plain_bf16 or plain_fp8", record)
    insert = dict(positions=a["positions"], cos_sin_cache=inputs["cos_sin"].to(torch.float32).contiguous(),
                  kv_cache=view, slot_mapping=inputs["cache_slots"].to(torch.int64).contiguous(),
                  compress_ratio=ratio, fp8_scale=fp8_scale)
    return dict(save=a, insert=insert, owner=owner)


def _call_compress_insert(records: tuple[str, ...]) -> Callable[[Case], dict]:
    """``fused_save_compress_norm`` then ``rope_quant_insert`` of its latent (the two ops the V4.1
    layer schedules for a compressed layer) for cases of ``records``; other cases are skipped."""

    def call(case: Case) -> dict:
        if case.inputs["record"] not in records:
            raise UnsupportedCase(f"case {case.name!r} holds {case.inputs['record']!r} records; this entry "
                                  f"writes {list(records)}")
        a = compress_insert_args("compress_insert_args", case.inputs)
        triton_fn(V41_COMPRESS, "fused_save_compress_norm")(**a["save"])
        triton_fn(V41_COMPRESS, "rope_quant_insert")(a["save"]["latent_out"], **a["insert"])
        out = {"latent": a["save"]["latent_out"], "cache": a["owner"]}
        if a["save"]["state_cache"] is not None:
            out["state"] = a["save"]["state_cache"]
        return out

    return call


def indexer_store_args(fn: str, inputs: dict) -> dict:
    """Canonical ``v41_indexer_k_store`` inputs -> ``indexer_k_norm_rope_store`` arguments: contiguous
    bf16 ``k_pre``, int64 ``positions`` / ``kv_slot_mapping``, fp32 ``cos_sin_cache``, a COPY of the
    uint8 ``[num_blocks, block_size, row_bytes]`` cache (written in place), ``use_fp4_cache`` from
    the case's record."""
    record = inputs["record"]
    if record not in ("fp8", "mxfp4"):
        fail(fn, "record", "must be fp8 or mxfp4", record)
    cache = inputs["cache"]
    check_dtype(fn, "cache", cache, (torch.uint8,))
    check_rank(fn, "cache", cache, 3)
    return dict(k_pre=inputs["k_pre"].to(torch.bfloat16).contiguous(),
                positions=inputs["positions"].to(torch.int64).contiguous(),
                cos_sin_cache=inputs["cos_sin"].to(torch.float32).contiguous(),
                rms_norm_weight=inputs["weight"].to(torch.bfloat16).contiguous(), rms_norm_eps=float(inputs["eps"]),
                k_cache=cache.clone().contiguous(), kv_slot_mapping=inputs["slots"].to(torch.int64).contiguous(),
                compress_ratio=check_int(fn, "compress_ratio", inputs["compress_ratio"], minimum=1),
                use_fp4_cache=record == "mxfp4")


def _call_indexer_store(record: str) -> Callable[[Case], dict]:
    def call(case: Case) -> dict:
        if case.inputs["record"] != record:
            raise UnsupportedCase(f"case {case.name!r} holds {case.inputs['record']!r} records; this entry "
                                  f"writes {record!r}")
        a = indexer_store_args("indexer_store_args", case.inputs)
        triton_fn(V41_INDEXER, "indexer_k_norm_rope_store")(**a)
        return {"cache": a["k_cache"]}

    return call


def no_mx_scales() -> str | None:
    """The FP8 indexer writer stores ``pack_ue8m0_x4`` scales where ``mqa_logits_use_mx_scales()``
    (DeepGEMM, SM100) holds; the reference models the fp32 scale only (``IndexerKScale.FP32``)."""
    try:
        use_mx = bool(triton_fn("vllm.utils.deep_gemm", "mqa_logits_use_mx_scales")())
    except Exception as e:  # noqa: BLE001 - the reason is the result
        return f"vllm.utils.deep_gemm.mqa_logits_use_mx_scales unavailable: {type(e).__name__}: {e}"
    if use_mx:
        return ("mqa_logits_use_mx_scales() is True here: the writer stores pack_ue8m0_x4 scales "
                "(indexer_k_scale=ue8m0_x4), which the reference does not model")
    return None


def v41_gather_args(fn: str, inputs: dict, record: V41Record) -> dict:
    """Canonical ``v41_gather`` inputs -> ``dequantize_and_gather_k_cache_triton`` arguments: a zeroed
    bf16 workspace ``out [R, offset + max(g), 512]`` (the reference's width; unwritten rows stay 0),
    the ``[nb, bs, R]`` view of the case's cache (read only), int32 ``seq_lens`` / ``gather_lens``
    (or None) / ``block_table``, ``block_size``, ``offset``."""
    bs = check_int(fn, "block_size", inputs["block_size"], minimum=1)
    _, view = v41_cache_view(fn, inputs["cache"], bs, record, copy=False)
    seq = int32(fn, "seq_lens", inputs["seq_lens"])
    gl = int32(fn, "gather_lens", inputs.get("gather_lens"))
    bt = int32(fn, "block_table", inputs["block_table"])
    check_rank(fn, "block_table", bt, 2)
    offset = check_int(fn, "offset", inputs.get("offset", 0), minimum=0)
    r = bt.shape[0]
    for name, t in (("seq_lens", seq), ("gather_lens", gl)):
        if t is not None and tuple(t.shape) != (r,):
            fail(fn, name, f"must have shape [{r}] (one per block_table row)", tuple(t.shape))
    g = seq if gl is None else gl
    width = offset + (int(g.max()) if r else 0)
    out = torch.zeros((r, width, HEAD_DIM), dtype=torch.bfloat16, device=view.device)
    return dict(out=out, k_cache=view, seq_lens=seq, gather_lens=gl, block_table=bt, block_size=bs, offset=offset)


def _call_v41_gather(record: V41Record) -> Callable[[Case], dict]:
    def call(case: Case) -> dict:
        _record_of("vllm_v41.dequantize_and_gather_k_cache", case, record)
        a = v41_gather_args("v41_gather_args", case.inputs, record)
        # The Triton half of the wrapper, called directly: the wrapper takes the CuTe-DSL gather
        # for the 528-byte record when cutlass imports (cache_utils.py:798-815).
        triton_fn(V41_CACHE_UTILS, "dequantize_and_gather_k_cache_triton")(**a, use_fnuz=False)
        return {"out": a["out"]}

    return call


def _call_gather_584(one_pass: bool) -> Callable[[Case], dict]:
    """The 584-byte gathers of the V4.1 file. Two-pass: the wrapper's CUDA branch
    (``current_platform.is_rocm()`` False). One-pass: the kernel ROCm selects, launched with the
    wrapper's arguments (``cache_utils.py:736-761``)."""

    def call(case: Case) -> dict:
        a = gather_args(case.inputs)
        if not one_pass:
            triton_fn(V41_CACHE_UTILS, "dequantize_and_gather_k_cache_triton")(**a, use_fnuz=False)
            return {"out": a["out"]}
        out, cache, bs = a["out"], a["k_cache"], a["block_size"]
        workers = triton_fn(V41_CACHE_UTILS, "gather_num_workers")(None)
        triton_fn(V41_CACHE_UTILS, "_dequantize_and_gather_k_one_pass_kernel")[(a["seq_lens"].shape[0], workers)](
            out, out.stride(0), out.stride(1), cache, a["seq_lens"], a["block_table"], a["offset"], a["gather_lens"],
            max_blocks_per_seq=a["block_table"].shape[-1], fp8_dim=NOPE_DIM, bf16_dim=ROPE_DIM, scale_dim=8,
            quant_block=64, cache_block_size=bs, token_data_size=NOPE_DIM + 2 * ROPE_DIM,
            block_stride=cache.stride(0), output_dim=HEAD_DIM, fp8_max=448.0, n_quant_blocks=7, use_fnuz=False)
        return {"out": out}

    return call


def combine_v41_args(inputs: dict) -> dict:
    """``combine_args`` for the V4.1 ``combine_topk_swa_indices``, which has no vision arguments
    (``left_visible`` / ``right_visible`` / ``max_image_tokens``): a case with image spans is not
    this builder's contract (``UnsupportedCase``)."""
    if inputs.get("left_visible") is not None or inputs.get("max_image_tokens"):
        raise UnsupportedCase("the V4.1 combine_topk_swa_indices has no vision columns (image spans)")
    return combine_args(inputs)


_V4_ONLY_MIXED_ARGS = ("prefill_left_visible", "prefill_right_visible", "max_image_tokens", "num_rows")


def flashinfer_mixed_v41_args(inputs: dict) -> dict:
    """``flashinfer_mixed_args`` for the V4.1 builder (``cache_utils.py:1227-1374``), whose contract
    differs from the V4 one the ``flashinfer_mixed`` reference models in four named ways:

    * ``replay_start`` (int32 ``[num_reqs]``, keyword-only, required) lower-bounds every prefill
      window: the case's ``replay_start`` (modelled by the reference's argument of that name), zeros
      when the case has none (the V4 window unchanged, ``max(swa_start, 0)``);
    * a decode row wider than ``window_size`` is copied verbatim (V4 reorders DSpark's
      non-causal block rows): such cases raise ``UnsupportedCase``;
    * no vision columns, no ``num_rows`` (outputs sized by the tokens): cases using them raise
      ``UnsupportedCase``."""
    fn = "flashinfer_mixed_v41_args"
    if inputs.get("prefill_left_visible") is not None or inputs.get("max_image_tokens"):
        raise UnsupportedCase("the V4.1 build_flashinfer_mixed_sparse_indices has no vision columns")
    if inputs.get("num_rows") is not None:
        raise UnsupportedCase("the V4.1 build_flashinfer_mixed_sparse_indices has no num_rows (graph-padded rows)")
    swa = inputs["decode_swa_indices"]
    if swa.dim() == 2 and swa.shape[1] > inputs["window_size"]:
        raise UnsupportedCase("decode rows wider than the window: V4 reorders DSpark's non-causal block, the "
                              "V4.1 builder copies the row verbatim (a different contract)")
    a = flashinfer_mixed_args({k: v for k, v in inputs.items() if k not in _V4_ONLY_MIXED_ARGS + ("replay_start",)})
    if a.get("seq_lens") is None:
        fail(fn, "seq_lens", "is required (replay_start has one entry per request)")
    rs = inputs.get("replay_start")
    a["replay_start"] = torch.zeros_like(a["seq_lens"]) if rs is None else int32(fn, "replay_start", rs)
    return a


# --------------------------------------------------------------------------- entries

# NVIDIA: the staged stand-ins describe an NVIDIA platform (``_ON_GFX950`` False, OCP FP8); on ROCm
# these files run under vLLM's own platform, which a staged folder does not reproduce.
_TRITON_ARCHS = ("any-cuda",)
_probe_cache_utils = staged_triton_probe(V41_CACHE_UTILS)
_probe_compress = staged_triton_probe(V41_COMPRESS)
_probe_indexer = staged_triton_probe(V41_INDEXER)
_WRITER = {"v41_layout": V41Layout.INTERLEAVED.value, "scale_rule": ScaleRule.AMAX_CLAMP.value,
           "nvfp4_rule": Nvfp4ScaleRule.RECIP_MUL.value, "nonfinite": NonFinite.TRITON.value,
           "fp8": Fp8Flavour.E4M3FN.value}
_ROPE_WRITER = {**_WRITER, "slot_skip": SlotSkip.ALL_NEGATIVE.value, "writer_rope": "identity_all",
                "rope_arith": RopeArithmetic.FMA_TRITON.value}
_COMPRESS = {"scale_rule": ScaleRule.AMAX_CLAMP.value, "nvfp4_rule": Nvfp4ScaleRule.RECIP_MUL.value,
             "v41_layout": V41Layout.INTERLEAVED.value, "rope_arith": RopeArithmetic.FMA_TRITON.value}
_GATHER_584 = {"fp8": Fp8Flavour.E4M3FN.value, "ue8m0": Ue8m0Consumer.TRITON.value}

ENTRIES: list[KernelEntry] = [
    KernelEntry(
        name="vllm_v41.quantize_and_insert_k_cache.mxfp8",
        stage="v41_write",
        family="Triton",
        source=f"{V41_CACHE_UTILS}.quantize_and_insert_k_cache(bytes_per_token=528)",
        archs=_TRITON_ARCHS,
        dtypes=("bfloat16",),
        policies={**_WRITER, "slot_skip": SlotSkip.MINUS1_ONLY.value},
        tolerance_scope="vllm_v41.quantize_and_insert_k_cache.mxfp8",
        probe=_probe_cache_utils,
        call=_call_qins_mxfp8,
        notes="V4.1 MXFP8 writer (528 B, interleaved). NVFP4 cases are skipped (MXFP8 only); cases with "
              "negative slots other than -1 are skipped (written out of bounds by the kernel).",
    ),
    KernelEntry(
        name="vllm_v41.rope_quant_insert.mxfp8",
        stage="v41_write",
        family="Triton",
        source=f"{V41_COMPRESS}.rope_quant_insert (528-byte cache)",
        archs=_TRITON_ARCHS,
        dtypes=("bfloat16",),
        policies={**_ROPE_WRITER},
        tolerance_scope="vllm_v41.rope_quant_insert.mxfp8",
        probe=_probe_compress,
        call=_call_rope_insert(V41Record.MXFP8),
        notes="Compressed-cache publisher, fed an identity RoPE table: all 256 pairs rotated in fp32 "
              "(writer_rope=identity_all), then MXFP8. NVFP4 cases are the .nvfp4 entry's.",
    ),
    KernelEntry(
        name="vllm_v41.rope_quant_insert.nvfp4",
        stage="v41_write",
        family="Triton",
        source=f"{V41_COMPRESS}.rope_quant_insert (288-byte cache)",
        archs=NVFP4_WRITER_ARCHS,
        dtypes=("bfloat16",),
        policies={**_ROPE_WRITER},
        tolerance_scope="vllm_v41.rope_quant_insert.nvfp4",
        probe=chain(_probe_compress, needs_arch(*NVFP4_WRITER_ARCHS)),
        call=_call_rope_insert(V41Record.NVFP4),
        notes="NVFP4 publisher: RECIP_MUL scale, div_rn, cvt.rn.satfinite.e2m1x2.f32 -- inline PTX that "
              "only the arch-specific Blackwell targets accept, so unavailable on sm90 (H100/H200).",
    ),
    KernelEntry(
        name="vllm_v41.fused_save_compress_norm.mxfp8",
        stage="v41_compress_insert",
        family="Triton",
        source=f"{V41_COMPRESS}.fused_save_compress_norm + rope_quant_insert (528-byte cache)",
        archs=_TRITON_ARCHS,
        dtypes=("float32", "bfloat16"),
        policies=dict(_COMPRESS),
        tolerance_scope="vllm_v41.fused_save_compress_norm.mxfp8",
        probe=_probe_compress,
        call=_call_compress_insert((V41Record.MXFP8.value,)),
        notes="V4.1 fused compressor (ratio 1 / 2 ring) publishing MXFP8 528 B records; latent by the "
              "compressor tier, ring and records bit-exact.",
    ),
    KernelEntry(
        name="vllm_v41.fused_save_compress_norm.nvfp4",
        stage="v41_compress_insert",
        family="Triton",
        source=f"{V41_COMPRESS}.fused_save_compress_norm + rope_quant_insert (288-byte cache)",
        archs=NVFP4_WRITER_ARCHS,
        dtypes=("float32", "bfloat16"),
        policies=dict(_COMPRESS),
        tolerance_scope="vllm_v41.fused_save_compress_norm.nvfp4",
        probe=chain(_probe_compress, needs_arch(*NVFP4_WRITER_ARCHS)),
        call=_call_compress_insert((V41Record.NVFP4.value,)),
        notes="NVFP4 publisher: cvt.rn.satfinite.e2m1x2.f32 exists only on Blackwell, unavailable on sm90.",
    ),
    KernelEntry(
        name="vllm_v41.fused_save_compress_norm.fp8_584",
        stage="v41_compress_insert",
        family="Triton",
        source=f"{V41_COMPRESS}.fused_save_compress_norm + rope_quant_insert (584-byte cache)",
        archs=_TRITON_ARCHS,
        dtypes=("float32", "bfloat16"),
        policies=dict(_COMPRESS),
        tolerance_scope="vllm_v41.fused_save_compress_norm.fp8_584",
        probe=_probe_compress,
        call=_call_compress_insert(("model1_584",)),
        notes="V4.1 fused compressor publishing the V4 584-byte FP8 record (64-wide Q_A tiles, bf16 RoPE).",
    ),
    KernelEntry(
        name="vllm_v41.fused_save_compress_norm.plain",
        stage="v41_compress_insert",
        family="Triton",
        source=f"{V41_COMPRESS}.fused_save_compress_norm + rope_quant_insert (bf16 / per-tensor FP8 rows)",
        archs=_TRITON_ARCHS,
        dtypes=("float32", "bfloat16", "float8_e4m3fn"),
        policies=dict(_COMPRESS),
        tolerance_scope="vllm_v41.fused_save_compress_norm.plain",
        probe=_probe_compress,
        call=_call_compress_insert(("plain_bf16", "plain_fp8")),
        notes="Plain [448 NoPE | 64 RoPE] rows read by FlashInfer: bf16, or FP8 scaled by 1/fp8_scale "
              "(a power of two in the cases: Triton's 1.0 / x is div.full).",
    ),
    KernelEntry(
        name="vllm_v41.indexer_k_norm_rope_store.fp8",
        stage="v41_indexer_k_store",
        family="Triton",
        source=f"{V41_INDEXER}.indexer_k_norm_rope_store(use_fp4_cache=False)",
        archs=_TRITON_ARCHS,
        dtypes=("bfloat16", "uint8"),
        policies={"rope_arith": RopeArithmetic.FMA_TRITON.value, "indexer_k_scale": IndexerKScale.FP32.value},
        tolerance_scope="vllm_v41.indexer_k_norm_rope_store.fp8",
        probe=chain(_probe_indexer, no_mx_scales),
        call=_call_indexer_store("fp8"),
        notes="Indexer K: k_norm, RoPE at the group start, FP8 + fp32 scale; unavailable where DeepGEMM's MX "
              "scales are on (SM100: pack_ue8m0_x4, not modelled).",
    ),
    KernelEntry(
        name="vllm_v41.indexer_k_norm_rope_store.mxfp4",
        stage="v41_indexer_k_store",
        family="Triton",
        source=f"{V41_INDEXER}.indexer_k_norm_rope_store(use_fp4_cache=True)",
        archs=NVFP4_WRITER_ARCHS,
        dtypes=("bfloat16", "uint8"),
        policies={"rope_arith": RopeArithmetic.FMA_TRITON.value, "indexer_k_scale": IndexerKScale.FP32.value},
        tolerance_scope="vllm_v41.indexer_k_norm_rope_store.mxfp4",
        probe=chain(_probe_indexer, needs_arch(*NVFP4_WRITER_ARCHS)),
        call=_call_indexer_store("mxfp4"),
        notes="MXFP4 indexer K (UE8M0 per 32 dims): cvt.rn.satfinite.e2m1x2.f32 exists only on Blackwell.",
    ),
    KernelEntry(
        name="vllm_v41.dequantize_and_gather_k_cache.mxfp8",
        stage="v41_gather",
        family="Triton",
        source=f"{V41_CACHE_UTILS}._dequantize_and_gather_k_mxfp8_kernel",
        archs=_TRITON_ARCHS,
        dtypes=("uint8",),
        policies={"v41_layout": V41Layout.INTERLEAVED.value, "ue8m0": Ue8m0Consumer.TRITON.value},
        tolerance_scope="vllm_v41.dequantize_and_gather_k_cache.mxfp8",
        probe=_probe_cache_utils,
        call=_call_v41_gather(V41Record.MXFP8),
        notes="Triton MXFP8 gather (the wrapper's CuTe-DSL branch is bypassed). Scale byte 0 -> 0.0, "
              "255 -> +Inf (exp2 with ftz).",
    ),
    KernelEntry(
        name="vllm_v41.dequantize_and_gather_k_cache.nvfp4",
        stage="v41_gather",
        family="Triton",
        source=f"{V41_CACHE_UTILS}._dequantize_and_gather_k_nvfp4_kernel",
        archs=_TRITON_ARCHS,
        dtypes=("uint8",),
        policies={"v41_layout": V41Layout.INTERLEAVED.value, "e2m1_zero": "positive"},
        tolerance_scope="vllm_v41.dequantize_and_gather_k_cache.nvfp4",
        probe=_probe_cache_utils,
        call=_call_v41_gather(V41Record.NVFP4),
        notes="Triton NVFP4 gather: E2M1 decoded arithmetically, E4M3 scale via float8e4nv (0x7F -> NaN).",
    ),
    KernelEntry(
        name="vllm_v41.dequantize_and_gather_k_cache.two_pass",
        stage="gather",
        family="Triton",
        source=f"{V41_CACHE_UTILS}._dequantize_and_gather_k_kernel",
        archs=_TRITON_ARCHS,
        dtypes=("uint8",),
        policies={**_GATHER_584},
        tolerance_scope="vllm_v41.dequantize_and_gather_k_cache.two_pass",
        probe=_probe_cache_utils,
        call=_call_gather_584(one_pass=False),
        notes="The V4 584-byte record gather of the V4.1 file (per-block loads; the CUDA choice).",
    ),
    KernelEntry(
        name="vllm_v41.dequantize_and_gather_k_cache.one_pass",
        stage="gather",
        family="Triton",
        source=f"{V41_CACHE_UTILS}._dequantize_and_gather_k_one_pass_kernel",
        archs=_TRITON_ARCHS,
        dtypes=("uint8",),
        policies={**_GATHER_584},
        tolerance_scope="vllm_v41.dequantize_and_gather_k_cache.one_pass",
        probe=_probe_cache_utils,
        call=_call_gather_584(one_pass=True),
        notes="One 512-wide tile per token (ROCm's choice), launched directly on NVIDIA: its tail reads "
              "the token's bf16 bytes and drops them by the store mask.",
    ),
    KernelEntry(
        name="vllm_v41.compute_global_topk_indices_and_lens",
        stage="topk_global",
        family="Triton",
        source=f"{V41_CACHE_UTILS}.compute_global_topk_indices_and_lens",
        archs=_TRITON_ARCHS,
        dtypes=("int32",),
        policies={"topk_lens": "count"},
        tolerance_scope="vllm_v41.compute_global_topk_indices_and_lens",
        probe=_probe_cache_utils,
        call=call_index("compute_global_topk_indices_and_lens", topk_global_args,
                         ("global_topk_indices", "topk_lens"), module=V41_CACHE_UTILS),
        notes="Same contract as the V4 builder (plain Triton launch instead of the JIT-warmup class).",
    ),
    KernelEntry(
        name="vllm_v41.combine_topk_swa_indices",
        stage="combine_prefill",
        family="Triton",
        source=f"{V41_CACHE_UTILS}.combine_topk_swa_indices",
        archs=_TRITON_ARCHS,
        dtypes=("int32",),
        policies={"combine_form": "common", "invalid_topk": "bounded_minus1", "window_start": "gathered"},
        tolerance_scope="vllm_v41.combine_topk_swa_indices",
        probe=_probe_cache_utils,
        call=call_index("combine_topk_swa_indices", combine_v41_args, ("combined_indices", "combined_lens"),
                         module=V41_CACHE_UTILS),
        notes="Common form without vision columns (cases with image spans are skipped).",
    ),
    KernelEntry(
        name="vllm_v41.build_flashinfer_mixed_sparse_indices",
        stage="flashinfer_mixed",
        family="Triton",
        source=f"{V41_CACHE_UTILS}.build_flashinfer_mixed_sparse_indices",
        archs=_TRITON_ARCHS,
        dtypes=("int32",),
        policies={},
        tolerance_scope="vllm_v41.build_flashinfer_mixed_sparse_indices",
        probe=_probe_cache_utils,
        call=call_index("build_flashinfer_mixed_sparse_indices", flashinfer_mixed_v41_args,
                         ("sparse_indices", "sparse_topk_lens"), module=V41_CACHE_UTILS),
        notes="replay_start from the case (zeros where it has none: the V4 window); DSpark non-causal decode "
              "rows, vision and num_rows cases are skipped (a different contract, flashinfer_mixed_v41_args).",
    ),
]


# The releases each entry is written for (``KernelEntry.releases``, set by ``registry.assemble``), from the survey (``python -m
# dsv4_numerics.staging.survey``): ``deepseek_v41/`` from 0.30.0; the NVFP4 gather kernel from 0.31.0, the
# one-pass gather from 0.32.0; the combine / mixed-index builders take 0.33.0's arguments from 0.31.0.
# ``fused_save_compress_norm`` gains ``prev_rows`` / ``prev_row_indices`` in 0.33.0, which the adapter never
# passes (PCP not exercised).
RELEASE_RANGES = {
    "vllm_v41.quantize_and_insert_k_cache.mxfp8": "vllm>=0.30.0",
    "vllm_v41.rope_quant_insert.mxfp8": "vllm>=0.30.0",
    "vllm_v41.rope_quant_insert.nvfp4": "vllm>=0.30.0",
    "vllm_v41.fused_save_compress_norm.mxfp8": "vllm>=0.30.0",
    "vllm_v41.fused_save_compress_norm.nvfp4": "vllm>=0.30.0",
    "vllm_v41.fused_save_compress_norm.fp8_584": "vllm>=0.30.0",
    "vllm_v41.fused_save_compress_norm.plain": "vllm>=0.30.0",
    "vllm_v41.indexer_k_norm_rope_store.fp8": "vllm>=0.30.0",
    "vllm_v41.indexer_k_norm_rope_store.mxfp4": "vllm>=0.30.0",
    "vllm_v41.dequantize_and_gather_k_cache.mxfp8": "vllm>=0.30.0",
    "vllm_v41.dequantize_and_gather_k_cache.nvfp4": "vllm>=0.31.0",
    "vllm_v41.dequantize_and_gather_k_cache.two_pass": "vllm>=0.30.0",
    "vllm_v41.dequantize_and_gather_k_cache.one_pass": "vllm>=0.32.0",
    "vllm_v41.compute_global_topk_indices_and_lens": "vllm>=0.30.0",
    "vllm_v41.combine_topk_swa_indices": "vllm>=0.31.0",
    "vllm_v41.build_flashinfer_mixed_sparse_indices": "vllm>=0.31.0",
}
