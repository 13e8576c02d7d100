"""DeepSeek-V4.1 attention kernels as vLLM 0.33.0 ships and calls them: FlashMLA sparse decode over
the V4.1 records, the prefill path (V4.1 gather into the bf16 workspace, then FlashMLA prefill),
and the V4.1 query quantiser (Triton).

FlashMLA (``vllm.third_party.flashmla.flash_mla_interface``, staged with ``--parts flashmla``)
selects the record from the bytes per token, ``k_cache.shape[-1]``: 528 = V4.1 MXFP8 (FlashMLA
``ModelType::V41``), and an ``extra_k_cache`` of 288 = NVFP4 (``V41_FP4``, valid only next to a
528-byte ``k_cache``). There is no flag; the call is vLLM's V4.1 ``_forward_decode``
(``V:models/deepseek_v41/nvidia/flashmla.py``), the V4 call with the V4.1 caches: ``q.unsqueeze(1)``
(``b = T``, ``s_q = 1``), ``indices = swa_indices``, ``topk_length = swa_lens``, the compressed
cache as ``extra_k_cache`` with ``extra_indices_in_kvcache`` / ``extra_topk_length``,
``is_fp8_kvcache = True``, ``head_dim_v = 512``, ``softmax_scale``, ``attn_sink``. Byte order:
interleaved ("BREAKING CHANGE: the two V4.1 layouts are interleaved as of the 2026.09.30 upstream
release ... a cache written in the old layout is NOT rejected, it is misread"), so the entries
declare ``v41_layout=interleaved`` and refuse (``UnsupportedCase``) a case whose caches were
written page-footer: that pairing is a writer/reader disagreement (H13), which
``tests/attention/test_v41_attention.py`` checks fails by name, not a kernel property.

Which V4.1 paths a build runs is not documented for SM90 (vLLM 0.33.0 uses the V4.1 record only
on SM100, ``attention.py:130-138`` "FlashMLA decodes DeepSeek's V4.1 record ... only in its SM100
sparse-decode kernels"). So each path is its own entry, and its probe makes one tiny call of
that path on the GPU (64 heads, top-k 64, one token over a zeroed page) and turns the library's
refusal into the entry's ``unavailable`` reason, quoting it. A run prints one row per path: pass
(it ran) or unavailable with FlashMLA's own words.

    flashmla.v41_sparse_decode.{sm90,sm100}      MXFP8 main, no extra or an MXFP8 extra
    flashmla.v41_fp4_sparse_decode.{sm90,sm100}  MXFP8 main + NVFP4 extra (nvfp4_ds_mla)
    vllm_flashmla.v41_sparse_prefill.sm90/.sm100 vLLM V4.1 ``dequantize_and_gather_k_cache_triton``
        (extra region at offset 0, then the SWA region; one request, identity block table) into a
        bf16 workspace, then ``flashmla.sparse_prefill_call`` (the V4 prefill adapter) over it
    vllm_triton.v41_query_quant                   ``fused_q_kv_rmsnorm_quant`` (Triton, CUDA)

The V4.1 vLLM modules (``models/deepseek_v41/common/ops``) come from the ``v41`` staging part; a
machine without it lists those entries unavailable with the import error.
"""

from __future__ import annotations

import functools

import torch

from dsv4_numerics.reference.caches.v41 import cache_geometry
from dsv4_numerics.reference.cases import Case
from dsv4_numerics.reference.errors import UnsupportedCase
from dsv4_numerics.reference.policies import IndexRule, LseConvention, NanPolicy, V41Layout, V41Record

from dsv4_numerics.kernels.flashmla import sparse as F
from dsv4_numerics.kernels import probe as P
from dsv4_numerics.kernels.convert import (
    FLASHMLA_HEADS,
    aligned_pages,
    lengths_int32,
    lse_plus_inf_to_minus_inf,
    pad_heads,
    pad_topk,
    padded_heads,
    refuse_non_minus1,
)
from dsv4_numerics.kernels.registry import KernelEntry

CACHE_UTILS = "vllm.models.deepseek_v41.common.ops.cache_utils"
QUERY_QUANT = "vllm.models.deepseek_v41.common.ops.query_quant"
_SM100 = ("sm100", "sm103")


def _record(inp: dict, key: str) -> V41Record:
    return V41Record(inp.get(key, V41Record.MXFP8.value))


