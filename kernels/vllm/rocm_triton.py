"""Adapters for vLLM 0.33.0's ROCm Triton sparse attention and ragged index builders
(``vllm/v1/attention/ops/rocm_aiter_mla_sparse.py``, ``vllm/models/deepseek_v4/amd/rocm.py``;
spec README 5, datapath 3, 4.5, 4.7, 4.9; attention 1.2, 2.2-2.7, 3.3, 4.1, 5).

These kernels are Triton and run on NVIDIA GPUs too (archs ``gfx942``, ``gfx950``, ``any-gpu``).
What a non-ROCm GPU exercises is architecture-specific, and the entries say so:

* ``rocm_sparse_attn_decode`` dispatches on ``_ON_GFX942 or _ON_GFX950``
  (``rocm_aiter_mla_sparse.py:4141``). Off ROCm it takes the "fallback path for un-tuned
  architectures": ONE single-pass kernel, ``_sparse_attn_decode_ragged_kernel`` (``:2468-2702``),
  with no split-K and no reduce kernel, so **the fused inverse RoPE is silently skipped**
  (``inv_rope_positions`` only reaches ``_sparse_attn_decode_reduce_kernel``, ``:4315-4348``)
  while the wrapper still returns ``output.shape[0]`` rotated rows (``:4658``). The
  ``.inv_rope`` entry runs exactly that call, so on NVIDIA it is expected to fail the inverse-RoPE
  judgement: a real divergence of the production wrapper, reported, not hidden.
* The ``.splitk`` entries run the same public wrapper with the module flag ``_ON_GFX942`` set
  True for the duration of the call (and restored): that is the gfx942 dispatch -- split-K
  partial kernel ``_sparse_attn_decode_partial_kernel`` (``:2705-2940``) + reduce (``:3371-3530``)
  with the fused inverse RoPE in the reduce epilogue -- on an OCP cache (``is_fp8_fnuz()`` stays
  False off gfx942, so ``IS_FNUZ_MAIN`` is False). The gfx950 partial kernel (exp2, exact UE8M0
  loader, ``:2942-3340``) and the MXFP8 output epilogue are gfx950-only and not exercised here.

Semantics the entries declare (read from the kernels):

* validity: slot valid iff ``0 <= slot < num_rows`` inside the row's prefix (dense) or ragged
  range (``:2208-2215``, ``:2538-2542``), so ``index_rule = any_out_of_range_invalid``;
* decode scrubs NaN K/V elements to 0 even in valid rows (``k == k ? k : 0``, ``:2568,2577``):
  ``nan = scrub``; **prefill does not** (``_sparse_attn_prefill_ragged_kernel`` loads bf16 rows
  masked only by validity, ``:2217-2223``): ``nan = propagate``;
* no LSE is returned (``lse = none``); bf16 P for P@V with an fp32 row sum: ``attention_mode =
  bf16_p``; decode dequantises ``code.to(bf16) * exp2(s - 127).to(bf16)`` (``ue8m0 =
  rocm_triton``: byte 0 -> 0, 255 -> +Inf).

Conversions follow the call sites ``amd/rocm.py:1559-1585`` (decode: the layers' caches as the
``[num_blocks, bs, 584]`` kernel views, int32 index tensors, ``attn_sink`` fp32, the query
``positions`` int64 and ``rotary_emb.cos_sin_cache`` fp32 for the fused inverse RoPE) and
``:1640-1728`` (prefill: ``kv.view(-1, 1, 512)``, combined int32 indices + ``topk_length``,
caller-allocated bf16 ``output``). Ragged variants feed index streams built by the reference's
``build_ragged_indices_from_dense`` (the production builder's exact semantics, datapath 4.7), so
they judge the attention kernels alone; the builders have their own entries (stage
``rocm_ragged``).

``amd/rocm.py`` (the ROCm combine and ``compute_global_topk_ragged_indices_and_indptr``) imports
the ROCm platform and the engine: ``dsv4-numerics stage-vllm --parts engine`` stages it with
placeholder stand-ins for the engine names (they raise if used) and an NVIDIA platform
(``_ON_GFX950`` False), so both Triton builders run from the staged folder on any GPU.
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Any, Callable

import torch

from dsv4_numerics.reference.cases import Case
from dsv4_numerics.reference.constants import HEAD_DIM, NOPE_DIM, ROPE_DIM
from dsv4_numerics.reference.errors import UnsupportedCase, check_dtype, check_int, fail
from dsv4_numerics.reference.indices.rocm import build_ragged_indices_from_dense as ref_ragged_from_dense
from dsv4_numerics.reference.policies import (
    AttentionMode,
    Fp8Flavour,
    IndexRule,
    LseConvention,
    MissingLengths,
    NanPolicy,
    RopeArithmetic,
    Ue8m0Consumer,
)

from dsv4_numerics.kernels.canonical import decode_inputs, prefill_inputs
from dsv4_numerics.kernels.op_call import OpCall, python_loader
from dsv4_numerics.kernels.registry import KernelEntry
from dsv4_numerics.kernels.convert import TRITON_PAGE_ALIGN, readable_pages
from dsv4_numerics.kernels.vllm.triton import bool_flags, index_case_builder, int32, staged_triton_probe

__all__ = [
    "ENTRIES",
    "ROCM_OPS",
    "ROCM_LAYER",
    "trim_ragged",
    "prefill_args",
    "decode_args",
    "prefill_op",
    "decode_op",
    "OP_CALLS",
    "ragged_from_dense_args",
    "prefill_topk_ragged_args",
    "gfx942_dispatch",
]

ROCM_OPS = "vllm.v1.attention.ops.rocm_aiter_mla_sparse"
ROCM_LAYER = "vllm.models.deepseek_v4.amd.rocm"


# --------------------------------------------------------------------------- conversions


def trim_ragged(flat: torch.Tensor, indptr: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The production ragged builders return a ``T * width`` scratch of which only the first
    ``indptr[-1]`` entries are written (``rocm_aiter_mla_sparse.py:2126-2140``): the canonical
    output (``reference.indices.rocm``) is that prefix."""
    n = int(indptr[-1]) if indptr.numel() else 0
    return flat[:n], indptr


