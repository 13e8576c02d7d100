"""Adapters for vLLM 0.33.0's CUDA KV-cache writers (``torch.ops._C.*`` in
``vllm/_C_stable_libtorch.abi3.so``; spec README section 5, datapath 2.1, 2.7, 2.8, 6).

Entries (``ENTRIES``):

``vllm_cuda.swa_quant_insert``        stage ``swa_write``: the production SWA writer
    ``fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert`` fed the canonical, already-roped rows
    with an identity RoPE table (cos = 1, sin = 0), as the spec's PROBE did (datapath 2.8).
``vllm_cuda.kv_rope_insert``          stage ``swa_write``: the KV-only op
    ``fused_deepseek_v4_kv_rope_insert`` (DSpark context insert), same identity RoPE.
``vllm_cuda.full_cache_bf16_insert``  stage ``plain_write`` (``layout == "bf16"`` cases)
``vllm_cuda.full_cache_fp8_insert``   stage ``plain_write`` (``layout == "fp8"`` cases)

How the production call sites drive them (every conversion below copies these):

* ``V:models/deepseek_v4/attention.py:797-814``: ``q [N, n_local_heads, 512]`` bf16, ``kv [N, 512]``
  bf16, the SWA cache as the 2-D view ``k_cache.view(num_blocks, -1)``, ``slot_mapping`` int64,
  ``positions`` int64, ``rotary_emb.cos_sin_cache`` fp32 ``[max_pos, 64]`` = ``[cos(32)|sin(32)]``,
  ``padded_heads``, ``eps``, ``block_size``; the op returns a fresh padded q.
* ``V:models/deepseek_v4/nvidia/dspark.py:290-347`` (``_insert_context_kv``): KV-only insert through
  the same op with a zero dummy query ``[n_ctx, n_local_heads, 512]`` -- the pattern used here.
* ``V:models/deepseek_v41/attention.py:722-733``: ``fused_deepseek_v4_kv_rope_insert(kv, cache,
  slot_mapping, positions, cos_sin_cache, block_size, fp8_scale_or_None, kv_mxfp8)`` with the
  layer's cache tensor (the ``[num_blocks, bs, 584]`` kernel view, stride(0) = page stride).
* ``V:models/deepseek_v4/attention.py:816-851``: plain rows, ``k_cache [num_blocks, bs, 512]``
  bf16 / ``float8_e4m3fn``; fp8 takes ``fp8_scale`` and ``q_fp8_scale_inv`` as one-element fp32
  tensors (vLLM: both 1.0, ``V:models/deepseek_v4/nvidia/flashinfer_sparse.py:257-279``).

Op schemas (0.33.0 binary, datapath 6): the SWA writer has 13 arguments
``(q_in, kv, k_cache!, slot_mapping, position_ids, cos_sin_cache, q_head_padded, eps,
cache_block_size, apply_q_norm=True, kv_mxfp8=False, apply_q_rope=True, is_q_interleaved=False)``;
host-side checks (public source ``IDX @00ce99f0``, ``csrc/libtorch_stable/
fused_deepseek_v4_qnorm_rope_kv_insert_kernel.cu``): q/kv contiguous, int64 slots/positions,
fp32 ``cos_sin_cache [max_pos, 64]``, ``q_head_padded in {8, 16, 32, 64, 128}``, ``>= q heads``,
``len(slot_mapping) <= N``; the plain-row ops require ``k_cache [nb, bs, 512]`` with unit last
stride and ``k_cache.size(1) == cache_block_size``.

The identity RoPE is *not* an exact identity on every input (derived from the shipped
arithmetic ``even' = fma(e, cos, -fl32(o*sin))``, ``odd' = fma(e, sin, fl32(o*cos))``, datapath
2.1 step 3, with cos = 1, sin = +0):

* ``-0.0`` in a RoPE dim can come back ``+0.0``: ``e = -0, o < 0`` gives ``-0 + (+0) = +0``;
  ``o = -0, e >= +0`` gives ``(+0) + (-0) = +0``;
* a NaN or Inf in one dim of a pair makes the other dim NaN (``Inf * 0 = NaN``).

Entries therefore declare ``rope_arith = fma``: the expected bytes are the reference insert of
``reference.pipeline.rope.apply_rope(k, identity table, FMA)``, which reproduces both effects exactly.
Finite rows without ``-0.0`` in the RoPE dims pass through unchanged.
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path
from typing import Callable

import torch

from dsv4_numerics.reference.cases import Case
from dsv4_numerics.reference.constants import HEAD_DIM, RECORD_BYTES, ROPE_DIM
from dsv4_numerics.reference.errors import INDEX_DTYPES, UnsupportedCase, check_dtype, check_int, check_rank, fail
from dsv4_numerics.reference.pipeline.rope import identity_cos_sin
from dsv4_numerics.reference.policies import Fp8Flavour, NonFinite, RopeArithmetic, ScaleRule, SlotSkip
from dsv4_numerics.reference.storage import clone_storage

from dsv4_numerics.kernels.probe import arch_reason, first_reason, gpu_info
from dsv4_numerics.kernels.registry import KernelEntry

__all__ = [
    "ENTRIES",
    "OPS",
    "DUMMY_Q_HEADS",
    "RMS_EPS",
    "cuda_ops_library_reason",
    "paged_cache_2d",
    "paged_cache_3d",
    "writable_pages",
    "readable_pages",
    "CUDA_PAGE_ALIGN",
    "TRITON_PAGE_ALIGN",
    "swa_write_args",
    "kv_rope_insert_args",
    "plain_write_args",
]

LIBRARY = "_C_stable_libtorch.abi3.so"
OPS = {
    "swa": "fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert",
    "kv_only": "fused_deepseek_v4_kv_rope_insert",
    "bf16": "fused_deepseek_v4_qnorm_rope_kv_rope_full_cache_bf16_insert",
    "fp8": "fused_deepseek_v4_qnorm_rope_kv_rope_full_cache_fp8_insert",
}
# Query heads of the dummy query: V4-Flash at TP1 has 64 heads, padded to 64 for FlashMLA
# (attention.md 1.2; V:models/deepseek_v4/attention.py:247). The KV branch is independent of it.
DUMMY_Q_HEADS = 64
# config.rms_norm_eps of DSv4 (the op's eps only touches the query RMSNorm, never the KV bytes).
RMS_EPS = 1e-6


# --------------------------------------------------------------------------- library discovery


def _vllm_dirs() -> list[Path]:
    """Folders of the importable ``vllm`` package (installed, or staged and named by
    ``DSV4_STAGED``), found without importing it."""
    from dsv4_numerics.kernels.staged import activate

    activate()
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        return []
    if spec is None:
        return []
    return [Path(p) for p in (spec.submodule_search_locations or [])]


@functools.lru_cache(maxsize=None)
def cuda_ops_library_reason() -> str | None:
    """Load ``vllm/_C_stable_libtorch.abi3.so`` (``torch.ops.load_library``) once per process.

    ``None`` when it is loaded (or its ops were already registered by an installed vLLM);
    otherwise a reason naming the missing piece: no vLLM on the path, a staged folder without the
    ``cuda`` part, the ``.xz`` not unpacked, or the loader's error. Needs an NVIDIA GPU first
    (the wheel's library is a CUDA build; ROCm ships its own HIP build of these ops).
    """
    reason = arch_reason(("any-cuda",))
    if reason:
        return reason
    if gpu_info().vendor != "cuda":
        return "needs an NVIDIA GPU (the vLLM wheel's _C_stable_libtorch is a CUDA build)"
    try:
        getattr(torch.ops._C, OPS["swa"])
        return None  # an installed vLLM already registered the ops
    except (AttributeError, RuntimeError):
        pass
    dirs = _vllm_dirs()
    if not dirs:
        from dsv4_numerics.kernels.staged import missing_hint

        return missing_hint("vllm._C_stable_libtorch", "cuda")
    for d in dirs:
        lib = d / LIBRARY
        if lib.exists():
            try:
                torch.ops.load_library(str(lib))
            except (OSError, RuntimeError) as e:
                return f"{lib} failed to load: {type(e).__name__}: {e}"
            return None
        if (d / (LIBRARY + ".xz")).exists():
            return (f"{lib} is staged xz-compressed only and could not be unpacked here: run "
                    f"`dsv4-numerics stage-vllm --unpack {d.parent}` on this machine")
    return (f"vllm/{LIBRARY} not found in {', '.join(map(str, dirs))}: stage with "
            "`dsv4-numerics stage-vllm --wheel vllm-0.33.0-*.whl DIR --parts cuda` (the default parts omit it)")


def _op_probe(key: str):
    @functools.lru_cache(maxsize=None)
    def probe() -> str | None:
        def op_present() -> str | None:
            try:
                getattr(torch.ops._C, OPS[key])
            except (AttributeError, RuntimeError) as e:
                return (f"torch.ops._C.{OPS[key]} is not registered by the loaded library "
                        f"({type(e).__name__}; needs the vLLM 0.33.0 build)")
            return None

        return first_reason(cuda_ops_library_reason, op_present)

    return probe


def cuda_op(key: str):
    reason = _op_probe(key)()
    if reason:
        raise RuntimeError(f"vllm_cuda: {OPS[key]} cannot run here: {reason}")
    return getattr(torch.ops._C, OPS[key])


# --------------------------------------------------------------------------- pure conversions


def cache_geometry(fn: str, cache: torch.Tensor, block_size: int) -> tuple[int, int]:
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
    nb, page = cache_geometry("paged_cache_2d", cache, block_size)
    return torch.as_strided(cache, (nb, page), (page, 1), cache.storage_offset())


def paged_cache_3d(cache: torch.Tensor, block_size: int) -> torch.Tensor:
    """``[num_blocks, bs, 584]`` uint8 kernel view with strides ``(page_stride, 584, 1)`` (no copy):
    the layer's ``kv_cache`` as vLLM's Triton kernels and the KV-only op receive it."""
    nb, page = cache_geometry("paged_cache_3d", cache, block_size)
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
    nb, page = cache_geometry(fn, cache, block_size)
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
    nb, page = cache_geometry(fn, cache, block_size)
    view = paged_cache_3d(cache, block_size)
    if page % align == 0 and view.data_ptr() % align == 0:
        return view
    used = block_size * RECORD_BYTES
    new_page = -(-page // align) * align
    buf = torch.zeros((nb, new_page), dtype=torch.uint8, device=cache.device)
    buf[:, :used] = paged_cache_2d(cache, block_size)[:, :used]
    return torch.as_strided(buf, (nb, block_size, RECORD_BYTES), (new_page, RECORD_BYTES, 1))


def _rows_bf16(fn: str, arg: str, k: torch.Tensor) -> torch.Tensor:
    check_dtype(fn, arg, k, (torch.bfloat16,))
    check_rank(fn, arg, k, 2)
    if k.shape[1] != HEAD_DIM:
        fail(fn, arg, f"must have shape [N, {HEAD_DIM}]", tuple(k.shape))
    return k.contiguous()


def _slots_int64(fn: str, slots: torch.Tensor, n: int) -> torch.Tensor:
    check_dtype(fn, "slot_mapping", slots, INDEX_DTYPES)
    check_rank(fn, "slot_mapping", slots, 1)
    if slots.shape[0] > n:
        fail(fn, "slot_mapping", f"must not be longer than k (N = {n}): the op requires "
             "len(slot_mapping) <= N", slots.shape[0])
    return slots.to(torch.int64).contiguous()


def _rope_inputs(fn: str, inputs: dict, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(position_ids int64 [N], cos_sin_cache fp32 [P, 64])``: the case's own when it carries
    ``positions`` and ``cos_sin_cache`` (a writer-applies-RoPE case), else all-zero positions
    and the identity table."""
    if "positions" in inputs or "cos_sin_cache" in inputs:
        pos, cs = inputs.get("positions"), inputs.get("cos_sin_cache")
        if pos is None or cs is None:
            fail(fn, "inputs", "must carry both 'positions' and 'cos_sin_cache' or neither")
        check_dtype(fn, "positions", pos, INDEX_DTYPES)
        check_rank(fn, "positions", pos, 1)
        if pos.shape[0] != n:
            fail(fn, "positions", f"must have one entry per row of k ({n})", tuple(pos.shape))
        check_dtype(fn, "cos_sin_cache", cs, (torch.float32,))
        if cs.dim() != 2 or cs.shape[1] != ROPE_DIM:
            fail(fn, "cos_sin_cache", f"must be fp32 [max_pos, {ROPE_DIM}]", tuple(cs.shape))
        if n and (int(pos.min()) < 0 or int(pos.max()) >= cs.shape[0]):
            fail(fn, "positions", f"must index rows of cos_sin_cache [0, {cs.shape[0]})")
        return pos.to(torch.int64).contiguous(), cs.contiguous()
    return (torch.zeros(n, dtype=torch.int64, device=device), identity_cos_sin(1, device))


def swa_write_args(inputs: dict) -> dict:
    """Canonical ``swa_write`` inputs -> the keyword arguments of the SWA writer op, exactly as
    ``attention.py:803-814`` / ``dspark.py:_insert_context_kv`` build them.

    inputs: ``k`` bf16 ``[N, 512]``, ``slot_mapping`` int ``[L <= N]``, ``cache`` (canonical
    584-byte cache, any accepted form), ``block_size``; optional ``positions`` + ``cos_sin_cache``
    (RoPE applied by the writer), else identity RoPE at position 0.
    Returns ``q_in`` (zero dummy query ``[N, 64, 512]`` bf16), ``kv``, ``k_cache`` (2-D view of a
    COPY of the cache's pages), ``slot_mapping`` int64, ``position_ids`` int64, ``cos_sin_cache``
    fp32, ``q_head_padded``, ``eps``, ``cache_block_size``, plus ``_finish()`` returning the
    written copy in the input's own form (``writable_pages`` with ``CUDA_PAGE_ALIGN``).
    """
    fn = "swa_write_args"
    k = _rows_bf16(fn, "k", inputs["k"])
    bs = check_int(fn, "block_size", inputs["block_size"], minimum=1)
    pages, finish = writable_pages(inputs["cache"], bs, CUDA_PAGE_ALIGN)
    n = k.shape[0]
    pos, cs = _rope_inputs(fn, inputs, n, k.device)
    return dict(
        q_in=torch.zeros((n, DUMMY_Q_HEADS, HEAD_DIM), dtype=torch.bfloat16, device=k.device),
        kv=k,
        k_cache=pages,
        slot_mapping=_slots_int64(fn, inputs["slot_mapping"], n),
        position_ids=pos,
        cos_sin_cache=cs,
        q_head_padded=DUMMY_Q_HEADS,
        eps=RMS_EPS,
        cache_block_size=bs,
        _finish=finish,
    )


def kv_rope_insert_args(inputs: dict) -> dict:
    """Canonical ``swa_write`` inputs -> arguments of ``fused_deepseek_v4_kv_rope_insert``.

    That op inserts exactly ``len(slot_mapping)`` rows and requires ``kv`` and ``position_ids``
    to have that many rows (public source ``@00ce99f0``), so ``k`` is cut to ``L`` rows (the
    padding rows beyond ``L`` are never written by any writer, datapath 2.1 step 1). The cache
    is the ``[nb, bs, 584]`` kernel view of a copy (the v4.1 call site passes the layer's cache).
    """
    fn = "kv_rope_insert_args"
    k = _rows_bf16(fn, "k", inputs["k"])
    bs = check_int(fn, "block_size", inputs["block_size"], minimum=1)
    pages, finish = writable_pages(inputs["cache"], bs, CUDA_PAGE_ALIGN)
    slots = _slots_int64(fn, inputs["slot_mapping"], k.shape[0])
    n = slots.shape[0]
    pos, cs = _rope_inputs(fn, inputs, k.shape[0], k.device)
    return dict(
        kv=k[:n].contiguous(),
        k_cache=paged_cache_3d(pages, bs),
        slot_mapping=slots,
        position_ids=pos[:n].contiguous(),
        cos_sin_cache=cs,
        cache_block_size=bs,
        fp8_scale=None,
        kv_mxfp8=False,
        _finish=finish,
    )


def plain_write_args(inputs: dict, layout: str) -> dict:
    """Canonical ``plain_write`` inputs -> arguments of the full-cache bf16 / fp8 insert ops.

    inputs: ``k`` bf16 ``[N, 512]``, ``slot_mapping``, ``block_size``, ``layout``, ``kv_scale``,
    ``cache`` bf16 (layout "bf16") or uint8 (layout "fp8") ``[nb, bs, 512]``.
    The op wants ``q [N, H, 512]`` (bf16 path: roped in place; fp8 path: read-only plus a
    ``q_fp8`` output of the same shape), the cache as bf16 / ``float8_e4m3fn`` ``[nb, bs, 512]``
    (a copy), and for fp8 the one-element fp32 tensors ``fp8_scale = [kv_scale]`` and
    ``q_fp8_scale_inv = [1.0]`` (flashinfer_sparse.py:257-279). Cases of the other layout raise
    ``UnsupportedCase``.
    """
    fn = "plain_write_args"
    if inputs.get("layout") != layout:
        raise UnsupportedCase(f"plain_write case with layout={inputs.get('layout')!r}: this entry "
                              f"writes layout {layout!r}")
    k = _rows_bf16(fn, "k", inputs["k"])
    bs = check_int(fn, "block_size", inputs["block_size"], minimum=1)
    cache = inputs["cache"]
    want = torch.bfloat16 if layout == "bf16" else torch.uint8
    check_dtype(fn, "cache", cache, (want, torch.float8_e4m3fn) if layout == "fp8" else (want,))
    check_rank(fn, "cache", cache, 3)
    if cache.shape[1] != bs or cache.shape[2] != HEAD_DIM or cache.stride(2) != 1:
        fail(fn, "cache", f"must be [num_blocks, block_size={bs}, {HEAD_DIM}] with unit last stride",
             f"shape {tuple(cache.shape)} strides {cache.stride()}")
    n = k.shape[0]
    out = clone_storage(cache)
    args = dict(
        q=torch.zeros((n, DUMMY_Q_HEADS, HEAD_DIM), dtype=torch.bfloat16, device=k.device),
        kv=k,
        k_cache=out if out.dtype != torch.uint8 else out.view(torch.float8_e4m3fn),
        slot_mapping=_slots_int64(fn, inputs["slot_mapping"], n),
        position_ids=torch.zeros(n, dtype=torch.int64, device=k.device),
        cos_sin_cache=identity_cos_sin(1, k.device),
        eps=RMS_EPS,
        cache_block_size=bs,
        _out=out,
        _finish=lambda: out,
    )
    if layout == "fp8":
        scale = inputs.get("kv_scale", 1.0)
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not float(scale) > 0:
            fail(fn, "kv_scale", "must be a positive float", scale)
        args["q_fp8"] = torch.empty((n, DUMMY_Q_HEADS, HEAD_DIM), dtype=torch.float8_e4m3fn, device=k.device)
        args["fp8_scale"] = torch.tensor([float(scale)], dtype=torch.float32, device=k.device)
        args["q_fp8_scale_inv"] = torch.ones(1, dtype=torch.float32, device=k.device)
    return args


# --------------------------------------------------------------------------- calls


def _call_swa(case: Case) -> dict:
    a = swa_write_args(case.inputs)
    cuda_op("swa")(a["q_in"], a["kv"], a["k_cache"], a["slot_mapping"], a["position_ids"],
               a["cos_sin_cache"], a["q_head_padded"], a["eps"], a["cache_block_size"])
    return {"cache": a["_finish"]()}


def _call_kv_only(case: Case) -> dict:
    a = kv_rope_insert_args(case.inputs)
    cuda_op("kv_only")(a["kv"], a["k_cache"], a["slot_mapping"], a["position_ids"], a["cos_sin_cache"],
                   a["cache_block_size"], a["fp8_scale"], a["kv_mxfp8"])
    return {"cache": a["_finish"]()}


def _call_plain(layout: str):
    def call(case: Case) -> dict:
        a = plain_write_args(case.inputs, layout)
        if layout == "bf16":
            cuda_op("bf16")(a["q"], a["kv"], a["k_cache"], a["slot_mapping"], a["position_ids"],
                        a["cos_sin_cache"], a["eps"], a["cache_block_size"])
        else:
            cuda_op("fp8")(a["q"], a["kv"], a["q_fp8"], a["k_cache"], a["slot_mapping"], a["position_ids"],
                       a["cos_sin_cache"], a["fp8_scale"], a["q_fp8_scale_inv"], a["eps"],
                       a["cache_block_size"])
        return {"cache": a["_out"]}

    return call


# --------------------------------------------------------------------------- entries

_SOURCE = "vllm._C_stable_libtorch (torch.ops._C.{op})"
_SWA_POLICIES = {
    "scale_rule": ScaleRule.AMAX_CLAMP.value,
    "fp8": Fp8Flavour.E4M3FN.value,
    "nonfinite": NonFinite.CUDA_SATFINITE.value,
    "slot_skip": SlotSkip.ALL_NEGATIVE.value,
    "rope_arith": RopeArithmetic.FMA.value,
    "writer_rope": "identity",  # cos = 1, sin = +0 at position 0 (module docstring)
}
_IDENTITY_NOTE = ("Fed the canonical pre-roped rows through an identity RoPE table (cos=1, sin=0): "
                  "-0.0 in a RoPE dim may come back +0.0 and a NaN/Inf poisons its pair partner "
                  "(expected bytes: reference insert of apply_rope(k, identity, FMA)). ")

ENTRIES: list[KernelEntry] = [
    KernelEntry(
        name="vllm_cuda.swa_quant_insert",
        stage="swa_write",
        family="CUDA",
        source=_SOURCE.format(op=OPS["swa"]),
        archs=("sm90", "sm100", "sm103", "sm120", "any-cuda"),
        dtypes=("bfloat16",),
        policies=dict(_SWA_POLICIES),
        tolerance_scope="vllm_cuda.swa_quant_insert",
        probe=_op_probe("swa"),
        call=_call_swa,
        notes=_IDENTITY_NOTE + "Zero dummy query [N, 64, 512], q_head_padded=64, as DSpark's "
              "_insert_context_kv. The HIP build (FNUZ, clamp 224 on gfx942) is not staged.",
    ),
    KernelEntry(
        name="vllm_cuda.kv_rope_insert",
        stage="swa_write",
        family="CUDA",
        source=_SOURCE.format(op=OPS["kv_only"]),
        archs=("sm90", "sm100", "sm103", "sm120", "any-cuda"),
        dtypes=("bfloat16",),
        policies=dict(_SWA_POLICIES),
        tolerance_scope="vllm_cuda.kv_rope_insert",
        probe=_op_probe("kv_only"),
        call=_call_kv_only,
        notes=_IDENTITY_NOTE + "KV-only op (no query); k is cut to len(slot_mapping) rows, the op's "
              "contract. Cache passed as the [nb, bs, 584] kernel view.",
    ),
    KernelEntry(
        name="vllm_cuda.full_cache_bf16_insert",
        stage="plain_write",
        family="CUDA",
        source=_SOURCE.format(op=OPS["bf16"]),
        archs=("sm100", "sm103", "sm90", "any-cuda"),
        dtypes=("bfloat16",),
        policies={"slot_skip": SlotSkip.ALL_NEGATIVE.value, "rope_arith": RopeArithmetic.FMA.value,
                  "writer_rope": "identity", "plain_layout": "bf16"},
        tolerance_scope="vllm_cuda.full_cache_bf16_insert",
        probe=_op_probe("bf16"),
        call=_call_plain("bf16"),
        notes=_IDENTITY_NOTE + "Runs the layout='bf16' plain_write cases; fp8 cases are skipped.",
    ),
    KernelEntry(
        name="vllm_cuda.full_cache_fp8_insert",
        stage="plain_write",
        family="CUDA",
        source=_SOURCE.format(op=OPS["fp8"]),
        archs=("sm100", "sm103", "sm90", "any-cuda"),
        dtypes=("bfloat16",),
        policies={"fp8": Fp8Flavour.E4M3FN.value, "nonfinite": NonFinite.CUDA_SATFINITE.value,
                  "slot_skip": SlotSkip.ALL_NEGATIVE.value, "rope_arith": RopeArithmetic.FMA.value,
                  "writer_rope": "identity", "plain_layout": "fp8",
                  # H15: this writer quantises the fp32 roped value (no bf16 rounding first,
                  # IDX @00ce99f0 packFp8E4M3x16); with the identity table that value is bf16 k.
                  "round_to_bf16_first": "false"},
        tolerance_scope="vllm_cuda.full_cache_fp8_insert",
        probe=_op_probe("fp8"),
        call=_call_plain("fp8"),
        notes=_IDENTITY_NOTE + "Per-tensor scale tensors [kv_scale] and [1.0] as vLLM passes them; "
              "runs the layout='fp8' plain_write cases.",
    ),
]
