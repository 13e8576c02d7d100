"""Adapters for vLLM 0.33.0's DSv4 Triton ops (``vllm/models/deepseek_v4/common/ops/*.py``,
``vllm/v1/attention/backends/mla/sparse_swa.py``; spec README 5, datapath 2.2, 2.3, 3, 4.1,
4.4-4.6, 6).

The Triton files reach a GPU machine without a vLLM install through
``dsv4-numerics stage-vllm --wheel vllm-0.33.0-*.whl DIR`` and ``DSV4_STAGED=DIR`` (its stand-ins
describe an NVIDIA platform: OCP FP8, no PDL). Each adapter converts the canonical ``Case`` inputs exactly as vLLM's call sites
do (int32 index tensors, int64 slot mappings, contiguous rows, the caller-allocated output
buffers, a COPY of any cache a kernel writes in place) and returns canonical outputs.

Entries:

=========================================  ===================  ======================================
entry                                      stage                production function
=========================================  ===================  ======================================
vllm_triton.quantize_and_insert_k_cache    swa_write            ``cache_utils.quantize_and_insert_k_cache``
vllm_triton.quantize_and_insert_k_cache.fnuz  swa_write         same, ``use_fnuz=True`` (gfx942 flavour)
vllm_triton.dequantize_and_gather_k_cache  gather               ``cache_utils.dequantize_and_gather_k_cache``
vllm_triton.compute_global_topk_indices_and_lens  topk_global   ``cache_utils.compute_global_topk_indices_and_lens``
vllm_triton.combine_topk_swa_indices       combine_prefill      ``cache_utils.combine_topk_swa_indices``
vllm_triton.build_flashinfer_mixed_sparse_indices  flashinfer_mixed  ``cache_utils.build_flashinfer_mixed_sparse_indices``
vllm_triton.compute_swa_indices_and_lens   swa_indices          ``sparse_swa._COMPUTE_SWA_INDICES_AND_LENS_KERNEL``
vllm_triton.fused_inv_rope_fp8_quant.sm90  inv_rope_fp8         ``fused_inv_rope_fp8_quant`` (fp32 scales)
vllm_triton.fused_inv_rope_fp8_quant.sm100 inv_rope_fp8         same, packed UE8M0 int32 scales
vllm_triton.compress_norm_rope_store       compressor           ``fused_compress_quant_cache.compress_norm_rope_store_triton``
=========================================  ===================  ======================================

Index stages hold cases of several production builders (``case.params["builder"]``); an index
entry runs the cases of its own builder and raises ``UnsupportedCase`` (reported as a skip) for
the others.

``sparse_swa.py`` imports the engine's metadata builders: ``stage-vllm --parts engine`` stages it
with placeholder stand-ins for those engine names (they raise if an engine path is used), so its
entry runs from the staged folder too. The ``use_fnuz=True`` writer
needs Triton's ``fp8e4b8``, which Triton 3.6 offers only on AMD targets: its probe says so on
NVIDIA. Page strides a kernel would fault on (odd, for the bf16 lanes) are repacked for the call
and copied back (``convert.writable_pages``/``readable_pages``); vLLM's strides never are.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from typing import Any, Callable

import torch

from dsv4_numerics.reference.cases import Case
from dsv4_numerics.reference.constants import FNUZ_GFX942_CLAMP, HEAD_DIM
from dsv4_numerics.reference.errors import INDEX_DTYPES, UnsupportedCase, check_dtype, check_int, check_rank, fail
from dsv4_numerics.reference.policies import Fp8Flavour, NonFinite, RopeArithmetic, ScaleRule, SlotSkip, Ue8m0Consumer

from dsv4_numerics.kernels.probe import chain, needs_arch, needs_import, needs_module, needs_staged_vllm
from dsv4_numerics.kernels.registry import KernelEntry
from dsv4_numerics.kernels.convert import TRITON_PAGE_ALIGN, page_geometry, readable_pages, writable_pages

__all__ = [
    "ENTRIES",
    "CACHE_UTILS",
    "SPARSE_SWA",
    "staged_triton_probe",
    "triton_fp8_dtype_reason",
    "fnuz_platform",
    "int32",
    "bool_flags",
    "index_case_builder",
    "quantize_insert_args",
    "gather_args",
    "topk_global_args",
    "combine_args",
    "flashinfer_mixed_args",
    "swa_indices_args",
    "inv_rope_fp8_args",
    "compressor_args",
    "scales_to_exponents",
]

CACHE_UTILS = "vllm.models.deepseek_v4.common.ops.cache_utils"
SPARSE_SWA = "vllm.v1.attention.backends.mla.sparse_swa"
INV_ROPE = "vllm.models.deepseek_v4.common.ops.fused_inv_rope_fp8_quant"
COMPRESS = "vllm.models.deepseek_v4.common.ops.fused_compress_quant_cache"


# --------------------------------------------------------------------------- probes


def staged_triton_probe(module: str) -> Callable[[], str | None]:
    """Probe: Triton importable, a GPU, the vLLM file ``module`` findable (installed, or staged
    by ``dsv4-numerics stage-vllm`` and named by ``DSV4_STAGED``; the reason names the part to
    stage), and importable (the last step imports it, with the staged stand-ins)."""
    return chain(needs_module("triton"), needs_arch("any-gpu"), needs_staged_vllm(module),
                 needs_import(module))


@functools.lru_cache(maxsize=None)
def triton_fp8_dtype_reason(name: str) -> str | None:
    """``None`` if Triton's backend for GPU 0 lists the FP8 type ``name`` (e.g. ``"fp8e4b8"``,
    Triton's name for E4M3FNUZ) among its supported FP8 dtypes; else why not. Queried from the
    backend's parsed default options, without compiling anything."""
    try:
        import triton
        from triton.compiler.compiler import make_backend

        target = triton.runtime.driver.active.get_current_target()
        opts = make_backend(target).parse_options({})
        supported = tuple(getattr(opts, "supported_fp8_dtypes", ()))
    except Exception as e:  # noqa: BLE001 - any failure is a reason, never a crash
        return f"could not query Triton's supported FP8 types ({type(e).__name__}: {e})"
    if name in supported:
        return None
    return (f"Triton {triton.__version__} on {target.backend} {target.arch} does not support {name} "
            f"(supported: {', '.join(supported)})")


