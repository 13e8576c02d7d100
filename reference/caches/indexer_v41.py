"""The DeepSeek-V4.1 indexer K cache and its writer ``indexer_k_norm_rope_store`` (vLLM 0.33.0
``models/deepseek_v41/common/ops/indexer_k_store.py``, ``IKS:`` below).

Per token ``t < L = len(slots)`` with ``slots[t] >= 0`` and ``(p_t + 1) % r == 0`` (``r`` the
compress ratio, 1 or 2; ``IKS:164-170``):

1. ``k = bf16(fl32(fl32(x * rrms) * w))``, ``x = k_pre[t]`` bf16 ``[128]``, ``rrms = rsqrt(mean(x**2) +
   eps)`` (``IKS:174-179``; ``query_quant.rms_norm_rows``: bit-exact on exact-norm rows, the only
   rows the cases use: the kernel's ``tl.sum`` tree and ``rsqrt.approx`` are exact there).
2. GPT-J RoPE of ALL 64 pairs in fp32, the 32 NoPE pairs with ``(cos, sin) = (1, 0)``, pair
   ``32 + j`` with ``cos_sin[p_t // r * r, j]`` / ``[.., 32 + j]`` (``IKS:181-205``, contraction
   ``RopeArithmetic``, Triton's ``fma_triton``), each result rounded to bf16.
3. FP8 record (``use_fp4_cache=False``, ``IKS:250-273``): ``e = ceil(log2(fl32(max(amax, 1e-4f) *
   fl32(1/448))))`` over the 128 values (exact ceiling), codes ``e4m3(clamp(y * 2**-e, +-448))``
   RNE, scale fp32 ``2**e`` little-endian. ``mqa_logits_use_mx_scales()`` (DeepGEMM's MX-scale
   logits) replaces the fp32 scale by ``pack_ue8m0_x4``: not modelled (policy
   ``IndexerKScale.FP32`` only).
   MXFP4 record (``use_fp4_cache=True``, ``IKS:222-248``): per 32-dim group ``a = max(amax,
   6 * 2**-126)``, ``l = clamp(ceil(log2(fl32(a * fl32(1/6)))), -127, 127)``, codes ``e2m1(y *
   2**-l)`` (RNE, ties to even, saturating; ``cvt.rn.satfinite.e2m1x2``), even element in the low
   nibble, scale byte ``l + 127``.

Page layout (``IKS:207-220``, row-major, CUDA): page ``b`` at ``cache.stride(0) * b``; token ``o``'s
values at ``o * V`` (``V`` = 128 FP8 codes / 64 packed bytes), its scale bytes at ``bs * V + o * 4``.
The ROCm tiled ("SHUFFLE") value order is not modelled.
"""

from __future__ import annotations

import torch

from ..constants import (
    E2M1_MAX,
    E4M3_MAX,
    INDEXER_FP8_ROW_BYTES,
    INDEXER_HEAD_DIM,
    INDEXER_MXFP4_GROUP,
    INDEXER_MXFP4_ROW_BYTES,
    INDEXER_ROPE_DIM,
    SCALE_FLOOR_F32,
)
from ..errors import INDEX_DTYPES, check_dtype, check_int, check_rank, fail
from ..formats.fp4 import encode_e2m1, pack_e2m1
from ..formats.fp8 import encode_e4m3fn, exact_ceil_log2
from ..pipeline.query_quant import rms_norm_rows
from ..pipeline.rope import rope_pairs
from ..policies import RopeArithmetic

__all__ = ["INDEXER_RECORDS", "indexer_row_bytes", "indexer_k_rows", "encode_indexer_records", "insert_indexer_k"]

INDEXER_RECORDS = ("fp8", "mxfp4")
_INV448 = float(torch.tensor(1.0 / E4M3_MAX, dtype=torch.float32))
_INV6 = float(torch.tensor(1.0 / E2M1_MAX, dtype=torch.float32))
_FP4_AMAX_FLOOR = E2M1_MAX * 2.0**-126


def indexer_row_bytes(record: str) -> int:
    """Bytes per token of an indexer record: 132 (``fp8``) or 68 (``mxfp4``)."""
    if record not in INDEXER_RECORDS:
        fail("indexer_row_bytes", "record", f"must be one of {list(INDEXER_RECORDS)}", record)
    return INDEXER_FP8_ROW_BYTES if record == "fp8" else INDEXER_MXFP4_ROW_BYTES


def indexer_k_rows(k_pre: torch.Tensor, rope_pos: torch.Tensor, cos_sin: torch.Tensor, weight: torch.Tensor,
                   eps: float, arith: RopeArithmetic | str = RopeArithmetic.FMA_TRITON) -> torch.Tensor:
    """Steps 1-2: bf16 ``[M, 128]`` normed, rotated keys of ``k_pre`` (bf16 ``[M, 128]``) at RoPE
    positions ``rope_pos`` (int ``[M]``); cos_sin fp32 / bf16 ``[max_pos, 64]``; weight ``[128]``."""
    fn = "indexer_k_rows"
    check_dtype(fn, "k_pre", k_pre, (torch.bfloat16,))
    if k_pre.dim() != 2 or k_pre.shape[1] != INDEXER_HEAD_DIM:
        fail(fn, "k_pre", f"must have shape [M, {INDEXER_HEAD_DIM}]", tuple(k_pre.shape))
    k = rms_norm_rows(k_pre.cpu(), weight.cpu(), eps).to(torch.bfloat16).to(torch.float64)
    cs = cos_sin.detach().cpu().to(torch.float32).to(torch.float64)[rope_pos.to(torch.int64).cpu()]
    half = INDEXER_ROPE_DIM // 2
    n_nope = (INDEXER_HEAD_DIM - INDEXER_ROPE_DIM) // 2
    m = k.shape[0]
    cos = torch.cat((torch.ones(m, n_nope, dtype=torch.float64), cs[:, :half]), dim=1)
    sin = torch.cat((torch.zeros(m, n_nope, dtype=torch.float64), cs[:, half:]), dim=1)
    e, o = rope_pairs(k[:, 0::2], k[:, 1::2], cos, sin, False, RopeArithmetic(arith))
    return torch.stack((e, o), dim=-1).reshape(m, INDEXER_HEAD_DIM).to(torch.float32).to(torch.bfloat16)