def _sink(fn: str, sink: torch.Tensor | None) -> torch.Tensor | None:
    return None if sink is None else sink.to(torch.float32).contiguous()


def prefill_args(inputs_or_case: Any, ragged: bool) -> dict:
    """Canonical ``prefill`` inputs -> ``rocm_sparse_attn_prefill`` keyword arguments.

    ``kv [S, 512]`` -> ``[S, 1, 512]`` (``rocm.py:1719``: ``kv.view(-1, 1, q.shape[-1])``);
    dense form: int32 ``indices [T, K]`` + int32 ``topk_length [T]`` (the combine's outputs);
    ragged form: ``ragged_indices``/``ragged_indptr`` from the reference builder with
    ``num_rows = S`` (what ``_rocm_sparse_attn_prefill_triton`` builds, ``:3621-3628``), and
    ``indices``/``topk_length`` None. ``output`` is a caller-allocated bf16 ``[T, H, 512]``
    filled with NaN, so a row the kernel does not write cannot pass as zero.
    """
    fn = "rocm_triton.prefill_args"
    case = inputs_or_case if isinstance(inputs_or_case, Case) else Case("-", "prefill", inputs_or_case)
    p = prefill_inputs(case, fn)
    S = p.kv.shape[0]
    idx = int32(fn, "indices", p.idx)
    lens = None if p.length is None else int32(fn, "topk_length", p.length)
    out = torch.full(tuple(p.q.shape), float("nan"), dtype=torch.bfloat16, device=p.q.device)
    a = dict(q=p.q.contiguous(), kv=p.kv.contiguous().view(S, 1, HEAD_DIM), indices=idx, topk_length=lens,
             scale=p.scale, head_dim=HEAD_DIM, nope_head_dim=NOPE_DIM, rope_head_dim=ROPE_DIM,
             attn_sink=_sink(fn, p.sink), output=out, ragged_indices=None, ragged_indptr=None)
    if ragged:
        ln = lens if lens is not None else (idx >= 0).sum(dim=-1, dtype=torch.int32)
        ri, rp = ref_ragged_from_dense(idx.cpu(), ln.cpu(), num_rows=S)
        a.update(ragged_indices=ri.to(idx.device), ragged_indptr=rp.to(idx.device), indices=None,
                 topk_length=None)
    return a


