"""SGLang 0.5.23's JIT-CUDA and TileLang DeepSeek-V4 kernels (family ``sglang``).

``SG:`` cites the ``sglang-0.5.23`` wheel (``sglang/``). SGLang compiles these CUDA kernels at
first use from sources shipped in the wheel (``SG:kernels/jit/csrc``, ``SG:kernels/jit/include``):
``load_jit`` writes a ``build.ninja``, runs ninja and nvcc for the local GPU (``sm_90a`` on an
H200) and loads the result through ``apache-tvm-ffi`` (``SG:kernels/jit/utils/compile/``). The
TileLang decode is compiled by ``tilelang`` the same way. Nothing is installed: the kernel files
are staged (``dsv4-numerics stage-sglang --wheel sglang-0.5.23-*.whl DEST``, ``DSV4_STAGED``) and
the Python packages they need (``apache-tvm-ffi``, ``msgspec``, ``tilelang`` and its dependencies)
are installed into the staged folder's ``site/`` (``stage-vllm DEST --site-wheels DIR``).

Entries (``ENTRIES``):

``sglang.store_jit``               stage ``swa_write``: ``fused_store_cache(type="flashmla",
    layout=V4)`` (``SG:kernels/ops/attention/dsv4/attn.py:71-117``) -> the ``FusedStoreCacheFlashMLAKernel``
    of ``SG:kernels/jit/csrc/deepseek_v4/store.cuh:47-80,205-289`` over the V4 layout of
    ``SG:kernels/jit/include/sgl_kernel/deepseek_v4/kv_layout.cuh`` (the MODEL1 584-byte page:
    ``bs`` data rows of 576 bytes, then ``bs`` scale rows of 8).
``sglang.store_jit.v41_footer``    stage ``v41_write``: the same wrapper with ``layout=V41`` (MXFP8
    record) or ``V41_FP4`` (NVFP4 record), the block-split page (``V41Layout.page_footer``).
``sglang.store_jit.v41_interleaved`` stage ``v41_write``: ``layout=V41_NEW`` / ``V41_FP4_NEW``
    (each token's scales right after its data, ``V41Layout.interleaved``).
``sglang.rope_jit``                stage ``rope`` (forward cases): ``fused_rope_inplace(q, None,
    freqs_cis, positions, inverse=False)`` (``SG:kernels/ops/attention/dsv4/norm_rope.py:142-170``,
    ``SG:kernels/jit/csrc/deepseek_v4/rope.cuh``).
``sglang.rope_jit.inverse``        stage ``rope`` (inverse cases): the same op with ``inverse=True``.
``sglang.tilelang_decode``         stage ``decode``: ``dpsk_v4_fp8_attention_fwd``
    (``SG:kernels/ops/attention/dsv4/tilelang_fp8_attention.py:949-1064``), FlashMLA's
    ``flash_mla_with_kvcache`` signature over the MODEL1 cache, driven exactly as
    ``flashmla.sparse_decode.sm90`` is (``kernels/flashmla/sparse.py``: heads padded to 64/128, top-k
    padded with ``-1`` to a multiple of 64, ``s_q = 1``, ``+inf`` LSE of an empty row -> ``-inf``).

Contracts the adapters meet (cases outside them raise ``UnsupportedCase``, a skip):

* page size: every kernel here is instantiated per page size and needs a power of two
  (``store.cuh:209`` ``static_assert(std::has_single_bit(kPageSize))``,
  ``tilelang_fp8_attention.py:100``);
* page stride: the stores verify ``cache.stride(0) == kv_page_bytes(layout, bs)`` exactly
  (``store.cuh:258-262``): V4 pages padded to a multiple of 576 bytes, V41 to 512, V41_FP4 to
  256, the interleaved layouts unpadded (``kv_layout.cuh:111-115``). A canonical cache with any
  other stride is repacked to that stride for the call and its ``bs * R`` record bytes per page
  copied back (the writers never touch the page tail), so the judged bytes are the case's own;
* negative slots: the stores have no skip (``store.cuh:56-58`` "don't store if invalid" is not
  implemented; ``PagedKV::row`` shifts a negative slot to a negative page and writes before the
  cache). SGLang's callers never pass one; the adapter drops those tokens (the canonical skip)
  instead of letting the kernel write out of bounds;
* rope: bf16 ``x`` only (the op rotates bf16 in place); ``x [..., 512]`` is viewed ``[B, H, 512]``
  with ``B = positions.numel()``, and the op is given the 64 RoPE lanes ``x[..., 448:]``;
* decode: as FlashMLA's decode (``flashmla.sparse_decode_call``); the TileLang kernel treats every
  negative index as empty but uses a positive out-of-range one as an address, so indices that are
  neither ``-1`` nor a slot are refused as for FlashMLA.

Declared behaviour (``reference.policies``), read from the sources:

* V4 store: ``scale_rule=amax_clamp`` (``fmaxf(1e-4f, amax) / 448`` rounded up to a power of two by
  ``cast_to_ue8m0``, ``fp8_utils.cuh:26-31``: Q_A, as vLLM's CUDA writer), ``fp8=e4m3fn``,
  ``nonfinite=sglang_jit`` (NaN ignored by the tile max; NaN -> +448 by ``fmaxf(fminf(v, 448),
  -448)``; an Inf tile multiplies by ``-Inf``, ``NonFinite.SGLANG_JIT``), the pad byte (8th scale
  byte) never written (vLLM's writers write 0; the judge does not count the pad as defined);
* V4.1 stores: MXFP8 ``scale_rule=scale_clamp`` (``kv_layout.cuh:163-168``: the exponent of
  ``ceil(log2(amax / 448))`` from amax's bits, floored at 2**-13 = byte 114, i.e. Q_S; vLLM's
  MXFP8 writer is Q_A), NVFP4 ``nvfp4_rule=div_rn`` (``__fdiv_rn(amax, 6.0f)``,
  ``kv_layout.cuh:200``); ``nonfinite=finite`` ("NaN / inf are not handled", ``kv_layout.cuh:137``);
* rope: the op writes ``a*b - c*d`` / ``a*b + c*d`` (``rope.cuh:61-72``); nvcc contracts the
  left product (as vLLM's CUDA writer, PROBE-verified there). Forward ``(e*cos - o*sin, e*sin +
  o*cos)`` is ``RopeArithmetic.FMA``; inverse ``(e*cos + o*sin, o*cos - e*sin)`` fuses ``o*cos`` in
  the odd lane, which is ``RopeArithmetic.FMA_TRITON``'s inverse. One entry per direction;
* TileLang decode: the FP8 NoPE codes are turned into bf16 by exponent arithmetic
  (``tilelang_fp8_attention.py:272-288``: bf16 exponent field = code exponent + scale byte - 7),
  so every exponent-0 code (zero included) reads as ``(1 + m/8) * 2**-7 * scale``:
  ``fp8_decode=exp0_as_normal`` (vLLM's CPU decode reads them the same way); P in bf16
  (``S_shared``), ``TL_ENABLE_FAST_MATH`` exp2; LSE natural and sink-free (``:832-838``).
"""