def encode_indexer_records(y: torch.Tensor, record: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 3: ``(values uint8 [M, V], scales uint8 [M, 4])`` of bf16 keys ``y [M, 128]`` (finite)."""
    fn = "encode_indexer_records"
    indexer_row_bytes(record)
    check_dtype(fn, "y", y, (torch.bfloat16,))
    v = y.to(torch.float32)
    if not bool(torch.isfinite(v).all()):
        fail(fn, "y", "must be finite (non-finite keys are out of the writer's modelled contract)")
    if record == "fp8":
        amax = torch.maximum(v.abs().amax(dim=1), torch.tensor(SCALE_FLOOR_F32))
        r = (amax.to(torch.float64) * _INV448).to(torch.float32)  # fl32(amax * fl32(1/448))
        e = exact_ceil_log2(r).to(torch.float64)
        scaled = (v.to(torch.float64) * torch.pow(2.0, -e).unsqueeze(1)).clamp(-E4M3_MAX, E4M3_MAX)
        codes = encode_e4m3fn(scaled.to(torch.float32))
        scale = torch.pow(2.0, e).to(torch.float32).contiguous().view(torch.uint8).reshape(-1, 4)
        return codes, scale
    g = v.reshape(v.shape[0], -1, INDEXER_MXFP4_GROUP)
    amax = torch.maximum(g.abs().amax(dim=2), torch.tensor(_FP4_AMAX_FLOOR, dtype=torch.float32))
    r = (amax.to(torch.float64) * _INV6).to(torch.float32)
    lg = exact_ceil_log2(r).clamp(-127, 127).to(torch.float64)
    scaled = g.to(torch.float64) * torch.pow(2.0, -lg).unsqueeze(2)  # exact: a power-of-two scaling in range
    codes = pack_e2m1(encode_e2m1(scaled.reshape(v.shape[0], -1)))
    return codes, (lg + 127).to(torch.uint8)


def insert_indexer_k(cache: torch.Tensor, k_pre: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                     weight: torch.Tensor, eps: float, slots: torch.Tensor, compress_ratio: int, record: str,
                     arith: RopeArithmetic | str = RopeArithmetic.FMA_TRITON) -> torch.Tensor:
    """``indexer_k_norm_rope_store``: a NEW cache (uint8 ``[num_blocks, bs, row_bytes]``, row bytes
    ``indexer_row_bytes(record)``) with every written token's record stored (module docstring).
    k_pre bf16 ``[>= L, 128]``; positions int ``[>= L]``; slots int ``[L]`` (negative = skip,
    distinct, ``< num_blocks * bs``); compress_ratio 1 | 2; eps >= 0."""
    fn = "insert_indexer_k"
    rb = indexer_row_bytes(record)
    check_dtype(fn, "cache", cache, (torch.uint8,))
    if cache.dim() != 3 or cache.shape[2] != rb or not cache.is_contiguous():
        fail(fn, "cache", f"must be a contiguous [num_blocks, block_size, {rb}] tensor for record {record}",
             tuple(cache.shape))
    if isinstance(compress_ratio, bool) or compress_ratio not in (1, 2):
        fail(fn, "compress_ratio", "must be 1 or 2", compress_ratio)
    check_dtype(fn, "slots", slots, INDEX_DTYPES)
    check_rank(fn, "slots", slots, 1)
    s = slots.to(torch.int64).cpu()
    L = s.shape[0]
    check_dtype(fn, "positions", positions, INDEX_DTYPES)
    if positions.dim() != 1 or positions.shape[0] < L or k_pre.shape[0] < L:
        fail(fn, "positions", f"positions and k_pre must cover len(slots) = {L} tokens",
             (tuple(positions.shape), tuple(k_pre.shape)))
    pos = positions.to(torch.int64).cpu()[:L]
    nb, bs = cache.shape[0], cache.shape[1]
    check_int(fn, "block_size", bs, minimum=1)
    take = ((s >= 0) & ((pos + 1) % compress_ratio == 0)).nonzero().flatten()
    ws = s[take]
    if ws.numel() and (int(ws.max()) >= nb * bs or ws.unique().numel() != ws.numel()):
        fail(fn, "slots", f"must be distinct and < num_blocks * block_size = {nb * bs}", ws.tolist()[:8])
    rope_pos = pos[take] // compress_ratio * compress_ratio
    if take.numel() and int(rope_pos.max()) >= cos_sin.shape[0]:
        fail(fn, "positions", f"must give RoPE positions < {cos_sin.shape[0]} (rows of cos_sin)", int(rope_pos.max()))
    y = indexer_k_rows(k_pre.detach().cpu()[take], rope_pos, cos_sin, weight, eps, arith)
    vals, scales = encode_indexer_records(y, record)
    vw = rb - 4
    out = cache.detach().cpu().clone()
    pages = out.view(nb, bs * rb)
    blk, off = ws // bs, ws % bs
    for i in range(ws.numel()):
        b, o = int(blk[i]), int(off[i])
        pages[b, o * vw:(o + 1) * vw] = vals[i]
        pages[b, bs * vw + o * 4:bs * vw + o * 4 + 4] = scales[i]
    return out.to(cache.device)