def _kernel_cache(cache: torch.Tensor, bs: int, record: V41Record) -> torch.Tensor:
    """``[nb, bs, 1, R]`` view of a V4.1 cache (interleaved: each token's R bytes contiguous),
    16-byte aligned pages (``convert.aligned_pages``)."""
    nb, _, p = cache_geometry("flashmla.v41", cache, bs, record)
    r = 528 if record is V41Record.MXFP8 else 288
    view = torch.as_strided(cache, (nb, bs, 1, r), (p, r, r, 1), cache.storage_offset())
    return aligned_pages(view)


def _require_interleaved(case: Case, who: str) -> None:
    written = case.inputs.get("v41_layout", V41Layout.INTERLEAVED.value)
    if written != V41Layout.INTERLEAVED.value:
        raise UnsupportedCase(f"{who} reads V4.1 records interleaved (FlashMLA 2026.09.30+); this case's caches "
                              f"were written v41_layout={written}: a writer/reader byte-order disagreement (H13)")


def _require_path(case: Case, fp4: bool, who: str) -> None:
    has_fp4 = "extra_cache" in case.inputs and _record(case.inputs, "extra_record") is V41Record.NVFP4
    if has_fp4 != fp4:
        other = "flashmla.v41_fp4_sparse_decode" if has_fp4 else "flashmla.v41_sparse_decode"
        raise UnsupportedCase(f"{who} runs the {'MXFP8 + NVFP4 extra' if fp4 else 'MXFP8'} path; this case is "
                              f"{'MXFP8 + NVFP4 extra' if has_fp4 else 'MXFP8 only'} ({other} runs it)")


def v41_decode_call(case: Case, fp4: bool = False) -> dict[str, torch.Tensor]:
    """Canonical ``v41_sparse_decode`` case -> ``{"out": bf16 [T,H,512], "lse": f32 [T,H]}``."""
    who = "flashmla.v41_fp4_sparse_decode" if fp4 else "flashmla.v41_sparse_decode"
    _require_path(case, fp4, who)
    _require_interleaved(case, who)
    inp = case.inputs
    q, sink = inp["q"], inp.get("sink")
    t, h = q.shape[0], q.shape[1]
    mbs = int(inp["swa_block_size"])
    main = _kernel_cache(inp["swa_cache"], mbs, V41Record.MXFP8)
    refuse_non_minus1(inp["swa_indices"], inp.get("swa_lens"), main.shape[0] * mbs, "FlashMLA decode", "SWA")
    if inp["swa_indices"].shape[1] == 0:
        raise UnsupportedCase("FlashMLA sparse decode needs a main segment with topk > 0")
    kw = {}
    if "extra_cache" in inp:
        ebs = int(inp["extra_block_size"])
        extra = _kernel_cache(inp["extra_cache"], ebs, _record(inp, "extra_record"))
        refuse_non_minus1(inp["extra_indices"], inp.get("extra_lens"), extra.shape[0] * ebs, "FlashMLA decode",
                          "compressed")
        kw = dict(extra_k_cache=extra,
                  extra_indices_in_kvcache=pad_topk(inp["extra_indices"], F.DECODE_TOPK_BLOCK).unsqueeze(1),
                  extra_topk_length=lengths_int32(inp.get("extra_lens"), t, who, "extra_lens"))
    hp = padded_heads(h, FLASHMLA_HEADS, "FlashMLA sparse decode")
    qp, sinkp = pad_heads(q, sink, hp)
    fm = F.flashmla_interface()
    sched, _ = fm.get_mla_metadata()
    out, lse = fm.flash_mla_with_kvcache(
        q=qp.unsqueeze(1), k_cache=main, block_table=None, cache_seqlens=None, head_dim_v=q.shape[-1],
        tile_scheduler_metadata=sched, softmax_scale=float(inp["scale"]), is_fp8_kvcache=True,
        indices=pad_topk(inp["swa_indices"], F.DECODE_TOPK_BLOCK).unsqueeze(1), attn_sink=sinkp,
        topk_length=lengths_int32(inp.get("swa_lens"), t, who, "swa_lens"), **kw)
    return {"out": out.reshape(t, hp, -1)[:, :h],
            "lse": lse_plus_inf_to_minus_inf(lse.transpose(1, 2).reshape(t, hp)[:, :h].float())}


