"""KV RMSNorm + RoPE stored as unit-scale E4M3 rows into a plain FP8 pool (SGLang 0.5.23
``kv_norm_rope_store.fused_k_norm_rope_uniform_fp8``, ``SG:kernels/ops/attention/dsv4/
kv_norm_rope_store.py``; the ``UNIFORM_FP8`` pool: one 512-byte row per slot, no scales).

Per token ``t`` (kv row ``x`` [512], weight ``w`` [512], position ``p``, slot ``s``):

1. ``rrms = rsqrt(sum_i x_i**2 / 512 + eps)`` and ``y = fl32(fl32(x * rrms) * w)`` (fp32), the
   RMSNorm of ``query_quant.rms_norm_rows`` (datapath 5.1 step 5's norm over a kv row).
2. RoPE of dims 448..511 on the **unrounded fp32** ``y`` at position ``p`` (datapath 2.1 step 3,
   GPT-J pairs) under a ``RopeArithmetic``. The kernel writes ``re = even*c - odd*s`` and
   ``im = even*s + odd*c``: LLVM fuses the left product of each (``pipeline/rope.py``), which is
   ``RopeArithmetic.FMA`` (``e' = fma(e, cos, -fl32(o*sin))``, ``o' = fma(e, sin, fl32(o*cos))``).
3. The fp32 row is rounded to kv's dtype (bf16: RNE; fp32: unchanged), then to E4M3FN by RNE with
   saturation (Triton's store cast ``cvt.rn.satfinite``: a finite value beyond 448 -> +-448, where
   torch 2.11's cast gives NaN) -- ``caches.plain.encode_fp8_rows`` with ``kv_scale = 1``.
4. Row ``s`` of the pool receives the 512 codes. No slot is skipped: a negative ``s`` writes row
   ``rows + s`` (``SlotSkip.NEGATIVE_WRAPS``, PyTorch's negative index; the stage's other rules
   model a writer that skips them).

Bit-exactness of step 1: the kernel sums the squares with ``tl.sum`` (a tree order) and takes
``tl.rsqrt`` (the approximate instruction); both are exact, in any order, on *exact-norm rows* with
``eps = 0`` (``query_quant.is_exact_norm_row``: every square 0 or a power of 4, summing to 512, so
``rrms = 1``). The bytes are a bit-exact contract there; elsewhere the reference is a model within
a few fp32 ulps of ``y`` (one E4M3 step where that crosses a rounding boundary). Steps 2-4 are
exact for every finite input.
"""

from __future__ import annotations

import torch

from ..caches.plain import insert_fp8_rows
from ..constants import HEAD_DIM
from ..errors import INDEX_DTYPES, check_dtype, check_rank, check_tensor, fail
from ..policies import NonFinite, RopeArithmetic, SlotSkip
from .query_quant import rms_norm_rows
from .rope import apply_rope

__all__ = ["norm_rope_rows", "kv_norm_rope_store"]


def norm_rope_rows(kv: torch.Tensor, weight: torch.Tensor, eps: float, cos_sin: torch.Tensor,
                   positions: torch.Tensor,
                   arithmetic: RopeArithmetic | str = RopeArithmetic.FMA) -> torch.Tensor:
    """fp32 ``[T, 512]``: steps 1-2 (module docstring). kv: bf16/fp32 ``[T, 512]``; weight:
    bf16/fp32 ``[512]``; cos_sin: fp32 ``[max_pos, 64]`` (``rope.cos_sin_cache``); positions:
    int ``[T]`` in ``[0, max_pos)``."""
    fn = "norm_rope_rows"
    check_tensor(fn, "kv", kv)
    check_rank(fn, "kv", kv, 2)
    if kv.shape[1] != HEAD_DIM:
        fail(fn, "kv", f"must be [T, {HEAD_DIM}]", tuple(kv.shape))
    check_dtype(fn, "positions", positions, INDEX_DTYPES)
    if tuple(positions.shape) != (kv.shape[0],):
        fail(fn, "positions", f"must be [{kv.shape[0]}] (one position per kv row)", tuple(positions.shape))
    y = rms_norm_rows(kv, weight, eps)
    return apply_rope(y, positions, cos_sin, inverse=False, arithmetic=arithmetic)


def kv_norm_rope_store(kv: torch.Tensor, weight: torch.Tensor, eps: float, cos_sin: torch.Tensor,
                       positions: torch.Tensor, slots: torch.Tensor, cache: torch.Tensor,
                       arithmetic: RopeArithmetic | str = RopeArithmetic.FMA,
                       slot_skip: SlotSkip | str = SlotSkip.NEGATIVE_WRAPS,
                       nonfinite: NonFinite | str = NonFinite.FINITE) -> torch.Tensor:
    """The pool after the store (module docstring): uint8 ``[rows, 512]`` E4M3FN codes, a new tensor;
    rows not written keep their bytes.

    cache: uint8 or float8_e4m3fn ``[rows, 512]`` (the kernel's flat pool; row = slot); slots: int
    ``[T]`` (``slot_skip``: ``negative_wraps`` writes a negative slot ``s`` to row ``rows + s``,
    ``all_negative`` / ``minus1_only`` model a writer that skips them); the destinations must be
    distinct (``index_put`` contract); ``nonfinite``: ``finite`` is the saturating store cast (Triton
    ``cvt.rn.satfinite``), ``torch`` torch 2.11's cast (a value rounding past 448 -> NaN), as
    ``caches.plain.encode_fp8_rows``. Other arguments as ``norm_rope_rows``.
    """
    fn = "kv_norm_rope_store"
    check_tensor(fn, "cache", cache)
    check_dtype(fn, "cache", cache, (torch.uint8, torch.float8_e4m3fn))
    check_rank(fn, "cache", cache, 2)
    if cache.shape[1] != HEAD_DIM:
        fail(fn, "cache", f"must be [rows, {HEAD_DIM}] (one unit-scale E4M3 row per slot)", tuple(cache.shape))
    y = norm_rope_rows(kv, weight, eps, cos_sin, positions, arithmetic)
    check_dtype(fn, "slots", slots, INDEX_DTYPES)
    if tuple(slots.shape) != (kv.shape[0],):
        fail(fn, "slots", f"must be [{kv.shape[0]}] (one slot per kv row)", tuple(slots.shape))
    raw = cache.view(torch.uint8) if cache.dtype != torch.uint8 else cache
    out = insert_fp8_rows(raw.contiguous().reshape(1, raw.shape[0], HEAD_DIM), y.to(kv.dtype), slots,
                          kv_scale=1.0, round_to_bf16_first=False, nonfinite=nonfinite, slot_skip=slot_skip)
    return out.reshape(raw.shape[0], HEAD_DIM)