from __future__ import annotations

import os
import shutil
from typing import Callable

import torch

from dsv4_numerics.reference.cases import Case
from dsv4_numerics.reference.constants import HEAD_DIM, RECORD_BYTES, ROPE_DIM, ROPE_OFFSET
from dsv4_numerics.reference.errors import INDEX_DTYPES, UnsupportedCase, check_dtype, check_int, check_rank, fail
from dsv4_numerics.reference.policies import (
    Fp8Decode,
    Fp8Flavour,
    NonFinite,
    Nvfp4ScaleRule,
    RopeArithmetic,
    ScaleRule,
    SlotSkip,
    V41Layout,
    V41Record,
)

from dsv4_numerics.kernels import probe as P
from dsv4_numerics.kernels.op_call import OpCall, pages_like, python_loader
from dsv4_numerics.kernels.registry import KernelEntry

SGLANG_VERSION = "0.5.23"
STORE_MODULE = "sglang.kernels.ops.attention.dsv4.attn"
ROPE_MODULE = "sglang.kernels.ops.attention.dsv4.norm_rope"
TILELANG_MODULE = "sglang.kernels.ops.attention.dsv4.tilelang_fp8_attention"

# Page alignment (bytes) per SGLang layout, kv_layout.cuh KVLayoutTraits::kPageAlign; the
# interleaved V4.1 layouts align to one record (no padding).
PAGE_ALIGN = {"v4": 576, "v41": 512, "v41_fp4": 256, "v41_new": 528, "v41_fp4_new": 288}
RECORD = {"v4": RECORD_BYTES, "v41": 528, "v41_fp4": 288, "v41_new": 528, "v41_fp4_new": 288}