def triton_fn(module: str, name: str):
    return getattr(importlib.import_module(module), name)


# --------------------------------------------------------------------------- conversions


def int32(fn: str, arg: str, t: torch.Tensor | None) -> torch.Tensor | None:
    """An int32/int64 index tensor as contiguous int32 (vLLM's index buffers are int32); values
    outside the int32 range raise InputError (the conversion would wrap). ``None`` stays None."""
    if t is None:
        return None
    check_dtype(fn, arg, t, INDEX_DTYPES)
    if t.dtype == torch.int64 and t.numel():
        lo, hi = int(t.min()), int(t.max())
        if lo < -(2**31) or hi > 2**31 - 1:
            fail(fn, arg, "must fit in int32 (the production buffers are int32)", (lo, hi))
    return t.to(torch.int32).contiguous()


def bool_flags(fn: str, arg: str, t: torch.Tensor | None) -> torch.Tensor | None:
    """A per-token flag tensor as contiguous bool (``is_valid_token = slot_mapping >= 0`` is bool
    in vLLM, ``sparse_swa.py:624-625``). Integer tensors must hold only 0/1."""
    if t is None:
        return None
    check_dtype(fn, arg, t, (torch.bool,) + INDEX_DTYPES)
    if t.dtype != torch.bool:
        if t.numel() and bool(((t != 0) & (t != 1)).any()):
            fail(fn, arg, "must hold only 0 and 1")
        t = t != 0
    return t.contiguous()


def index_case_builder(case: Case, builder: str) -> None:
    """Raise ``UnsupportedCase`` unless ``case`` was built for the production function
    ``builder`` (``case.params["builder"]``, reference/cases/index.py)."""
    got = case.params.get("builder")
    if got != builder:
        raise UnsupportedCase(f"case {case.name!r} exercises {got!r}; this entry runs {builder!r}")


def quantize_insert_args(inputs: dict, use_fnuz: bool = False) -> dict:
    """Canonical ``swa_write`` inputs -> ``quantize_and_insert_k_cache`` arguments, as the XPU
    call site passes them (``V:models/deepseek_v4/xpu/xpu_qnorm_rope_kv_fp8_insert.py:154-161``):
    ``k`` contiguous bf16 ``[N, 512]``, the 2-D cache view ``[num_blocks, page_stride]`` of a
    COPY (``writable_pages`` with ``TRITON_PAGE_ALIGN``: an odd page stride would misalign the
    bf16 RoPE stores), ``slot_mapping`` int64, ``block_size``; ``_finish()`` returns the written
    copy in the input's form.

    The kernel skips only ``slot == -1`` and writes any other negative slot out of bounds
    (``cache_utils.py:81-84``): such a case raises ``UnsupportedCase`` here, before any launch
    (the reference raises InputError for it under ``slot_skip = minus1_only``). Slots beyond the
    cache raise InputError for the same reason.
    """
    fn = "quantize_insert_args"
    k = inputs["k"]
    check_dtype(fn, "k", k, (torch.bfloat16,))
    check_rank(fn, "k", k, 2)
    if k.shape[1] != HEAD_DIM:
        fail(fn, "k", f"must have shape [N, {HEAD_DIM}]", tuple(k.shape))
    bs = check_int(fn, "block_size", inputs["block_size"], minimum=1)
    cache = inputs["cache"]
    nb, _ = page_geometry(fn, cache, bs)
    slots = inputs["slot_mapping"]
    check_dtype(fn, "slot_mapping", slots, INDEX_DTYPES)
    check_rank(fn, "slot_mapping", slots, 1)
    if slots.shape[0] > k.shape[0]:
        fail(fn, "slot_mapping", f"must not be longer than k (N = {k.shape[0]})", slots.shape[0])
    if slots.numel():
        if bool(((slots < 0) & (slots != -1)).any()):
            raise UnsupportedCase("slot_mapping holds negative slots other than -1: "
                                  "quantize_and_insert_k_cache would write them out of bounds "
                                  "(cache_utils.py:81-84)")
        if int(slots.max()) >= nb * bs:
            fail(fn, "slot_mapping", f"must be < num_blocks*block_size = {nb * bs}", int(slots.max()))
    pages, finish = writable_pages(cache, bs, TRITON_PAGE_ALIGN)
    return dict(k=k.contiguous(), k_cache=pages, slot_mapping=slots.to(torch.int64).contiguous(),
                block_size=bs, is_ue8m0=True, use_fnuz=use_fnuz, _finish=finish)