def tiny_decode(fp4: bool) -> None:
    """One token, 64 heads, top-k 64 over one zeroed 64-entry page of the path's records (every
    index 0: valid, finite rows), on the current GPU. Raises whatever FlashMLA raises."""
    dev = torch.device("cuda")
    main = torch.zeros(1, 64 * 528, dtype=torch.uint8, device=dev)
    idx = torch.zeros(1, 64, dtype=torch.int32, device=dev)
    inputs = {"q": torch.zeros(1, 64, 512, dtype=torch.bfloat16, device=dev), "scale": 512**-0.5,
              "sink": None, "swa_cache": main, "swa_block_size": 64, "swa_indices": idx,
              "swa_lens": torch.full((1,), 64, dtype=torch.int32, device=dev)}
    if fp4:
        inputs.update(extra_cache=torch.zeros(1, 64 * 288, dtype=torch.uint8, device=dev), extra_block_size=64,
                      extra_record=V41Record.NVFP4.value, extra_indices=idx.clone(), extra_lens=inputs["swa_lens"])
    v41_decode_call(Case("probe", "v41_sparse_decode", inputs, {}), fp4=fp4)
    torch.cuda.synchronize()


@functools.lru_cache(maxsize=None)
def path_reason(fp4: bool) -> str | None:
    """None if the tiny call of the path runs; else ``FlashMLA V4.1 <path> not supported here: <error>``."""
    try:
        tiny_decode(fp4)
    except Exception as e:  # the library's refusal (TORCH_CHECK -> RuntimeError) is the reason
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        path = "MXFP8 528 B main + NVFP4 288 B extra (V41_FP4)" if fp4 else "MXFP8 528 B (V41)"
        return f"FlashMLA V4.1 {path} not supported here: {type(e).__name__}: {first[:300]}"
    return None


def _decode_probe(fp4: bool, *archs: str) -> P.Probe:
    return P.chain(F.flashmla_probe(*archs), lambda: path_reason(fp4))


# --------------------------------------------------------------------------- prefill


def _gather_into(out: torch.Tensor, cache: torch.Tensor, bs: int, record: V41Record, offset: int) -> int:
    """vLLM's V4.1 gather of every slot of ``cache`` (one request, identity block table) into
    ``out [1, S, 512]`` from row ``offset``; returns the number of slots."""
    from importlib import import_module

    cu = import_module(CACHE_UTILS)
    view = _kernel_cache(cache, bs, record)[:, :, 0]
    nb = view.shape[0]
    dev = out.device
    cu.dequantize_and_gather_k_cache_triton(
        out, view, torch.tensor([nb * bs], dtype=torch.int32, device=dev), None,
        torch.arange(nb, dtype=torch.int32, device=dev)[None], bs, offset)
    return nb * bs


def v41_prefill_call(case: Case) -> dict[str, torch.Tensor]:
    """Canonical ``v41_sparse_prefill`` case -> the outputs of ``flashmla.sparse_prefill_call`` over
    the workspace vLLM's V4.1 gather builds (module docstring)."""
    _require_interleaved(case, "vllm_flashmla.v41_sparse_prefill")
    inp = case.inputs
    dev = inp["q"].device
    n_extra = 0
    if "extra_cache" in inp:
        nb = cache_geometry("v41_prefill", inp["extra_cache"], int(inp["extra_block_size"]),
                            _record(inp, "extra_record"))[0]
        n_extra = nb * int(inp["extra_block_size"])
    n_main = cache_geometry("v41_prefill", inp["swa_cache"], int(inp["swa_block_size"]), V41Record.MXFP8)[0] \
        * int(inp["swa_block_size"])
    ws = torch.zeros(1, n_extra + n_main, 512, dtype=torch.bfloat16, device=dev)
    if n_extra:
        _gather_into(ws, inp["extra_cache"], int(inp["extra_block_size"]), _record(inp, "extra_record"), 0)
    _gather_into(ws, inp["swa_cache"], int(inp["swa_block_size"]), V41Record.MXFP8, n_extra)
    v4 = {"q": inp["q"], "kv": ws[0], "indices": inp["indices"], "scale": inp["scale"], "sink": inp.get("sink")}
    if inp.get("topk_length") is not None:
        v4["topk_length"] = inp["topk_length"]
    return F.sparse_prefill_call(Case(case.name, "prefill", v4, case.params))


# --------------------------------------------------------------------------- query quantiser


def v41_query_quant_call(case: Case) -> dict[str, torch.Tensor]:
    """Canonical ``v41_query_quant`` case -> ``{"q_codes": uint8 [T, Q], "q_scales": uint8 F8_128x4,
    "kv_normed": bf16 [T, KV]}`` via ``fused_q_kv_rmsnorm_quant``."""
    from importlib import import_module

    inp = case.inputs
    qa, kvo = import_module(QUERY_QUANT).fused_q_kv_rmsnorm_quant(
        inp["qr"], inp["kv"], inp["q_weight"], inp["kv_weight"], float(inp["eps"]))
    return {"q_codes": qa.data.view(torch.uint8), "q_scales": qa.scale, "kv_normed": kvo}


