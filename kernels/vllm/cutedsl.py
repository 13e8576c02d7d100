"""Adapters for vLLM 0.33.0's CuTe-DSL DSv4 kernels (need ``nvidia-cutlass-dsl``).

* ``cutedsl.dequant_gather`` -- ``DequantGatherKCacheKernel``
  (``V:models/deepseek_v4/nvidia/ops/dequant_gather_k_cutedsl.py``), the CUDA default behind
  ``dequantize_and_gather_k_cache`` when ``has_cutedsl()`` (``V:.../common/ops/cache_utils.py:
  499-547``). Stage ``gather``. Scale bytes are turned into bf16 by bit placement
  (``s << 7``: byte 0 -> +0.0, byte 255 -> +Inf; datapath 3 table, ``Ue8m0Consumer.CUTE``) and
  multiplied in bf16 (exact: powers of two), so finite records decode exactly like the reference.
* ``cutedsl.compressor`` -- ``SparseAttnCompressorCuteDSL`` (``.../sparse_attn_compress_cutedsl.py``
  dispatcher ``:2343-2503``), the writer of every compressed cache on NVIDIA (Q_S scale rule,
  datapath 2.4). Stage ``compressor``: the same canonical inputs as the Triton compressor entry
  (``vllm_triton.compressor_args``), called as ``compressor.py:429-523`` calls it.

Both run only where ``cutlass`` (nvidia-cutlass-dsl), ``quack`` (quack-kernels) and the vLLM
modules import. Without a vLLM install: ``dsv4-numerics stage-vllm --wheel vllm-0.33.0-*.whl DIR
--parts cutedsl`` stages the two modules with ``vllm/cute_utils`` and the CuTe JIT-warmup helper,
and ``dsv4-numerics stage-vllm DIR --cutedsl-wheels WHEELS`` installs the CuTe-DSL wheels into
``DIR/site`` (read through its ``.pth`` files); ``DSV4_STAGED=DIR`` activates both.

Checked against the real kernels (vLLM 0.33.0): both are called with the keyword arguments of
their production call sites (``cache_utils.dequantize_and_gather_k_cache``; ``compressor.py``
``DeepseekCompressor.forward``), and every tensor meets the alignment the kernels are compiled
for (``warmup_inputs``: ``make_fake_tensor(..., divisibility=d)`` promises ``d`` elements of
alignment -- Int64 ``positions``/slot mappings 64 bytes, Int32 ``token_to_req_indices`` 16
bytes, the fp32 state cache and the uint8 K cache 16 bytes; the gather's K-cache page stride
32 bytes). vLLM's buffers are fresh allocations and always meet them; a case's tensor that is a
view at an odd offset would not, so such inputs are copied to a fresh (aligned) buffer first
(:func:`aligned`; ``tests/kernels/test_cutedsl_adapters.py`` holds the case).
"""

from __future__ import annotations

import torch

from dsv4_numerics.reference.constants import C128_RATIO, HEAD_DIM, RECORD_BYTES
from dsv4_numerics.reference.errors import INDEX_DTYPES, UnsupportedCase, check_dtype, check_int, fail
from dsv4_numerics.reference.policies import (
    Fp8Flavour,
    NanPolicy,
    RopeArithmetic,
    ScaleRule,
    SlotSkip,
    Ue8m0Consumer,
)

from dsv4_numerics.kernels import probe as P
from dsv4_numerics.kernels.convert import round_up
from dsv4_numerics.kernels.registry import KernelEntry
from dsv4_numerics.kernels.convert import readable_pages

GATHER_MODULE = "vllm.models.deepseek_v4.nvidia.ops.dequant_gather_k_cutedsl"
COMPRESS_MODULE = "vllm.models.deepseek_v4.nvidia.ops.sparse_attn_compress_cutedsl"
# DequantGatherKCacheKernel's compile signature declares the page stride divisible by 32 bytes
# and a 32-byte aligned base (``warmup_inputs``: ``sym_int64(divisibility=32)``,
# ``assumed_align=32``, dequant_gather_k_cutedsl.py:380-386).
CUTE_PAGE_ALIGN = 32