def gather_args(inputs: dict) -> dict:
    """Canonical ``gather`` inputs -> ``dequantize_and_gather_k_cache`` arguments.

    The call sites (``V:models/deepseek_v4/nvidia/flashmla.py:329-349``, ``amd/rocm.py:1660-1686``)
    pass a caller-allocated bf16 workspace ``out [R, M, 512]``, the layer's cache (the
    ``[nb, bs, 584]`` kernel view), int32 ``seq_lens``/``gather_lens`` (or None)/``block_table``,
    ``block_size`` and ``offset``. Here ``M = offset + max(gather_lens)`` (the reference's width)
    and ``out`` is zero-initialised: rows the kernel does not write stay 0, the convention of
    ``reference.caches.model1.gather``, so the whole tensor is comparable.
    The cache is read-only for this kernel: the case's bytes are passed as the kernel view
    (``readable_pages``: repacked only if the stride is odd, which would misalign the bf16 loads).
    """
    fn = "gather_args"
    bs = check_int(fn, "block_size", inputs["block_size"], minimum=1)
    cache = inputs["cache"]
    page_geometry(fn, cache, bs)
    seq = int32(fn, "seq_lens", inputs["seq_lens"])
    gl = int32(fn, "gather_lens", inputs.get("gather_lens"))
    bt = int32(fn, "block_table", inputs["block_table"])
    check_rank(fn, "block_table", bt, 2)
    offset = check_int(fn, "offset", inputs.get("offset", 0), minimum=0)
    r = bt.shape[0]
    if seq.dim() != 1 or seq.shape[0] != r:
        fail(fn, "seq_lens", f"must have shape [{r}] (one per block_table row)", tuple(seq.shape))
    g = seq if gl is None else gl
    if gl is not None and (gl.dim() != 1 or gl.shape[0] != r):
        fail(fn, "gather_lens", f"must have shape [{r}]", tuple(gl.shape))
    width = offset + (int(g.max()) if r else 0)
    out = torch.zeros((r, width, HEAD_DIM), dtype=torch.bfloat16, device=cache.device)
    return dict(out=out, k_cache=readable_pages(cache, bs, TRITON_PAGE_ALIGN), seq_lens=seq,
                gather_lens=gl, block_table=bt, block_size=bs, offset=offset)


def topk_global_args(inputs: dict) -> dict:
    """``compute_global_topk_indices_and_lens`` inputs with vLLM's dtypes: int32 ``topk_indices``
    (the indexer's buffer), ``token_to_req_indices`` and ``block_table``; bool ``is_valid_token``
    (``slot_mapping >= 0``); ``block_size`` = compressed entries per page."""
    fn = "topk_global_args"
    return dict(
        topk_indices=int32(fn, "topk_indices", inputs["topk_indices"]),
        token_to_req_indices=int32(fn, "token_to_req_indices", inputs["token_to_req_indices"]),
        block_table=int32(fn, "block_table", inputs["block_table"]),
        block_size=check_int(fn, "block_size", inputs["block_size"], minimum=1),
        is_valid_token=bool_flags(fn, "is_valid_token", inputs["is_valid_token"]),
    )


def combine_args(inputs: dict) -> dict:
    """``combine_topk_swa_indices`` inputs with vLLM's dtypes (``flashmla.py:361-373``): int32
    ``topk_indices``, ``query_start_loc`` (global, possibly non-zero base), ``seq_lens``,
    ``gather_lens``; ints ``window_size``, ``compress_ratio``, ``topk``, ``M``, ``N``; the
    optional vision arguments passed through."""
    fn = "combine_args"
    out = dict(
        topk_indices=int32(fn, "topk_indices", inputs["topk_indices"]),
        query_start_loc=int32(fn, "query_start_loc", inputs["query_start_loc"]),
        seq_lens=int32(fn, "seq_lens", inputs["seq_lens"]),
        gather_lens=int32(fn, "gather_lens", inputs["gather_lens"]),
    )
    for k in ("window_size", "compress_ratio", "topk", "M", "N"):
        out[k] = check_int(fn, k, inputs[k], minimum=0)
    for k in ("left_visible", "right_visible"):
        if inputs.get(k) is not None:
            out[k] = int32(fn, k, inputs[k])
    if inputs.get("max_image_tokens"):
        out["max_image_tokens"] = check_int(fn, "max_image_tokens", inputs["max_image_tokens"], minimum=0)
    return out


_FI_INT32 = ("decode_swa_indices", "decode_compressed_indices", "decode_compressed_topk_lens",
             "prefill_topk_indices", "query_start_loc", "seq_lens", "token_to_req_indices",
             "swa_block_table", "compressed_block_table", "prefill_left_visible",
             "prefill_right_visible")
_FI_INTS = ("swa_block_size", "compressed_block_size", "window_size", "compress_ratio", "topk",
            "swa_block_span", "compressed_block_span", "max_image_tokens", "num_rows")


def flashinfer_mixed_args(inputs: dict) -> dict:
    """``build_flashinfer_mixed_sparse_indices`` inputs: every index tensor int32 (the wrapper
    asserts it, ``cache_utils.py:1131-1170``), ``decode_is_valid_token`` bool, ints as given."""
    fn = "flashinfer_mixed_args"
    out: dict[str, Any] = {}
    rs = inputs.get("replay_start")
    if rs is not None and bool((torch.as_tensor(rs) != 0).any()):
        raise UnsupportedCase("the V4 build_flashinfer_mixed_sparse_indices has no replay_start (DeepSeek-V4.1 "
                              "SWA bounded replay)")
    for k, v in inputs.items():
        if k == "replay_start":
            continue
        if k in _FI_INT32:
            out[k] = int32(fn, k, v)
        elif k == "decode_is_valid_token":
            out[k] = bool_flags(fn, k, v)
        elif k in _FI_INTS:
            out[k] = None if v is None else check_int(fn, k, v, minimum=0)
        elif k == "decode_compressed_indices_are_local":
            if not isinstance(v, bool):
                fail(fn, k, "must be a bool", type(v).__name__)
            out[k] = v
        else:
            fail(fn, k, "is not an argument of build_flashinfer_mixed_sparse_indices")
    return out


