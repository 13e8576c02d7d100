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

import torch

from dsv4_numerics.reference.cases import Case
from dsv4_numerics.reference.policies import Fp8Flavour, NonFinite, RopeArithmetic, ScaleRule, SlotSkip

from dsv4_numerics.kernels.probe import arch_reason, first_reason, gpu_info
from dsv4_numerics.kernels.vllm.writer_args import kv_rope_insert_args, plain_write_args, swa_write_args
from dsv4_numerics.kernels.registry import KernelEntry

__all__ = [
    "ENTRIES",
    "OPS",
    "cuda_ops_library_reason",
    "cuda_op",
]

LIBRARY = "_C_stable_libtorch.abi3.so"
OPS = {
    "swa": "fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert",
    "kv_only": "fused_deepseek_v4_kv_rope_insert",
    "bf16": "fused_deepseek_v4_qnorm_rope_kv_rope_full_cache_bf16_insert",
    "fp8": "fused_deepseek_v4_qnorm_rope_kv_rope_full_cache_fp8_insert",
}


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