_CUTE_PACKAGES = P.chain(
    P.needs_module("cutlass", "nvidia-cutlass-dsl"),
    P.needs_module("quack", "quack-kernels"),
    P.needs_module("cuda.bindings", "cuda-python"),
)


def _cute_probe(module: str) -> P.Probe:
    return P.chain(
        P.needs_arch("sm90", "sm100", "sm103", "sm120", "sm121"),
        _CUTE_PACKAGES,
        P.needs_staged_vllm("vllm.cute_utils", "cutedsl"),
        P.needs_staged_vllm(module, "cutedsl"),
        P.needs_import(module),
    )


def cute_module(name: str):
    """Import a production module (lazily; tests substitute a stand-in here)."""
    from importlib import import_module

    return import_module(name)


def aligned(t: torch.Tensor | None, nbytes: int) -> torch.Tensor | None:
    """``t`` contiguous and starting on an ``nbytes`` boundary: itself when it already is, else a
    copy in a fresh allocation (the CUDA caching allocator hands out 512-byte aligned blocks).
    The CuTe kernels are compiled assuming this alignment and do not check it at launch."""
    if t is None:
        return None
    t = t.contiguous()
    if t.data_ptr() % nbytes == 0:
        return t
    out = torch.empty(t.shape, dtype=t.dtype, device=t.device)
    out.copy_(t)
    return out


# Alignment (bytes) the compiled CuTe compressor assumes per argument (warmup_inputs).
COMPRESSOR_ALIGN = {"positions": 64, "slot_mapping": 64, "token_to_req_indices": 16, "state_cache": 16,
                    "rms_norm_weight": 8, "cos_sin_cache": 4, "block_table": 4}


def gather_call(case) -> dict[str, torch.Tensor]:
    """Canonical ``gather`` inputs (``reference.cases.cache``: ``cache``, ``block_table``,
    ``seq_lens``, ``gather_lens`` or None, ``block_size``, optional ``offset``) -> ``{"out":
    bf16 [R, offset + max(g), 512]}``, rows the kernel does not write left at 0 (the reference's
    ``gather`` returns the same zeros plus the valid mask)."""
    fn = "cutedsl.dequant_gather"
    inp = case.inputs
    bs = check_int(fn, "block_size", int(inp["block_size"]), minimum=1)
    offset = check_int(fn, "offset", int(inp.get("offset", 0)), minimum=0)
    bt, seq = inp["block_table"], inp["seq_lens"]
    check_dtype(fn, "block_table", bt, INDEX_DTYPES)
    check_dtype(fn, "seq_lens", seq, INDEX_DTYPES)
    gl = inp.get("gather_lens")
    if gl is not None:
        check_dtype(fn, "gather_lens", gl, INDEX_DTYPES)
    r = bt.shape[0]
    if seq.shape != (r,):
        fail(fn, "seq_lens", f"must have shape [{r}]", tuple(seq.shape))
    width = offset + (int((gl if gl is not None else seq).max()) if r else 0)
    out = torch.zeros((r, width, HEAD_DIM), dtype=torch.bfloat16, device=bt.device)
    k_cache = readable_pages(inp["cache"], bs, CUTE_PAGE_ALIGN)
    kernel = cute_module(GATHER_MODULE)._DEQUANT_GATHER_K_CACHE_CUTEDSL_KERNEL
    kernel(out=out, k_cache=k_cache, seq_lens=seq.to(torch.int32).contiguous(),
           gather_lens=None if gl is None else gl.to(torch.int32).contiguous(),
           block_table=bt.to(torch.int32).contiguous(), block_size=bs, offset=offset)
    return {"out": out}



# The CuTe C128 path compresses from a state cache of exactly 8 entries per page
# (``SparseAttnCompressC128Block8Kernel.state_block_size``, dispatcher :2419-2424).
CUTE_C128_STATE_BLOCK = 8