def swa_indices_args(inputs: dict) -> dict:
    """``compute_swa_indices_and_lens`` case inputs -> the arguments of
    ``ComputeSWAIndicesAndLensKernel.__call__`` as the metadata builder passes them
    (``sparse_swa.py:668-733``): caller-allocated int32 ``swa_indices [num_tokens, index_width]``
    (prefilled with -2, a value the kernel never writes, so a missed column shows) and
    ``swa_lens [num_tokens]``; int32 ``query_start_loc``, ``seq_lens``, ``token_to_req_indices``,
    ``block_table``, ``replay_start`` (zeros when absent: DSv4 has no replay); bool
    ``is_valid_token``; without image spans the visibility pointers are ``swa_lens`` (unused)."""
    fn = "swa_indices_args"
    valid = bool_flags(fn, "is_valid_token", inputs["is_valid_token"])
    offset = check_int(fn, "token_offset", inputs.get("token_offset", 0), minimum=0)
    n = inputs.get("num_tokens")
    n = valid.shape[0] - offset if n is None else check_int(fn, "num_tokens", n, minimum=0)
    w = check_int(fn, "window_size", inputs.get("window_size", 128), minimum=1)
    width = inputs.get("index_width")
    width = w if width is None else check_int(fn, "index_width", width, minimum=1)
    seq = int32(fn, "seq_lens", inputs["seq_lens"])
    replay = inputs.get("replay_start")
    replay = torch.zeros_like(seq) if replay is None else int32(fn, "replay_start", replay)
    dev = valid.device
    lens = torch.empty(n, dtype=torch.int32, device=dev)
    has_image = inputs.get("left_visible") is not None
    return dict(
        swa_indices=torch.full((n, width), -2, dtype=torch.int32, device=dev),
        swa_lens=lens,
        window_size=w,
        index_width=width,
        left_visible=int32(fn, "left_visible", inputs["left_visible"]) if has_image else lens,
        right_visible=int32(fn, "right_visible", inputs["right_visible"]) if has_image else lens,
        query_start_loc=int32(fn, "query_start_loc", inputs["query_start_loc"]),
        seq_lens=seq,
        token_to_req_indices=int32(fn, "token_to_req_indices", inputs["token_to_req_indices"]),
        is_valid_token=valid,
        block_table=int32(fn, "block_table", inputs["block_table"]),
        block_size=check_int(fn, "block_size", inputs["block_size"], minimum=1),
        replay_start=replay,
        num_tokens=n,
        token_offset=offset,
        has_image=has_image,
    )


def inv_rope_fp8_args(inputs: dict, tma_aligned_scales: bool) -> dict:
    """Canonical ``inv_rope_fp8`` inputs -> ``fused_inv_rope_fp8_quant`` arguments as the o_proj
    path calls it (``V:models/deepseek_v4/nvidia/ops/o_proj.py``; attention 3.3): contiguous bf16
    ``o [T, H, 512]``, int64 ``positions [T]``, fp32 ``cos_sin_cache [max_pos, 64]``,
    ``n_groups = H / heads_per_group``, ``heads_per_group``, the DSv4 split 448/64, 128-wide
    groups, ``tma_aligned_scales`` (False: SM90 fp32 scales, True: SM100 packed UE8M0 int32)."""
    fn = "inv_rope_fp8_args"
    o = inputs["o"]
    check_dtype(fn, "o", o, (torch.bfloat16,))
    if o.dim() != 3 or o.shape[2] != HEAD_DIM:
        fail(fn, "o", f"must have shape [T, H, {HEAD_DIM}]", tuple(o.shape))
    hpg = check_int(fn, "heads_per_group", inputs["heads_per_group"], minimum=1)
    if o.shape[1] % hpg:
        fail(fn, "heads_per_group", f"must divide the head count H={o.shape[1]}", hpg)
    pos = inputs["positions"]
    check_dtype(fn, "positions", pos, INDEX_DTYPES)
    if tuple(pos.shape) != (o.shape[0],):
        fail(fn, "positions", f"must have shape [T={o.shape[0]}]", tuple(pos.shape))
    cs = inputs["cos_sin"]
    check_dtype(fn, "cos_sin", cs, (torch.float32,))
    if cs.dim() != 2 or cs.shape[1] != 64:
        fail(fn, "cos_sin", "must be fp32 [max_pos, 64] = [cos(32) | sin(32)]", tuple(cs.shape))
    if pos.numel() and (int(pos.min()) < 0 or int(pos.max()) >= cs.shape[0]):
        fail(fn, "positions", f"must index rows of cos_sin [0, {cs.shape[0]})")
    return dict(o=o.contiguous(), positions=pos.to(torch.int64).contiguous(), cos_sin_cache=cs.contiguous(),
                n_groups=o.shape[1] // hpg, heads_per_group=hpg, nope_dim=448, rope_dim=64,
                quant_group_size=128, tma_aligned_scales=tma_aligned_scales, quantize=True)