def _inv_rope_table(fn: str, inputs: dict) -> torch.Tensor:
    for key in ("cos_sin", "cos_sin_cache", "inv_rope_cos_sin_cache"):
        if inputs.get(key) is not None:
            cs = inputs[key]
            check_dtype(fn, key, cs, (torch.float32,))
            if cs.dim() != 2 or cs.shape[1] != ROPE_DIM:
                fail(fn, key, f"must be fp32 [max_pos, {ROPE_DIM}] = [cos(32) | sin(32)]", tuple(cs.shape))
            return cs.contiguous()
    raise UnsupportedCase("decode case carries no cos/sin table ('cos_sin'): the fused inverse "
                          "RoPE needs rotary_emb.cos_sin_cache")


def decode_args(case: Case, ragged: bool, inv_rope: bool) -> dict:
    """Canonical ``decode`` inputs -> ``rocm_sparse_attn_decode`` keyword arguments.

    Caches: the ``[num_blocks, bs, 584]`` kernel views (read only; the case's bytes, repacked only
    for an odd page stride, ``readable_pages``), SWA = main,
    compressed = extra (``kv_cache``), ``swa_only`` when there is no extra segment. Dense form:
    int32 ``swa_indices``/``swa_lens`` and ``topk_indices``/``topk_lens``. Ragged form: streams
    from the reference builder with ``num_rows = -1`` (the metadata builders' call,
    ``amd/rocm.py:680-684,775-781``); ``topk_indices`` None and ``topk_lens`` kept, as the C4
    decode path passes them (``:1521-1530``). ``inv_rope``: ``inv_rope_positions`` = the query
    positions (int64) and the case's cos/sin table. ``output``: bf16 ``[T, H, 512]`` filled with
    NaN. ``_rotated_expected``: the row count the wrapper should return.
    """
    fn = "rocm_triton.decode_args"
    d = decode_inputs(case, fn)
    t = d.q.shape[0]
    main, extra = d.main, d.extra
    swa_idx = int32(fn, "swa_indices", main.idx)
    swa_len = None if main.length is None else int32(fn, "swa_lens", main.length)
    if swa_len is None:  # the wrapper requires swa_lens; a missing length means "all K columns"
        swa_len = torch.full((t,), swa_idx.shape[1], dtype=torch.int32, device=swa_idx.device)
    a: dict[str, Any] = dict(
        q=d.q.contiguous(), kv_cache=None, swa_k_cache=readable_pages(main.cache, main.block_size, TRITON_PAGE_ALIGN),
        swa_only=extra is None, topk_indices=None, topk_lens=None, swa_indices=swa_idx, swa_lens=swa_len,
        swa_ragged_indices=None, swa_ragged_indptr=None, topk_ragged_indices=None, topk_ragged_indptr=None,
        attn_sink=_sink(fn, d.sink), scale=d.scale, head_dim=HEAD_DIM, nope_head_dim=NOPE_DIM,
        rope_head_dim=ROPE_DIM,
        output=torch.full(tuple(d.q.shape), float("nan"), dtype=torch.bfloat16, device=d.q.device),
        extra_cache_nan_free=False, adaptive_splits=False, inv_rope_positions=None,
        inv_rope_cos_sin_cache=None,
    )
    if extra is not None:
        a["kv_cache"] = readable_pages(extra.cache, extra.block_size, TRITON_PAGE_ALIGN)
        a["topk_indices"] = int32(fn, "extra_indices", extra.idx)
        # a missing length means "all K columns", as for the SWA segment above: the wrapper's own
        # None default reads the COUNT of non-negative indices as a prefix length
        # (rocm_aiter_mla_sparse.py:4386-4390, MissingLengths.COUNT_AS_PREFIX), which drops valid
        # indices past an interior -1; vLLM's call always passes lengths. That default is judged
        # (declared) on the prefill rows, which pass a missing length through.
        a["topk_lens"] = (torch.full((t,), a["topk_indices"].shape[1], dtype=torch.int32, device=a["topk_indices"].device)
                          if extra.length is None else int32(fn, "extra_lens", extra.length))
    if ragged:
        ri, rp = ref_ragged_from_dense(swa_idx.cpu(), swa_len.cpu(), num_rows=-1)
        a.update(swa_ragged_indices=ri.to(swa_idx.device), swa_ragged_indptr=rp.to(swa_idx.device))
        if extra is not None:
            eidx = a["topk_indices"]
            eln = a["topk_lens"]  # never None: a missing length is all K columns (above)
            ri, rp = ref_ragged_from_dense(eidx.cpu(), eln.cpu(), num_rows=-1)
            a.update(topk_ragged_indices=ri.to(eidx.device), topk_ragged_indptr=rp.to(eidx.device),
                     topk_indices=None, topk_lens=eln)
    if inv_rope:
        if d.positions is None:
            raise UnsupportedCase("decode case carries no 'positions': the fused inverse RoPE needs them")
        a["inv_rope_positions"] = d.positions.to(torch.int64).contiguous()
        a["inv_rope_cos_sin_cache"] = _inv_rope_table(fn, case.inputs)
        pos = a["inv_rope_positions"]
        if t and (int(pos.min()) < 0 or int(pos.max()) >= a["inv_rope_cos_sin_cache"].shape[0]):
            fail(fn, "positions", f"must index rows of the cos/sin table [0, "
                 f"{a['inv_rope_cos_sin_cache'].shape[0]})")
    a["_rotated_expected"] = t if inv_rope else 0
    return a