# --------------------------------------------------------------------------- probes


def _stage_hint(module: str) -> str:
    return (f"SGLang {SGLANG_VERSION} kernels not staged ({module} not importable): run `dsv4-numerics "
            f"stage-sglang --wheel sglang-{SGLANG_VERSION}-*.whl DEST` and add DEST to DSV4_STAGED")


def staged_reason(module: str) -> str | None:
    """The staged SGLang file ``module`` can be found (without importing it)."""
    return None if P.module_reason(module) is None else _stage_hint(module)


def nvcc_path() -> str | None:
    """The nvcc SGLang's JIT would run (``SG:kernels/jit/utils/compile/toolchain.py:43-88``:
    ``$CUDA_HOME`` or ``$CUDA_PATH``, else the ``nvcc`` on ``PATH``), or None."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home:
        path = os.path.join(home, "bin", "nvcc")
        return path if os.path.isfile(path) else None
    return shutil.which("nvcc")


def nvcc_reason() -> str | None:
    if nvcc_path() is not None:
        return None
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    where = f"{home}/bin/nvcc does not exist" if home else "no nvcc on PATH and CUDA_HOME/CUDA_PATH unset"
    return f"nvcc not found ({where}): SGLang's JIT kernels are compiled with nvcc at first use"


def ninja_reason() -> str | None:
    if shutil.which("ninja") is not None:
        return None
    return "ninja not found on PATH: SGLang's JIT builds run `ninja -f build.ninja` (SG:kernels/jit/utils/compile/ninja.py)"


def wheel_hint(module: str, dist: str) -> Callable[[], "str | None"]:
    def probe() -> str | None:
        reason = P.module_reason(module, dist)
        if reason is None:
            return None
        return (f"{reason}: install the carried wheels into the staged folder's site/ "
                "(`dsv4-numerics stage-vllm DEST --site-wheels WHEELS/`)")

    return probe


_JIT_ARCHS = ("sm90", "sm100", "sm103", "sm120", "sm121")
# SGLang calls the TileLang decode only from its ROCm backend (``srt/layers/attention/hip_flash_mla.py``),
# and on an H200 (sm90) tilelang 0.1.12 cannot build it: "Check failed: src_info.order < dst_info.order
# (6 vs. 4): two statements with buffer access dependency in the same stage of the software pipeline
# cannot be reordered" (TVM's software-pipeline planner, every default decode case).
_TILELANG_ARCHS = ("gfx942", "gfx950")


def _jit_probe(module: str) -> P.Probe:
    return P.chain(
        P.needs_arch(*_JIT_ARCHS),
        lambda: staged_reason(module),
        nvcc_reason,
        ninja_reason,
        wheel_hint("tvm_ffi", "apache-tvm-ffi"),
        wheel_hint("msgspec", "msgspec"),
        P.needs_import(module),
    )


_TILELANG_PROBE = P.chain(
    P.needs_arch(*_TILELANG_ARCHS),
    lambda: staged_reason(TILELANG_MODULE),
    wheel_hint("tvm_ffi", "apache-tvm-ffi"),
    wheel_hint("tilelang", "tilelang"),
    P.needs_import(TILELANG_MODULE),
)


def jit_module(name: str):
    from importlib import import_module

    return import_module(name)


# --------------------------------------------------------------------------- pure conversions


def kv_page_bytes(layout: str, block_size: int) -> int:
    """``kv_layout.cuh`` ``kv_page_bytes``: ``bs * R`` rounded up to the layout's page alignment."""
    check_int("kv_page_bytes", "block_size", block_size, minimum=1)
    if layout not in PAGE_ALIGN:
        fail("kv_page_bytes", "layout", f"must be one of {sorted(PAGE_ALIGN)}", layout)
    a = PAGE_ALIGN[layout]
    return -(-block_size * RECORD[layout] // a) * a


def check_pow2_pages(block_size: int, who: str) -> None:
    """``UnsupportedCase`` unless ``block_size`` is a power of two (the kernels' template gate)."""
    if block_size < 1 or block_size & (block_size - 1):
        raise UnsupportedCase(f"{who} is compiled per page size and needs a power of two "
                              f"(store.cuh static_assert has_single_bit); this case has {block_size}")


def exact_stride_pages(pages: torch.Tensor, used: int, page_bytes: int) -> tuple[torch.Tensor, Callable[[], None]]:
    """A ``[num_blocks, page_bytes]`` contiguous uint8 buffer for a store that verifies
    ``stride(0) == page_bytes``, and ``finish()`` that copies its first ``used`` bytes per page back
    into ``pages`` (a ``[num_blocks, P]`` page view the caller owns). ``pages`` itself is returned
    when it already has that stride."""
    fn = "exact_stride_pages"
    check_rank(fn, "pages", pages, 2)
    check_int(fn, "used", used, minimum=1)
    check_int(fn, "page_bytes", page_bytes, minimum=used)
    if pages.stride() == (page_bytes, 1) and pages.shape[1] == page_bytes:
        return pages, lambda: None
    nb = pages.shape[0]
    buf = torch.zeros((nb, page_bytes), dtype=torch.uint8, device=pages.device)
    buf[:, :used] = pages[:, :used]

    def finish() -> None:
        pages[:, :used] = buf[:, :used]

    return buf, finish


def written_rows(k: torch.Tensor, slot_mapping: torch.Tensor, fn: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows bf16 [W, 512] contiguous, slots int64 [W])``: the tokens with a slot ``>= 0`` (the
    canonical skip; the stores have none). ``slot_mapping [L <= N]`` aligns with ``k``'s first rows."""
    check_dtype(fn, "k", k, (torch.bfloat16,))
    check_rank(fn, "k", k, 2)
    if k.shape[1] != HEAD_DIM:
        fail(fn, "k", f"must have shape [N, {HEAD_DIM}]", tuple(k.shape))
    check_dtype(fn, "slot_mapping", slot_mapping, INDEX_DTYPES)
    check_rank(fn, "slot_mapping", slot_mapping, 1)
    if slot_mapping.shape[0] > k.shape[0]:
        fail(fn, "slot_mapping", f"must not be longer than k (N = {k.shape[0]})", slot_mapping.shape[0])
    s = slot_mapping.to(torch.int64)
    keep = s >= 0
    return k[: s.shape[0]][keep].contiguous(), s[keep].contiguous()


def store_args(inputs: dict, layout: str) -> dict:
    """Canonical ``swa_write`` (``layout="v4"``) or ``v41_write`` inputs -> the arguments of
    ``fused_store_cache``: ``input`` bf16 ``[W, 512]``, ``cache`` ``[nb, kv_page_bytes]`` (a copy of
    the case's pages, repacked when its stride differs), ``indices`` int64 ``[W]``, ``page_size``,
    ``layout``, and ``_finish()`` returning the written cache in the input's own form."""
    from dsv4_numerics.kernels.convert import paged_cache_2d
    from dsv4_numerics.reference.storage import clone_storage

    fn = "sglang_jit.store_args"
    bs = check_int(fn, "block_size", inputs["block_size"], minimum=1)
    check_pow2_pages(bs, "SGLang's fused_store_cache")
    cache = inputs["cache"]
    out = clone_storage(cache)
    if layout == "v4":
        pages = paged_cache_2d(out, bs)
    else:
        check_dtype(fn, "cache", cache, (torch.uint8,))
        check_rank(fn, "cache", cache, 2)
        if cache.stride(1) != 1 or cache.shape[1] < bs * RECORD[layout]:
            fail(fn, "cache", f"must be [num_blocks, >= {bs * RECORD[layout]}] with unit byte stride",
                 f"shape {tuple(cache.shape)} strides {cache.stride()}")
        pages = out
    buf, finish = exact_stride_pages(pages, bs * RECORD[layout], kv_page_bytes(layout, bs))
    rows, slots = written_rows(inputs["k"], inputs["slot_mapping"], fn)

    def done() -> torch.Tensor:
        finish()
        return out

    return dict(input=rows, cache=buf, indices=slots, page_size=bs, layout=layout, _finish=done)


def v41_layout_name(record: str, interleaved: bool) -> str:
    """SGLang's ``KVLayout`` value for a V4.1 record in one byte order."""
    if record not in (V41Record.MXFP8.value, V41Record.NVFP4.value):
        fail("v41_layout_name", "record", f"must be one of {[r.value for r in V41Record]}", record)
    base = "v41" if record == V41Record.MXFP8.value else "v41_fp4"
    return base + "_new" if interleaved else base


def rope_args(inputs: dict, inverse: bool) -> dict:
    """Canonical ``rope`` inputs -> ``fused_rope_inplace`` arguments: ``q`` the RoPE lanes
    ``[B, H, 64]`` (a view of ``_x``, a bf16 copy of ``x`` viewed ``[B, H, 512]``), ``freqs_cis``
    complex64 ``[max_pos, 32]`` with ``cos_j + i sin_j``, ``positions`` int64 ``[B]``."""
    fn = "sglang_jit.rope_args"
    if bool(inputs.get("inverse", False)) != inverse:
        raise UnsupportedCase(f"this entry runs {'inverse' if inverse else 'forward'} RoPE cases only "
                              "(the two directions contract differently, module docstring)")
    x, pos, cs = inputs["x"], inputs["positions"], inputs["cos_sin"]
    if x.dtype != torch.bfloat16:
        raise UnsupportedCase(f"fused_rope_inplace rotates bf16 in place; this case's x is {x.dtype}")
    check_dtype(fn, "positions", pos, INDEX_DTYPES)
    check_dtype(fn, "cos_sin", cs, (torch.float32,))
    if x.dim() < 2 or x.shape[-1] != HEAD_DIM or cs.dim() != 2 or cs.shape[1] != ROPE_DIM:
        fail(fn, "x,cos_sin", f"must be x [..., {HEAD_DIM}] and cos_sin [max_pos, {ROPE_DIM}]",
             f"{tuple(x.shape)}, {tuple(cs.shape)}")
    if tuple(pos.shape) != tuple(x.shape[: pos.dim()]):
        fail(fn, "positions", f"must have a shape that is a prefix of x.shape[:-1] = {list(x.shape[:-1])}",
             tuple(pos.shape))
    b = pos.numel()
    x3 = x.contiguous().clone().reshape(b, -1, HEAD_DIM)
    half = ROPE_DIM // 2
    freqs = torch.view_as_complex(torch.stack((cs[:, :half], cs[:, half:]), dim=-1).contiguous())
    return dict(q=x3[..., ROPE_OFFSET:], freqs_cis=freqs, positions=pos.reshape(b).to(torch.int64).contiguous(),
                inverse=inverse, _x=x3, _shape=tuple(x.shape))


# --------------------------------------------------------------------------- calls


def store_op(case: Case, layout: str) -> OpCall:
    """Canonical write case -> the ``fused_store_cache(input, cache, indices, page_size=,
    type="flashmla", layout=)`` call; ``cache`` (arg 1, the exact-stride page buffer) is written in
    place. For ``layout="v4"`` the reproducer compares it bit for bit over the defined bytes of
    the written slots (the 584-byte record; the pad byte is never written)."""
    a = store_args(case.inputs, layout)
    bs, buf = a["page_size"], a["cache"]
    call = OpCall(op=f"{STORE_MODULE}.fused_store_cache", fn=jit_module(STORE_MODULE).fused_store_cache,
                  loader=python_loader("sglang", STORE_MODULE, "fused_store_cache"),
                  args=[a["input"], buf, a["indices"]],
                  kwargs={"page_size": bs, "type": "flashmla", "layout": a["layout"]},
                  outputs={"cache": ("arg", 1)}, finish=lambda ret: {"cache": a["_finish"]()})
    if layout == "v4":
        from dsv4_numerics.kernels.convert import paged_cache_2d
        from dsv4_numerics.reference.caches import model1

        def masks(exp: dict, c: Case) -> dict:
            defined = model1.defined_byte_mask(exp["cache"], c.inputs["slot_mapping"][: c.inputs["k"].shape[0]], bs)
            return {"cache": pages_like(defined, buf, bs)}

        call.to_op = lambda exp: {"cache": pages_like(paged_cache_2d(exp["cache"], bs), buf, bs)}
        call.compare, call.masks = {"cache": "bytes"}, masks
        call.decode, call.meta = {"cache": "model1_584"}, {"block_size": bs}
    return call


def _store_call(layout_of: Callable[[dict], str]):
    def call(case: Case) -> dict:
        return store_op(case, layout_of(case.inputs)).run()

    return call


def _rope_call(inverse: bool):
    def call(case: Case) -> dict:
        a = rope_args(case.inputs, inverse)
        jit_module(ROPE_MODULE).fused_rope_inplace(a["q"], None, a["freqs_cis"], a["positions"], inverse=a["inverse"])
        return {"out": a["_x"].reshape(a["_shape"])}

    return call


def _tilelang_pages(d) -> None:
    for seg, name in ((d.main, "SWA"), (d.extra, "compressed")):
        if seg is not None:
            check_pow2_pages(seg.block_size, f"SGLang's TileLang decode ({name} cache)")


def tilelang_decode_call(case: Case) -> dict:
    """Canonical ``decode`` case -> ``{"out", "lse"}`` through ``dpsk_v4_fp8_attention_fwd``,
    driven as FlashMLA's decode (``flashmla.sparse_decode_call``; module docstring)."""
    from dsv4_numerics.kernels.flashmla.sparse import sparse_decode_call

    fwd = jit_module(TILELANG_MODULE).dpsk_v4_fp8_attention_fwd
    return sparse_decode_call(case, 1, attend=fwd, who="SGLang's TileLang decode", check=_tilelang_pages,
                              fn="sglang.tilelang_decode")


# --------------------------------------------------------------------------- entries

_SOURCE = "sglang.kernels.ops.attention.dsv4"
_STORE_NOTES = ("JIT-compiled per (page size, dtypes, layout) at first use (nvcc, tens of seconds each); "
                "tokens with negative slots dropped (the store has no skip); pages repacked to "
                "kv_page_bytes when the case's stride differs. ")


def _v41_store(interleaved: bool) -> KernelEntry:
    order = V41Layout.INTERLEAVED if interleaved else V41Layout.PAGE_FOOTER
    suffix = "v41_interleaved" if interleaved else "v41_footer"
    return KernelEntry(
        name=f"sglang.store_jit.{suffix}",
        stage="v41_write",
        family="sglang",
        source=f"{_SOURCE}.attn.fused_store_cache (layout={'V41_NEW/V41_FP4_NEW' if interleaved else 'V41/V41_FP4'})",
        archs=_JIT_ARCHS,
        dtypes=("bfloat16",),
        policies={"v41_layout": order.value, "scale_rule": ScaleRule.SCALE_CLAMP.value,
                  "nvfp4_rule": Nvfp4ScaleRule.DIV_RN.value, "nonfinite": NonFinite.FINITE.value},
        tolerance_scope=f"sglang.store_jit.{suffix}",
        probe=_jit_probe(STORE_MODULE),
        call=_store_call(lambda inp: v41_layout_name(inp["record"], interleaved)),
        notes=_STORE_NOTES + "MXFP8 records Q_S (floor byte 114), NVFP4 scale __fdiv_rn(amax, 6).",
    )


ENTRIES: list[KernelEntry] = [
    KernelEntry(
        name="sglang.store_jit",
        stage="swa_write",
        family="sglang",
        source=f"{_SOURCE}.attn.fused_store_cache (type=flashmla, layout=V4; jit/csrc/deepseek_v4/store.cuh)",
        archs=_JIT_ARCHS,
        dtypes=("bfloat16",),
        policies={"scale_rule": ScaleRule.AMAX_CLAMP.value, "fp8": Fp8Flavour.E4M3FN.value,
                  "nonfinite": NonFinite.SGLANG_JIT.value, "slot_skip": SlotSkip.ALL_NEGATIVE.value},
        tolerance_scope="sglang.store_jit",
        probe=_jit_probe(STORE_MODULE),
        call=_store_call(lambda inp: "v4"),
        notes=_STORE_NOTES + "The pad byte (8th scale byte) is never written.",
    ),
    _v41_store(False),
    _v41_store(True),
    KernelEntry(
        name="sglang.rope_jit",
        stage="rope",
        family="sglang",
        source=f"{_SOURCE}.norm_rope.fused_rope_inplace (inverse=False; jit/csrc/deepseek_v4/rope.cuh)",
        archs=_JIT_ARCHS,
        dtypes=("bfloat16",),
        policies={"rope_arith": RopeArithmetic.FMA.value},
        tolerance_scope="sglang.rope_jit",
        probe=_jit_probe(ROPE_MODULE),
        call=_rope_call(False),
        notes="Forward cases only; bf16 in place on the 64 RoPE lanes of a copy.",
    ),
    KernelEntry(
        name="sglang.rope_jit.inverse",
        stage="rope",
        family="sglang",
        source=f"{_SOURCE}.norm_rope.fused_rope_inplace (inverse=True; jit/csrc/deepseek_v4/rope.cuh)",
        archs=_JIT_ARCHS,
        dtypes=("bfloat16",),
        policies={"rope_arith": RopeArithmetic.FMA_TRITON.value},
        tolerance_scope="sglang.rope_jit",
        probe=_jit_probe(ROPE_MODULE),
        call=_rope_call(True),
        notes="Inverse cases only: o' = o*cos - e*sin contracts o*cos (FMA_TRITON's inverse form).",
    ),
    KernelEntry(
        name="sglang.tilelang_decode",
        stage="decode",
        family="sglang",
        source=f"{_SOURCE}.tilelang_fp8_attention.dpsk_v4_fp8_attention_fwd (TileLang, MODEL1)",
        archs=_TILELANG_ARCHS,
        dtypes=("bfloat16", "uint8"),
        policies={"lse": "natural_sinkfree", "nan": "propagate", "output_inv_roped": "false",
                  "index_rule": "minus1_only", "fp8_decode": Fp8Decode.EXP0_AS_NORMAL.value},
        tolerance_scope="flashmla.sparse_decode",
        probe=_TILELANG_PROBE,
        call=tilelang_decode_call,
        notes="SGLang's ROCm decode (hip_flash_mla.py); on sm90 tilelang 0.1.12 fails to build it (pipeline "
              "planner check, _TILELANG_ARCHS). Driven as flashmla.sparse_decode.sm90 (same tolerance records: "
              "bf16 P, fp32 accumulation); power-of-two page sizes only; exponent-0 FP8 codes read as normals.",
    ),
]


# entry name -> ``(case) -> OpCall`` (``kernels.op_call``): the calls a standalone reproducer makes
OP_CALLS = {"sglang.store_jit": lambda case: store_op(case, "v4")}


# The releases each entry is written for (``KernelEntry.releases``, set by ``registry.assemble``), from the survey (``python -m
# dsv4_numerics.staging.survey``): ``fused_store_cache`` takes ``layout`` / ``freqs_cis`` from 0.5.21
# (``KVLayout.V41`` there; ``V41_NEW`` from 0.5.23); the rope and TileLang modules from 0.5.23.
RELEASE_RANGES = {
    "sglang.store_jit": "sglang>=0.5.21",
    "sglang.store_jit.v41_footer": "sglang>=0.5.21",
    "sglang.store_jit.v41_interleaved": "sglang>=0.5.23",
    "sglang.rope_jit": "sglang>=0.5.23",
    "sglang.rope_jit.inverse": "sglang>=0.5.23",
    "sglang.tilelang_decode": "sglang>=0.5.23",
}