def scales_to_exponents(scales: torch.Tensor, heads_per_group: int) -> torch.Tensor:
    """vLLM's output scales ``[T, G, inner]`` -> exponents int32 ``[T, H, 4]`` (``e`` with scale
    ``2**e``, UE8M0 byte ``e + 127``), the canonical form of ``oracles.stages`` ``inv_rope_fp8``.

    fp32 (SM90, ``inner = 4*hpg``, index ``head_in_group*4 + group``): ``e = (bits >> 23) - 127``,
    exact for the normal powers of two the kernel writes (``eps = 1e-10`` keeps ``e >= -42``).
    int32 (SM100, ``inner = hpg``): byte ``i`` (little end first) of a head's word is its group-``i``
    UE8M0 byte (``fused_inv_rope_fp8_quant.py:174-198``)."""
    fn = "scales_to_exponents"
    check_dtype(fn, "scales", scales, (torch.float32, torch.int32))
    check_int(fn, "heads_per_group", heads_per_group, minimum=1)
    T, G = scales.shape[0], scales.shape[1]
    if scales.dtype == torch.float32:
        if scales.shape[2] != 4 * heads_per_group:
            fail(fn, "scales", f"fp32 scales must be [T, G, {4 * heads_per_group}]", tuple(scales.shape))
        bits = scales.contiguous().view(torch.int32).to(torch.int64)
        e = ((bits >> 23) & 0xFF) - 127
        return e.reshape(T, G * heads_per_group, 4).to(torch.int32)
    if scales.shape[2] != heads_per_group:
        fail(fn, "scales", f"packed int32 scales must be [T, G, {heads_per_group}]", tuple(scales.shape))
    w = scales.contiguous().to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(4, device=w.device, dtype=torch.int64) * 8
    b = (w.unsqueeze(-1) >> shifts) & 0xFF  # [T, G, hpg, 4]
    return (b - 127).reshape(T, G * heads_per_group, 4).to(torch.int32)


def compressor_args(inputs: dict) -> dict:
    """Canonical ``compressor`` inputs -> ``compress_norm_rope_store_triton`` arguments, as
    ``DeepseekCompressor._compress_norm_rope_store`` passes them (``V:models/deepseek_v4/
    compressor.py:429-523``; kernel ``fused_compress_quant_cache.py:151-339``).

    Canonical inputs (production names; the compressor stage's case contract):
      ``state_cache``  fp32 ``[num_state_blocks, state_block_size, 2*coff*512]`` paged state
                       (row ``[kv (coff*512) | score+ape (coff*512)]``, datapath 1.4, 5.1 step 2)
      ``block_size``   state entries per page (4 for C4, 8 for C128 in vLLM)
      ``block_table``  int ``[R, B]`` state pages per request
      ``token_to_req_indices`` int ``[T]``, ``positions`` int ``[T]``, ``slot_mapping`` int
                       ``[T]`` (the tokens' state slots: ``< 0`` = padding, skipped)
      ``compressed_slot_mapping`` int ``[T]`` (``k_cache_metadata.slot_mapping``, datapath 4.8)
      ``cache``, ``kv_block_size``: the 584-byte compressed cache (canonical form) and its
                       entries per page
      ``cos_sin_cache`` fp32 ``[max_pos, 64]``; ``rms_norm_weight`` bf16 ``[512]``;
      ``rms_norm_eps`` float; ``compress_ratio`` 4 (overlap window 8) or 128.
    The kernel writes entry ``p // ratio`` for boundary tokens (``(p+1) % ratio == 0``, both
    slots ``>= 0``) reading the window ``p - W + 1 .. p`` of its request through the block table:
    a table too narrow for that window, or a compressed slot outside the cache, raises
    InputError before the launch (production would read / write out of bounds).
    """
    from types import SimpleNamespace

    fn = "compressor_args"
    ratio = inputs["compress_ratio"]
    if ratio not in (4, 128) or isinstance(ratio, bool):
        fail(fn, "compress_ratio", "must be 4 (C4, overlapping window 8) or 128", ratio)
    coff = 2 if ratio == 4 else 1
    state = inputs["state_cache"]
    check_dtype(fn, "state_cache", state, (torch.float32,))
    if state.dim() != 3 or state.shape[2] != 2 * coff * HEAD_DIM or state.stride(2) != 1:
        fail(fn, "state_cache", f"must be fp32 [blocks, block_size, {2 * coff * HEAD_DIM}] with unit last "
             "stride", f"shape {tuple(state.shape)} strides {state.stride()}")
    sbs = check_int(fn, "block_size", inputs["block_size"], minimum=1)
    if state.shape[1] != sbs:
        fail(fn, "state_cache", f"must hold block_size={sbs} entries per page", tuple(state.shape))
    pos = inputs["positions"]
    check_dtype(fn, "positions", pos, INDEX_DTYPES)
    t = pos.shape[0]
    slots = inputs["slot_mapping"]
    cslots = inputs["compressed_slot_mapping"]
    req = int32(fn, "token_to_req_indices", inputs["token_to_req_indices"])
    bt = int32(fn, "block_table", inputs["block_table"])
    check_rank(fn, "block_table", bt, 2)
    for name, v in (("slot_mapping", slots), ("compressed_slot_mapping", cslots), ("token_to_req_indices", req)):
        check_dtype(fn, name, v, INDEX_DTYPES)
        if tuple(v.shape) != (t,):
            fail(fn, name, f"must have shape [T={t}] (one per token)", tuple(v.shape))
    bs_c = check_int(fn, "kv_block_size", inputs["kv_block_size"], minimum=1)
    nb_c, _ = page_geometry(fn, inputs["cache"], bs_c)
    p64, s64, c64 = pos.to(torch.int64), slots.to(torch.int64), cslots.to(torch.int64)
    fires = (s64 >= 0) & ((p64 + 1) % ratio == 0) & (c64 >= 0)
    if bool(fires.any()):
        if int(c64[fires].max()) >= nb_c * bs_c:
            fail(fn, "compressed_slot_mapping", f"must be < num_blocks*kv_block_size = {nb_c * bs_c}",
                 int(c64[fires].max()))
        need = p64[fires] // sbs + 1
        if int(need.max()) > bt.shape[1] or int(req[fires].max()) >= bt.shape[0]:
            fail(fn, "block_table", "must cover every boundary token's window (the kernel reads "
                 "block_table[req, p // block_size] for the window rows)", tuple(bt.shape))
        pages = bt.to(torch.int64)[req[fires].to(torch.int64)]
        if bool((pages.gather(1, (need - 1).unsqueeze(1)) >= state.shape[0]).any()):
            fail(fn, "block_table", f"state pages must be < {state.shape[0]}")
    cs = inputs["cos_sin_cache"]
    check_dtype(fn, "cos_sin_cache", cs, (torch.float32,))
    if cs.dim() != 2 or cs.shape[1] != 64:
        fail(fn, "cos_sin_cache", "must be fp32 [max_pos, 64]", tuple(cs.shape))
    w = inputs["rms_norm_weight"]
    check_dtype(fn, "rms_norm_weight", w, (torch.bfloat16,))
    if tuple(w.shape) != (HEAD_DIM,):
        fail(fn, "rms_norm_weight", f"must have shape [{HEAD_DIM}]", tuple(w.shape))
    eps = inputs["rms_norm_eps"]
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
        fail(fn, "rms_norm_eps", "must be a number > 0", eps)
    pages, finish = writable_pages(inputs["cache"], bs_c, TRITON_PAGE_ALIGN)
    kv3 = torch.as_strided(pages, (pages.shape[0], bs_c, 584), (pages.stride(0), 584, 1))
    # compressor.py:384-388: PDL off on CUDA (launch_pdl=False), no kwarg on ROCm / XPU
    pdl = {} if torch.version.hip is not None else {"launch_pdl": False}
    return dict(state_cache=state, num_actual=t, token_to_req_indices=req, positions=p64.contiguous(),
                slot_mapping=s64.contiguous(), block_table=bt, block_size=sbs, state_width=coff * HEAD_DIM,
                cos_sin_cache=cs.contiguous(), kv_cache=kv3,
                k_cache_metadata=SimpleNamespace(slot_mapping=c64.contiguous()), pdl_kwargs=pdl,
                head_dim=HEAD_DIM, rope_head_dim=64, compress_ratio=ratio, overlap=ratio == 4,
                use_fp4_cache=False, rms_norm_weight=w.contiguous(), rms_norm_eps=float(eps), quant_block=64,
                token_stride=576, scale_dim=8, _finish=finish)