def ragged_from_dense_args(inputs: dict) -> dict:
    """``build_ragged_indices_from_dense(indices, lengths, num_rows=-1)`` inputs: int32 dense
    rows (the metadata builders' buffers), lengths int32, ``num_rows`` int."""
    fn = "rocm_triton.ragged_from_dense_args"
    n = inputs.get("num_rows", -1)
    if isinstance(n, bool) or not isinstance(n, int):
        fail(fn, "num_rows", "must be an int (-1 = no upper bound)", n)
    return dict(indices=int32(fn, "indices", inputs["indices"]), lengths=int32(fn, "lengths", inputs["lengths"]),
                num_rows=n)


def prefill_topk_ragged_args(inputs: dict) -> dict:
    """``build_prefill_topk_ragged_indices`` inputs with vLLM's dtypes: int32 index tensors,
    bool ``is_valid_token``, ints ``block_size``, ``compress_ratio``, ``num_compressed``,
    ``token_offset``, ``num_rows``."""
    fn = "rocm_triton.prefill_topk_ragged_args"
    out = {k: int32(fn, k, inputs[k]) for k in ("topk_indices", "token_to_req_indices", "query_start_loc",
                                               "seq_lens", "block_table")}
    out["is_valid_token"] = bool_flags(fn, "is_valid_token", inputs["is_valid_token"])
    for k in ("block_size", "compress_ratio"):
        out[k] = check_int(fn, k, inputs[k], minimum=1)
    for k in ("num_compressed", "token_offset"):
        out[k] = check_int(fn, k, inputs[k], minimum=0)
    n = inputs.get("num_rows", -1)
    if isinstance(n, bool) or not isinstance(n, int):
        fail(fn, "num_rows", "must be an int", n)
    out["num_rows"] = n
    return out


def _layer_topk_ragged_args(inputs: dict) -> dict:
    fn = "rocm_triton.topk_ragged_args"
    return dict(topk_indices=int32(fn, "topk_indices", inputs["topk_indices"]),
                token_to_req_indices=int32(fn, "token_to_req_indices", inputs["token_to_req_indices"]),
                block_table=int32(fn, "block_table", inputs["block_table"]),
                block_size=check_int(fn, "block_size", inputs["block_size"], minimum=1),
                is_valid_token=bool_flags(fn, "is_valid_token", inputs["is_valid_token"]))


def _layer_combine_args(inputs: dict) -> dict:
    from dsv4_numerics.kernels.vllm.triton import combine_args

    a = combine_args(inputs)
    a.setdefault("max_image_tokens", 0)
    return a


# --------------------------------------------------------------------------- calls


def _mod(name: str):
    return importlib.import_module(name)


@contextlib.contextmanager
def gfx942_dispatch(module: Any):
    """Set ``module._ON_GFX942 = True`` for the duration (restored on exit, also on error), so the
    public decode wrapper takes the gfx942 split-K + reduce path (``:4141``, ``:4169-4348``)."""
    old = module._ON_GFX942
    module._ON_GFX942 = True
    try:
        yield
    finally:
        module._ON_GFX942 = old