def compressor_call(case) -> dict[str, torch.Tensor]:
    """Canonical ``compressor`` inputs (the contract of ``vllm_triton.compressor_args``: state
    cache, tables, positions, slot mappings, 584-byte compressed cache, cos/sin, RMSNorm weight)
    -> ``{"cache": the written compressed cache in the case's own form}`` through vLLM's CUDA
    dispatcher ``SparseAttnCompressorCuteDSL`` (``compressor.py:472-485`` selects it for
    head_dim 512 on CUDA), ``store_full_kv=False`` (the 584-byte layout)."""
    from dsv4_numerics.kernels.vllm.triton import compressor_args

    a = compressor_args(case.inputs)
    finish = a.pop("_finish")
    if a["compress_ratio"] == C128_RATIO and a["block_size"] != CUTE_C128_STATE_BLOCK:
        raise UnsupportedCase(f"the CuTe C128 compressor requires a state cache of {CUTE_C128_STATE_BLOCK} "
                              f"entries per page (got {a['block_size']})")
    kv = a["kv_cache"]  # [nb, bs, 584] over a private copy of the case's pages
    nb, bs, page = kv.shape[0], kv.shape[1], kv.stride(0)
    used = bs * RECORD_BYTES
    buf = None
    if page % CUTE_PAGE_ALIGN or kv.data_ptr() % CUTE_PAGE_ALIGN:
        new_page = round_up(page, CUTE_PAGE_ALIGN)
        buf = torch.zeros((nb, new_page), dtype=torch.uint8, device=kv.device)
        buf[:, :used] = torch.as_strided(kv, (nb, used), (page, 1), kv.storage_offset())
        a["kv_cache"] = torch.as_strided(buf, (nb, bs, RECORD_BYTES), (new_page, RECORD_BYTES, 1))
    for name, nbytes in COMPRESSOR_ALIGN.items():
        a[name] = aligned(a[name], nbytes)
    meta = a["k_cache_metadata"]
    meta.slot_mapping = aligned(meta.slot_mapping, 64)
    kernel = cute_module(COMPRESS_MODULE)._SPARSE_ATTN_COMPRESSOR_CUTEDSL_KERNEL
    kernel(**a, store_full_kv=False, store_full_fp8=False, fp8_scale=None)
    if buf is not None:
        torch.as_strided(kv, (nb, used), (page, 1), kv.storage_offset()).copy_(buf[:, :used])
    return {"cache": finish()}


ENTRIES: list[KernelEntry] = [
    KernelEntry(
        name="cutedsl.dequant_gather",
        stage="gather",
        family="CuTe-DSL",
        source=f"{GATHER_MODULE}.DequantGatherKCacheKernel",
        archs=("sm90", "sm100", "sm103", "sm120", "sm121"),
        dtypes=("uint8",),
        policies={
            "fp8": Fp8Flavour.E4M3FN.value,
            "ue8m0": Ue8m0Consumer.CUTE.value,
            "nan": NanPolicy.PROPAGATE.value,
        },
        tolerance_scope="cutedsl.dequant_gather",
        probe=_cute_probe(GATHER_MODULE),
        call=gather_call,
        notes="page stride repacked to a multiple of 32 bytes when a case's is not (the kernel's "
              "compile signature assumes it); record bytes unchanged",
    ),
    KernelEntry(
        name="cutedsl.compressor",
        stage="compressor",
        family="CuTe-DSL",
        source=f"{COMPRESS_MODULE}.SparseAttnCompressorCuteDSL",
        archs=("sm90", "sm100", "sm103", "sm120", "sm121"),
        dtypes=("float32", "uint8"),
        policies={
            "scale_rule": ScaleRule.SCALE_CLAMP.value,  # fmax(1e-4, amax/448): Q_S (datapath 2.4)
            "fp8": Fp8Flavour.E4M3FN.value,
            "rope_arith": RopeArithmetic.SEPARATE.value,  # fp32 x*cos - x'*sin, then cvt.rn.bf16x2
            "slot_skip": SlotSkip.ALL_NEGATIVE.value,
        },
        tolerance_scope="cutedsl.compressor",
        probe=_cute_probe(COMPRESS_MODULE),
        call=compressor_call,
        notes="the writer of every compressed cache on NVIDIA (Q_S scale rule); online-softmax "
              "reduction order differs from Triton's (H7), bytes exact only from the bf16 boundary",
    ),
]