# --------------------------------------------------------------------------- calls


@contextlib.contextmanager
def fnuz_platform(platform: Any):
    """Make ``platform.is_fp8_fnuz()`` answer True for the duration, as vLLM's platform does on
    gfx942: ``quantize_and_insert_k_cache(use_fnuz=True)`` refuses otherwise and takes its clamp
    (224) from ``get_fp8_min_max()`` of that platform (``cache_utils.py:204-209``,
    ``quantization/utils/quant_utils.py:99-107``). ``platform`` is
    ``vllm.platforms.current_platform``; the kernel code itself is untouched. The previous state
    (an instance attribute or none) is restored on exit, also after an exception."""
    own = vars(platform)
    had = "is_fp8_fnuz" in own
    old = own.get("is_fp8_fnuz")
    platform.is_fp8_fnuz = lambda: True
    try:
        yield
    finally:
        if had:
            platform.is_fp8_fnuz = old
        else:
            del platform.is_fp8_fnuz


def _call_qins(use_fnuz: bool):
    def call(case: Case) -> dict:
        a = quantize_insert_args(case.inputs, use_fnuz)
        finish = a.pop("_finish")
        f = triton_fn(CACHE_UTILS, "quantize_and_insert_k_cache")
        if use_fnuz:
            from vllm.platforms import current_platform

            with fnuz_platform(current_platform):
                f(**a)
        else:
            f(**a)
        return {"cache": finish()}

    return call


def _call_gather(case: Case) -> dict:
    # The wrapper dispatches to the CuTe-DSL gather when CuTe is importable (a full vLLM install
    # on NVIDIA); its Triton branch is this one call (cache_utils.py:540-547), made directly so
    # the entry always runs the Triton kernel.
    a = gather_args(case.inputs)
    kernel = triton_fn(CACHE_UTILS, "_DEQUANTIZE_AND_GATHER_K_CACHE_KERNEL")
    kernel(a["out"], a["k_cache"], a["seq_lens"], a["gather_lens"], a["block_table"], a["block_size"],
           a["offset"], use_fnuz=False)
    return {"out": a["out"]}


def call_index(builder: str, args: Callable[[dict], dict], names: tuple[str, ...], module: str = CACHE_UTILS):
    def call(case: Case) -> dict:
        index_case_builder(case, builder)
        res = triton_fn(module, builder)(**args(case.inputs))
        return dict(zip(names, res))

    return call


def _call_swa_indices(case: Case) -> dict:
    index_case_builder(case, "compute_swa_indices_and_lens")
    a = swa_indices_args(case.inputs)
    k = triton_fn(SPARSE_SWA, "_COMPUTE_SWA_INDICES_AND_LENS_KERNEL")
    k(a["swa_indices"], a["swa_lens"], a["window_size"], a["index_width"], a["left_visible"],
      a["right_visible"], a["query_start_loc"], a["seq_lens"], a["token_to_req_indices"],
      a["is_valid_token"], a["block_table"], a["block_size"], a["replay_start"],
      num_tokens=a["num_tokens"], token_offset=a["token_offset"], has_image=a["has_image"])
    return {"swa_indices": a["swa_indices"], "swa_lens": a["swa_lens"]}


def _call_compressor(case: Case) -> dict:
    a = compressor_args(case.inputs)
    finish = a.pop("_finish")
    triton_fn(COMPRESS, "compress_norm_rope_store_triton")(**a)
    return {"cache": finish()}


def _call_inv_rope(tma_aligned_scales: bool):
    def call(case: Case) -> dict:
        a = inv_rope_fp8_args(case.inputs, tma_aligned_scales)
        out, scales = triton_fn(INV_ROPE, "fused_inv_rope_fp8_quant")(**a)
        return {"codes": out.view(torch.uint8), "exponents": scales_to_exponents(scales, a["heads_per_group"])}

    return call