def prefill_op(case: Case, ragged: bool) -> OpCall:
    """Canonical ``prefill`` case -> the ``rocm_sparse_attn_prefill(**prefill_args)`` call; the
    ``output`` keyword is written in place (the canonical ``out``)."""
    a = prefill_args(case, ragged)
    return OpCall(op=f"{ROCM_OPS}.rocm_sparse_attn_prefill", fn=_mod(ROCM_OPS).rocm_sparse_attn_prefill,
                  loader=python_loader("vllm", ROCM_OPS, "rocm_sparse_attn_prefill"), args=[], kwargs=a,
                  outputs={"output": ("kwarg", "output")}, finish=lambda ret: {"out": a["output"]},
                  to_op=lambda exp: {"output": exp["out"]}, compare={"output": "numeric"})


def decode_op(case: Case, ragged: bool, inv_rope: bool) -> OpCall:
    """Canonical ``decode`` case -> the ``rocm_sparse_attn_decode(**decode_args)`` call (the
    wrapper's default dispatch); ``output`` is written in place, the return value is the number of
    rows it reports rotated (``meta["rotated_expected"]``: the number it should)."""
    a = decode_args(case, ragged, inv_rope)
    want = a.pop("_rotated_expected")
    return OpCall(op=f"{ROCM_OPS}.rocm_sparse_attn_decode", fn=_mod(ROCM_OPS).rocm_sparse_attn_decode,
                  loader=python_loader("vllm", ROCM_OPS, "rocm_sparse_attn_decode"), args=[], kwargs=a,
                  outputs={"output": ("kwarg", "output")},
                  finish=lambda ret: {"out": a["output"], "rotated_rows": torch.tensor([int(ret), want], dtype=torch.int64)},
                  to_op=lambda exp: {"output": exp["out"]}, compare={"output": "numeric"},
                  meta={"rotated_expected": want})


def _call_prefill(ragged: bool) -> Callable[[Case], dict]:
    def call(case: Case) -> dict:
        return prefill_op(case, ragged).run()

    return call


def _call_decode(ragged: bool, inv_rope: bool, splitk: bool) -> Callable[[Case], dict]:
    def call(case: Case) -> dict:
        op = decode_op(case, ragged, inv_rope)
        ctx = gfx942_dispatch(_mod(ROCM_OPS)) if splitk else contextlib.nullcontext()
        with ctx:
            return op.run()

    return call


def _call_builder(module: str, func: str, args: Callable[[dict], dict], names: tuple[str, ...],
                  ragged_first: bool, case_builder: str | None = None) -> Callable[[Case], dict]:
    """Run ``module.func`` on the cases built for ``case_builder`` (default: ``func``), the name
    ``reference.cases.index`` records in ``case.params["builder"]``."""

    def call(case: Case) -> dict:
        index_case_builder(case, case_builder or func)
        res = getattr(_mod(module), func)(**args(case.inputs))
        if ragged_first:
            flat, indptr = trim_ragged(res[0], res[1])
            res = (flat, indptr) + tuple(res[2:])
        return dict(zip(names, res))

    return call


_layer_probe = staged_triton_probe(ROCM_LAYER)  # stage-vllm --parts engine


# --------------------------------------------------------------------------- entries

_ARCHS = ("gfx942", "gfx950", "any-gpu")
_probe_ops = staged_triton_probe(ROCM_OPS)
_COMMON = {"index_rule": IndexRule.ANY_OUT_OF_RANGE_INVALID.value, "lse": LseConvention.NONE.value,
           "attention_mode": AttentionMode.BF16_P.value}
_DECODE = {**_COMMON, "nan": NanPolicy.SCRUB.value, "fp8": Fp8Flavour.E4M3FN.value,
           "ue8m0": Ue8m0Consumer.ROCM_TRITON.value, "output_inv_roped": "false"}
_DECODE_ROT = {**_DECODE, "output_inv_roped": "true", "rope_arith": RopeArithmetic.FMA_TRITON.value}
_NVIDIA_PATH = ("Off ROCm the wrapper runs the single-pass fallback kernel _sparse_attn_decode_ragged_kernel "
                "(rocm_aiter_mla_sparse.py:4141-4176); on gfx942/gfx950 the split-K path: results are "
                "architecture-specific.")
_SPLITK = ("_ON_GFX942 forced True for the call: the gfx942 split-K partial + reduce kernels on an OCP "
           "cache (IS_FNUZ_MAIN False). ARCHITECTURE-SPECIFIC off gfx942; the gfx950 exp2 partial "
           "kernel and the MXFP8 epilogue are not exercised.")