_DECODE_POLICIES = {"lse": LseConvention.NATURAL_SINKFREE.value, "nan": NanPolicy.PROPAGATE.value,
                    "index_rule": IndexRule.MINUS1_ONLY.value, "v41_layout": V41Layout.INTERLEAVED.value}
_PREFILL_POLICIES = dict(_DECODE_POLICIES, index_rule=IndexRule.ANY_OUT_OF_RANGE_INVALID.value)


def _decode_entry(arch: str, archs: tuple[str, ...], fp4: bool) -> KernelEntry:
    kind = "v41_fp4_sparse_decode" if fp4 else "v41_sparse_decode"
    return KernelEntry(
        name=f"flashmla.{kind}.{arch}", stage="v41_sparse_decode", family="CUDA",
        source=f"{F.INTERFACE}.flash_mla_with_kvcache (k_cache 528 B{' + extra_k_cache 288 B' if fp4 else ''})",
        archs=archs, dtypes=("bfloat16", "uint8"), policies=dict(_DECODE_POLICIES),
        tolerance_scope="flashmla.sparse_decode", probe=_decode_probe(fp4, *archs),
        call=functools.partial(v41_decode_call, fp4=fp4),
        notes=("MXFP8 main + NVFP4 extra (nvfp4_ds_mla)" if fp4 else "MXFP8 main, optional MXFP8 extra")
        + "; probe = one tiny call of this path, FlashMLA's refusal quoted")


def _prefill_entry(arch: str, archs: tuple[str, ...]) -> KernelEntry:
    return KernelEntry(
        name=f"vllm_flashmla.v41_sparse_prefill.{arch}", stage="v41_sparse_prefill", family="CUDA",
        source=f"{CACHE_UTILS}.dequantize_and_gather_k_cache_triton + {F.INTERFACE}.flash_mla_sparse_fwd",
        archs=archs, dtypes=("bfloat16", "uint8"), policies=dict(_PREFILL_POLICIES),
        tolerance_scope="flashmla.sparse_prefill",
        probe=P.chain(F.flashmla_probe(*archs), P.needs_staged_vllm(CACHE_UTILS), P.needs_import(CACHE_UTILS)),
        call=v41_prefill_call, notes="vLLM's V4.1 prefill: Triton gather into the bf16 workspace, FlashMLA prefill")


ENTRIES: list[KernelEntry] = [
    _decode_entry("sm90", ("sm90",), False),
    _decode_entry("sm90", ("sm90",), True),
    _decode_entry("sm100", _SM100, False),
    _decode_entry("sm100", _SM100, True),
    _prefill_entry("sm90", ("sm90",)),
    _prefill_entry("sm100", _SM100),
    KernelEntry(
        name="vllm_triton.v41_query_quant", stage="v41_query_quant", family="Triton",
        source=f"{QUERY_QUANT}.fused_q_kv_rmsnorm_quant (_q_kv_norm_quant_kernel)",
        archs=("sm90", "sm100", "sm103"), dtypes=("bfloat16", "float8_e4m3fn", "uint8"), policies={},
        tolerance_scope="vllm_triton.v41_query_quant",
        probe=P.chain(P.needs_arch("sm90", "sm100", "sm103"), P.needs_staged_vllm(QUERY_QUANT),
                      P.needs_import(QUERY_QUANT)),
        call=v41_query_quant_call, notes="bit-exact on exact-norm rows (reference.pipeline.query_quant)"),
]


# The releases each entry is written for (``KernelEntry.releases``, set by ``registry.assemble``), from the survey (``python -m
# dsv4_numerics.staging.survey``): the V4.1 cache writers these pack their caches with ship from 0.30.0;
# ``dequantize_and_gather_k_cache_triton`` takes ``max_gather_len`` from 0.32.0.
RELEASE_RANGES = {
    "flashmla.v41_sparse_decode.sm90": "vllm>=0.30.0",
    "flashmla.v41_fp4_sparse_decode.sm90": "vllm>=0.30.0",
    "flashmla.v41_sparse_decode.sm100": "vllm>=0.30.0",
    "flashmla.v41_fp4_sparse_decode.sm100": "vllm>=0.30.0",
    "vllm_flashmla.v41_sparse_prefill.sm90": "vllm>=0.32.0",
    "vllm_flashmla.v41_sparse_prefill.sm100": "vllm>=0.32.0",
    "vllm_triton.v41_query_quant": "vllm>=0.30.0",
}