_sparse_swa_probe = staged_triton_probe(SPARSE_SWA)  # stage-vllm --parts engine


# --------------------------------------------------------------------------- entries

_TRITON_ARCHS = ("gfx942", "gfx950", "any-gpu")
_QINS_POLICIES = {
    "scale_rule": ScaleRule.AMAX_CLAMP.value,
    "nonfinite": NonFinite.TRITON.value,
    "slot_skip": SlotSkip.MINUS1_ONLY.value,
}
_probe_cache_utils = staged_triton_probe(CACHE_UTILS)

ENTRIES: list[KernelEntry] = [
    KernelEntry(
        name="vllm_triton.quantize_and_insert_k_cache",
        stage="swa_write",
        family="Triton",
        source=f"{CACHE_UTILS}.quantize_and_insert_k_cache",
        archs=_TRITON_ARCHS,
        dtypes=("bfloat16",),
        policies={**_QINS_POLICIES, "fp8": Fp8Flavour.E4M3FN.value},
        tolerance_scope="vllm_triton.quantize_and_insert_k_cache",
        probe=_probe_cache_utils,
        call=_call_qins(False),
        notes="XPU SWA writer and vLLM's test oracle (datapath 2.2). RoPE bytes copied verbatim. "
              "Cases with negative slots other than -1 are skipped: the kernel would write them out "
              "of bounds.",
    ),
    KernelEntry(
        name="vllm_triton.quantize_and_insert_k_cache.fnuz",
        stage="swa_write",
        family="Triton",
        source=f"{CACHE_UTILS}.quantize_and_insert_k_cache(use_fnuz=True)",
        # gfx942 only: the only producer of FNUZ SWA caches; NVIDIA Triton builds have no
        # float8e4b8 (Triton 3.6 on sm90), so `--require-available` must not demand it there
        archs=("gfx942",),
        dtypes=("bfloat16",),
        policies={**_QINS_POLICIES, "fp8": Fp8Flavour.E4M3FNUZ.value, "fp8_clamp": str(FNUZ_GFX942_CLAMP),
                  "arch_specific": "true"},
        tolerance_scope="vllm_triton.quantize_and_insert_k_cache.fnuz",
        probe=chain(_probe_cache_utils, lambda: triton_fp8_dtype_reason("fp8e4b8")),
        call=_call_qins(True),
        notes="gfx942 flavour: tl.float8e4b8 codes with clamp 224 (datapath 2.1/2.2, H8). Runs "
              "with current_platform.is_fp8_fnuz() forced True for the call (the wrapper's "
              "guard). Off gfx942 the result is ARCHITECTURE-SPECIFIC: it shows how this Triton "
              "build lowers float8e4b8 on this GPU, not what gfx942 writes.",
    ),
    KernelEntry(
        name="vllm_triton.dequantize_and_gather_k_cache",
        stage="gather",
        family="Triton",
        source=f"{CACHE_UTILS}._DEQUANTIZE_AND_GATHER_K_CACHE_KERNEL (the Triton branch of dequantize_and_gather_k_cache)",
        archs=_TRITON_ARCHS,
        dtypes=("uint8",),
        policies={"fp8": Fp8Flavour.E4M3FN.value, "ue8m0": Ue8m0Consumer.TRITON.value},
        tolerance_scope="vllm_triton.dequantize_and_gather_k_cache",
        probe=_probe_cache_utils,
        call=_call_gather,
        notes="Triton path: the kernel is called directly, so the wrapper's CuTe-DSL branch (taken when "
              "cutlass imports) is never entered; cutedsl.dequant_gather judges that one. "
              "Scale byte 0 -> 0.0 (ex2.approx.ftz), 255 -> +Inf (datapath 3, H4). Output rows the "
              "kernel does not write stay 0 (the reference gather's convention).",
    ),
    KernelEntry(
        name="vllm_triton.compute_global_topk_indices_and_lens",
        stage="topk_global",
        family="Triton",
        source=f"{CACHE_UTILS}.compute_global_topk_indices_and_lens",
        archs=_TRITON_ARCHS,
        dtypes=("int32",),
        policies={"topk_lens": "count"},
        tolerance_scope="vllm_triton.compute_global_topk_indices_and_lens",
        probe=_probe_cache_utils,
        call=call_index("compute_global_topk_indices_and_lens", topk_global_args,
                         ("global_topk_indices", "topk_lens")),
        notes="lens = count of entries >= 0, not a prefix length (datapath 4.1, H10).",
    ),
    KernelEntry(
        name="vllm_triton.combine_topk_swa_indices",
        stage="combine_prefill",
        family="Triton",
        source=f"{CACHE_UTILS}.combine_topk_swa_indices",
        archs=_TRITON_ARCHS,
        dtypes=("int32",),
        policies={"combine_form": "common"},
        tolerance_scope="vllm_triton.combine_topk_swa_indices",
        probe=_probe_cache_utils,
        call=call_index("combine_topk_swa_indices", combine_args, ("combined_indices", "combined_lens")),
        notes="Common form: a -1 inside the first topk_len columns becomes M*r - 1 (datapath 4.5, H10).",
    ),
    KernelEntry(
        name="vllm_triton.build_flashinfer_mixed_sparse_indices",
        stage="flashinfer_mixed",
        family="Triton",
        source=f"{CACHE_UTILS}.build_flashinfer_mixed_sparse_indices",
        archs=_TRITON_ARCHS,
        dtypes=("int32",),
        policies={},
        tolerance_scope="vllm_triton.build_flashinfer_mixed_sparse_indices",
        probe=_probe_cache_utils,
        call=call_index("build_flashinfer_mixed_sparse_indices", flashinfer_mixed_args,
                         ("sparse_indices", "sparse_topk_lens")),
        notes="Rows past num_tokens (num_rows > num_tokens) stay unset, as in production.",
    ),
    KernelEntry(
        name="vllm_triton.compute_swa_indices_and_lens",
        stage="swa_indices",
        family="Triton",
        source=f"{SPARSE_SWA}._COMPUTE_SWA_INDICES_AND_LENS_KERNEL",
        archs=_TRITON_ARCHS,
        dtypes=("int32",),
        policies={},
        tolerance_scope="vllm_triton.compute_swa_indices_and_lens",
        probe=_sparse_swa_probe,
        call=_call_swa_indices,
        notes="Engine-bound file (sparse_swa.py): staged with `stage-vllm --parts engine`, its engine "
              "imports replaced by placeholder stand-ins.",
    ),
    KernelEntry(
        name="vllm_triton.fused_inv_rope_fp8_quant.sm90",
        stage="inv_rope_fp8",
        family="Triton",
        source=f"{INV_ROPE}.fused_inv_rope_fp8_quant(tma_aligned_scales=False)",
        archs=_TRITON_ARCHS,
        dtypes=("bfloat16",),
        policies={"rope_arith": RopeArithmetic.FMA_TRITON.value, "scale_layout": "sm90_fp32"},
        tolerance_scope="vllm_triton.fused_inv_rope_fp8_quant",
        probe=staged_triton_probe(INV_ROPE),
        call=_call_inv_rope(False),
        notes="Inverse RoPE (Triton contraction) + 128-wide UE8M0 FP8 groups; codes returned as vLLM's "
              "[T, G, hpg*512] view, fp32 MN-major scales converted to exponents.",
    ),
    KernelEntry(
        name="vllm_triton.fused_inv_rope_fp8_quant.sm100",
        stage="inv_rope_fp8",
        family="Triton",
        source=f"{INV_ROPE}.fused_inv_rope_fp8_quant(tma_aligned_scales=True)",
        archs=_TRITON_ARCHS,
        dtypes=("bfloat16",),
        policies={"rope_arith": RopeArithmetic.FMA_TRITON.value, "scale_layout": "sm100_packed_ue8m0"},
        tolerance_scope="vllm_triton.fused_inv_rope_fp8_quant",
        probe=staged_triton_probe(INV_ROPE),
        call=_call_inv_rope(True),
        notes="Same kernel with SM100's packed int32 UE8M0 scales (4 bytes per head); runs on any GPU.",
    ),
    KernelEntry(
        name="vllm_triton.compress_norm_rope_store",
        stage="compressor",
        family="Triton",
        source=f"{COMPRESS}.compress_norm_rope_store_triton",
        archs=_TRITON_ARCHS,
        dtypes=("float32",),
        policies={"scale_rule": ScaleRule.AMAX_CLAMP.value, "fp8": Fp8Flavour.E4M3FN.value,
                  "rope_arith": RopeArithmetic.FMA_TRITON.value, "slot_skip": SlotSkip.ALL_NEGATIVE.value},
        tolerance_scope="vllm_triton.compress_norm_rope_store",
        probe=staged_triton_probe(COMPRESS),
        call=_call_compressor,
        notes="Single-pass Triton compressor (ROCm/XPU writer of compressed caches; OCP and Q_A on every "
              "platform, datapath 2.3). SANITIZE_CACHE_NANS is gfx950-only (scale byte <= 254, NaN RoPE "
              "-> 0); off gfx950 it is False. Bytes are exact only from the bf16 pre-quantisation "
              "boundary (H7): normed differs from the reference by a few fp32 ulps (tl.softmax, "
              "rsqrt.approx). No default cases are registered for the 'compressor' stage yet; "
              "tests/kernels/test_fuzz_writers.py drives it on the GPU.",
    ),
]