def _decode_entry(suffix: str, ragged: bool, inv_rope: bool, splitk: bool, notes: str) -> KernelEntry:
    return KernelEntry(
        name=f"rocm_triton.sparse_decode{suffix}",
        stage="decode",
        family="Triton-ROCm",
        source=f"{ROCM_OPS}.rocm_sparse_attn_decode",
        archs=_ARCHS,
        dtypes=("bfloat16",),
        policies={**(_DECODE_ROT if inv_rope else _DECODE), "dispatch": "gfx942" if splitk else "default",
                  "index_form": "ragged" if ragged else "dense"},
        tolerance_scope="rocm_triton.sparse_decode",
        probe=_probe_ops,
        call=_call_decode(ragged, inv_rope, splitk),
        notes=notes,
    )


ENTRIES: list[KernelEntry] = [
    KernelEntry(
        name="rocm_triton.sparse_prefill",
        stage="prefill",
        family="Triton-ROCm",
        source=f"{ROCM_OPS}.rocm_sparse_attn_prefill",
        archs=_ARCHS,
        dtypes=("bfloat16",),
        policies={**_COMMON, "nan": NanPolicy.PROPAGATE.value, "index_form": "dense",
                  "missing_lengths": MissingLengths.COUNT_AS_PREFIX.value},
        tolerance_scope="rocm_triton.sparse_prefill",
        probe=_probe_ops,
        call=_call_prefill(False),
        notes="Dense combined indices + topk_length; the wrapper compacts them with its own ragged "
              "builder (num_rows = S). No NaN scrub in prefill (unlike decode). On gfx950 with >= 1024 "
              "queries and aiter present the opus kernel replaces Triton; not exercised.",
    ),
    KernelEntry(
        name="rocm_triton.sparse_prefill.ragged",
        stage="prefill",
        family="Triton-ROCm",
        source=f"{ROCM_OPS}.rocm_sparse_attn_prefill(ragged_indices=, ragged_indptr=)",
        archs=_ARCHS,
        dtypes=("bfloat16",),
        policies={**_COMMON, "nan": NanPolicy.PROPAGATE.value, "index_form": "ragged",
                  "missing_lengths": MissingLengths.COUNT_AS_PREFIX.value},
        tolerance_scope="rocm_triton.sparse_prefill",
        probe=_probe_ops,
        call=_call_prefill(True),
        notes="Ragged streams built by the reference's build_ragged_indices_from_dense (num_rows = S).",
    ),
    _decode_entry("", False, False, False, "Dense indices. " + _NVIDIA_PATH),
    _decode_entry(".ragged", True, False, False, "Ragged streams (reference builder). " + _NVIDIA_PATH),
    _decode_entry(".inv_rope", False, True, False,
                  "Fused inverse RoPE requested as vLLM does (inv_rope_positions, rocm.py:1582-1583). "
                  "On NVIDIA the fallback kernel ignores it while the wrapper reports every row "
                  "rotated: expected to FAIL there (rotated_rows output = [returned, requested]). "
                  + _NVIDIA_PATH),
    _decode_entry(".splitk", False, False, True, "Dense indices. " + _SPLITK),
    _decode_entry(".splitk.inv_rope", True, True, True,
                  "Ragged streams, fused inverse RoPE in the reduce epilogue (fp32, before the bf16 "
                  "cast). " + _SPLITK),
    KernelEntry(
        name="rocm_triton.build_ragged_indices_from_dense",
        stage="rocm_ragged",
        family="Triton-ROCm",
        source=f"{ROCM_OPS}.build_ragged_indices_from_dense",
        archs=_ARCHS,
        dtypes=("int32",),
        policies={"ragged": "compacting"},
        tolerance_scope="rocm_triton.build_ragged_indices_from_dense",
        probe=_probe_ops,
        call=_call_builder(ROCM_OPS, "build_ragged_indices_from_dense", ragged_from_dense_args,
                           ("ragged_indices", "indptr"), True),
        notes="Keeps entries with col < len, v >= 0 and v < num_rows (when >= 0), in order (datapath 4.7).",
    ),
    KernelEntry(
        name="rocm_triton.build_prefill_topk_ragged_indices",
        stage="rocm_ragged",
        family="Triton-ROCm",
        source=f"{ROCM_OPS}.build_prefill_topk_ragged_indices",
        archs=_ARCHS,
        dtypes=("int32",),
        policies={"ragged": "compacting"},
        tolerance_scope="rocm_triton.build_prefill_topk_ragged_indices",
        probe=_probe_ops,
        call=_call_builder(ROCM_OPS, "build_prefill_topk_ragged_indices", prefill_topk_ragged_args,
                           ("ragged_indices", "indptr"), True),
        notes="row_len = valid ? min((p+1)//ratio, TOPK) : 0; 0 <= L < num_compressed mapped, then compacted.",
    ),
    KernelEntry(
        name="rocm_triton.compute_global_topk_ragged_indices_and_indptr",
        stage="rocm_ragged",
        family="Triton-ROCm",
        source=f"{ROCM_LAYER}.compute_global_topk_ragged_indices_and_indptr",
        archs=_ARCHS,
        dtypes=("int32",),
        policies={"ragged": "positional"},
        tolerance_scope="rocm_triton.compute_global_topk_ragged_indices_and_indptr",
        probe=_layer_probe,
        call=_call_builder(ROCM_LAYER, "compute_global_topk_ragged_indices_and_indptr", _layer_topk_ragged_args,
                           ("global_topk_ragged", "topk_indptr", "topk_lens"), True),
        notes="Positional (not compacting): a -1 inside the prefix survives (datapath 4.7).",
    ),
    KernelEntry(
        name="rocm_triton.combine_topk_swa_indices",
        stage="combine_prefill",
        family="Triton-ROCm",
        source=f"{ROCM_LAYER}.combine_topk_swa_indices",
        archs=_ARCHS,
        dtypes=("int32",),
        policies={"combine_form": "rocm"},
        tolerance_scope="rocm_triton.combine_topk_swa_indices",
        probe=_layer_probe,
        call=_call_builder(ROCM_LAYER, "combine_topk_swa_indices", _layer_combine_args,
                           ("combined_indices", "combined_lens"), False,
                           case_builder="combine_topk_swa_indices_rocm"),
        notes="Validating twin of the common combine (datapath 4.5); runs the 'combine_topk_swa_indices_rocm' "
              "cases.",
    ),
]