# The releases each entry is written for (``KernelEntry.releases``, set by ``registry.assemble``), from the op signatures (``python -m
# dsv4_numerics.staging.survey``): ``use_fnuz`` from 0.24.0; the top-k builder's 0.27.0-0.28.0
# ``output_buffers``; ``left_visible``/``max_image_tokens`` from 0.30.0; ``num_rows`` from 0.31.0;
# ``quantize`` from 0.30.0. Two entries launch a module's kernel object, whose launch arguments are
# its Triton function's (the survey reads them through the object's class): the gather's
# ``_DEQUANTIZE_AND_GATHER_K_CACHE_KERNEL`` first exists in 0.30.0, and the SWA index kernel gained
# ``replay_start_ptr`` in 0.31.0 (on a GPU, 0.24.0-0.29.0 raised AttributeError and 0.30.0 a
# TypeError before their ranges said so).
RELEASE_RANGES = {
    "vllm_triton.quantize_and_insert_k_cache": "vllm>=0.24.0",
    "vllm_triton.quantize_and_insert_k_cache.fnuz": "vllm>=0.24.0",
    "vllm_triton.dequantize_and_gather_k_cache": "vllm>=0.30.0",
    "vllm_triton.compute_global_topk_indices_and_lens": "vllm>=0.29.0",
    "vllm_triton.combine_topk_swa_indices": "vllm>=0.30.0",
    "vllm_triton.build_flashinfer_mixed_sparse_indices": "vllm>=0.31.0",
    "vllm_triton.compute_swa_indices_and_lens": "vllm>=0.31.0",
    "vllm_triton.fused_inv_rope_fp8_quant.sm90": "vllm>=0.30.0",
    "vllm_triton.fused_inv_rope_fp8_quant.sm100": "vllm>=0.30.0",
    "vllm_triton.compress_norm_rope_store": "vllm>=0.22.0",
}