# entry name -> ``(case) -> OpCall`` (``kernels.op_call``): the calls a standalone reproducer can
# make (the ``.splitk`` entries set a module flag around the call, which a reproducer does not)
OP_CALLS = {
    "rocm_triton.sparse_prefill": lambda case: prefill_op(case, False),
    "rocm_triton.sparse_prefill.ragged": lambda case: prefill_op(case, True),
    "rocm_triton.sparse_decode": lambda case: decode_op(case, False, False),
    "rocm_triton.sparse_decode.ragged": lambda case: decode_op(case, True, False),
    "rocm_triton.sparse_decode.inv_rope": lambda case: decode_op(case, False, True),
}


# The releases each entry is written for (``KernelEntry.releases``, set by ``registry.assemble``), from the op signatures (``python -m
# dsv4_numerics.staging.survey``): the decode's ``inv_rope_*`` / ``output_mxfp8`` from 0.31.0, the prefill
# top-k builder from 0.32.0, the ROCm combine's ``left_visible`` from 0.30.0. ``amd/rocm.py`` imports the
# engine in 0.22.x (not staged) and, in 0.23.0-0.27.1, a FlashMLA backend name the engine stand-ins do not
# carry: its ragged builder from 0.28.0.
RELEASE_RANGES = {
    "rocm_triton.sparse_prefill": "vllm>=0.22.0",
    "rocm_triton.sparse_prefill.ragged": "vllm>=0.22.0",
    "rocm_triton.sparse_decode": "vllm>=0.31.0",
    "rocm_triton.sparse_decode.ragged": "vllm>=0.31.0",
    "rocm_triton.sparse_decode.inv_rope": "vllm>=0.31.0",
    "rocm_triton.sparse_decode.splitk": "vllm>=0.31.0",
    "rocm_triton.sparse_decode.splitk.inv_rope": "vllm>=0.31.0",
    "rocm_triton.build_ragged_indices_from_dense": "vllm>=0.22.0",
    "rocm_triton.build_prefill_topk_ragged_indices": "vllm>=0.32.0",
    "rocm_triton.compute_global_topk_ragged_indices_and_indptr": "vllm>=0.28.0",
    "rocm_triton.combine_topk_swa_indices": "vllm>=0.30.0",
}
