"""Plain (non-584) KV rows used with FlashInfer trtllm-gen on SM100 (datapath 1.6, 2.7; hazard H15).

Two layouts, both ``[num_blocks, bs, 512]`` token-strided, global slot ``s`` at ``[s // bs, s % bs]``:

- plain bf16 rows: ``cache[page, e, :] = bf16(k)``, written by vLLM
  ``fused_deepseek_v4_qnorm_rope_kv_rope_full_cache_bf16_insert`` (``V:models/deepseek_v4/
  attention.py:816-836``): the roped fp32 row is rounded (RNE) to bf16.
- plain per-tensor FP8 rows: ``code = e4m3_satfinite(clamp(x * fl32(1 / kv_scale), -448, 448))``,
  ``value = code * kv_scale`` (``..._full_cache_fp8_insert``, ``V:models/deepseek_v4/attention.py:
  838-851``; vLLM passes ``kv_scale = 1.0``, ``V:models/deepseek_v4/nvidia/flashinfer_sparse.py:
  257-279``). H15: the SWA full-cache writer may quantise the fp32 roped value while the CuTe
  full-cache compressor quantises ``bf16(x)``; ``round_to_bf16_first`` selects which.

Arithmetic: ``fl32(1 / kv_scale)`` and ``fl32(x * inv)`` are emulated as float64 results rounded
once to fp32 (the float64 product of two fp32 values is exact; the float64 quotient rounded to
fp32 is the correctly rounded fp32 quotient, see ``quant.fl32_div``), then the FP8 RNE encoder:
the same two roundings as the kernel, bit for bit. Caches may be ``uint8`` or
``torch.float8_e4m3fn`` (FP8 rows) and ``bfloat16`` (bf16 rows); inserts return a new tensor with
the input's sizes and strides, bytes outside written rows unchanged.
"""

from __future__ import annotations

import torch

from ..constants import E4M3_MAX, HEAD_DIM
from ..errors import INDEX_DTYPES, check_dtype, check_enum, check_int, check_rank, check_tensor, fail
from ..formats.fp8 import validate_nonfinite, decode_e4m3fn, encode_e4m3fn
from ..policies import NonFinite, SlotSkip
from ..storage import clone_storage

__all__ = [
    "empty_plain_cache",
    "insert_bf16_rows",
    "read_bf16_rows",
    "encode_fp8_rows",
    "decode_fp8_rows",
    "insert_fp8_rows",
    "read_fp8_rows",
    "dequantize_fp8_rows",
    "requantize_e4m3",
]

_FP8_CACHE_DTYPES = (torch.uint8, torch.float8_e4m3fn)


def empty_plain_cache(num_blocks: int, block_size: int, dtype: torch.dtype = torch.bfloat16,
                      fill: float | int = 0, device: str | torch.device = "cpu") -> torch.Tensor:
    """A ``[num_blocks, block_size, 512]`` cache of ``dtype`` (bfloat16, uint8 or float8_e4m3fn)
    filled with ``fill`` (a value for bf16, a byte for the FP8 dtypes)."""
    fn = "empty_plain_cache"
    check_int(fn, "num_blocks", num_blocks, minimum=1)
    check_int(fn, "block_size", block_size, minimum=1)
    if dtype not in (torch.bfloat16,) + _FP8_CACHE_DTYPES:
        fail(fn, "dtype", "must be bfloat16, uint8 or float8_e4m3fn", dtype)
    if dtype == torch.bfloat16:
        return torch.full((num_blocks, block_size, HEAD_DIM), float(fill), dtype=dtype, device=device)
    if not isinstance(fill, int) or not 0 <= fill <= 255:
        fail(fn, "fill", "must be a byte value in [0, 255] for an FP8 cache", fill)
    c = torch.full((num_blocks, block_size, HEAD_DIM), fill, dtype=torch.uint8, device=device)
    return c if dtype == torch.uint8 else c.view(torch.float8_e4m3fn)


def _geometry(fn: str, cache: torch.Tensor, dtypes: tuple) -> tuple[int, int]:
    check_dtype(fn, "cache", cache, dtypes)
    check_rank(fn, "cache", cache, 3)
    if cache.shape[2] != HEAD_DIM or cache.stride(2) != 1:
        fail(fn, "cache", f"must be [num_blocks, block_size, {HEAD_DIM}] with unit element stride",
             f"shape {tuple(cache.shape)} strides {cache.stride()}")
    return cache.shape[0], cache.shape[1]


def _written(fn: str, slot_mapping: torch.Tensor, n_rows: int, capacity: int,
             slot_skip: SlotSkip | str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(token indices, slots)`` that a writer stores, after validation (as ``cache_model1.insert``)."""
    check_dtype(fn, "slot_mapping", slot_mapping, INDEX_DTYPES)
    check_rank(fn, "slot_mapping", slot_mapping, 1)
    slot_skip = check_enum(fn, "slot_skip", SlotSkip, slot_skip)
    s = slot_mapping.to(torch.int64).cpu()
    if s.shape[0] > n_rows:
        fail(fn, "slot_mapping", f"must not be longer than the input rows ({n_rows})", f"length {s.shape[0]}")
    if slot_skip is SlotSkip.MINUS1_ONLY and bool(((s < 0) & (s != -1)).any()):
        fail(fn, "slot_mapping", "may hold no negative value other than -1 under slot_skip=MINUS1_ONLY "
             "(that writer would write other negative slots out of bounds)")
    if bool((s >= capacity).any()):
        fail(fn, "slot_mapping", f"must be < num_blocks*block_size = {capacity} (out of range)", int(s.max()))
    if slot_skip is SlotSkip.NEGATIVE_WRAPS:
        if bool((s < -capacity).any()):
            fail(fn, "slot_mapping", f"must be >= -num_blocks*block_size = {-capacity} under slot_skip=NEGATIVE_WRAPS "
                 "(a negative slot s writes slot capacity + s)", int(s.min()))
        tokens = torch.arange(s.shape[0])
        slots = torch.where(s < 0, s + capacity, s)
    else:
        tokens = torch.nonzero(s >= 0).flatten()
        slots = s[tokens]
    if slots.numel() != torch.unique(slots).numel():
        fail(fn, "slot_mapping", "must not write one slot twice (producer threads would race; under "
             "slot_skip=NEGATIVE_WRAPS a negative slot s and slot capacity + s are the same slot)")
    return tokens, slots


def _check_rows(fn: str, arg: str, x: torch.Tensor) -> None:
    check_tensor(fn, arg, x)
    check_dtype(fn, arg, x, (torch.bfloat16, torch.float32))
    check_rank(fn, arg, x, 2)
    if x.shape[1] != HEAD_DIM:
        fail(fn, arg, f"must have last dimension {HEAD_DIM}", f"shape {tuple(x.shape)}")


def insert_bf16_rows(cache: torch.Tensor, k: torch.Tensor, slot_mapping: torch.Tensor,
                     slot_skip: SlotSkip | str = SlotSkip.ALL_NEGATIVE) -> torch.Tensor:
    """Write ``bf16(k[t])`` (RNE from fp32, verbatim from bf16) to slot ``slot_mapping[t]``; new cache.

    cache: bfloat16 ``[num_blocks, bs, 512]``; k: bfloat16 or float32 ``[N, 512]`` (the roped
    row); slot_mapping int ``[L <= N]``; ``slot_skip`` and range/duplicate checks as
    ``cache_model1.insert``. Non-finite values are stored like any other value.
    """
    fn = "insert_bf16_rows"
    nb, bs = _geometry(fn, cache, (torch.bfloat16,))
    _check_rows(fn, "k", k)
    tokens, slots = _written(fn, slot_mapping, k.shape[0], nb * bs, slot_skip)
    out = clone_storage(cache)
    dev = cache.device
    out[(slots // bs).to(dev), (slots % bs).to(dev)] = k[tokens.to(k.device)].to(torch.bfloat16).to(dev)
    return out


def _slots(fn: str, slots: torch.Tensor, capacity: int) -> torch.Tensor:
    check_dtype(fn, "slots", slots, INDEX_DTYPES)
    check_rank(fn, "slots", slots, 1)
    s = slots.to(torch.int64)
    if bool(((s < 0) | (s >= capacity)).any()):
        fail(fn, "slots", f"must lie in [0, num_blocks*block_size = {capacity})")
    return s


def read_bf16_rows(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """bf16 rows ``[S, 512]`` stored at global ``slots``."""
    fn = "read_bf16_rows"
    nb, bs = _geometry(fn, cache, (torch.bfloat16,))
    s = _slots(fn, slots, nb * bs).to(cache.device)
    return cache[s // bs, s % bs]


def _check_kv_scale(fn: str, kv_scale: object) -> float:
    if isinstance(kv_scale, bool) or not isinstance(kv_scale, (int, float)):
        fail(fn, "kv_scale", "must be a float", type(kv_scale).__name__)
    v = float(kv_scale)
    v32 = float(torch.tensor(v, dtype=torch.float32))
    if not (v32 > 0 and v32 != float("inf")) or v32 != v:
        fail(fn, "kv_scale", "must be a positive finite float32 value (the kernel reads an fp32 tensor)", kv_scale)
    return v


def encode_fp8_rows(x: torch.Tensor, kv_scale: float = 1.0, round_to_bf16_first: bool = True,
                    nonfinite: NonFinite | str = NonFinite.FINITE) -> torch.Tensor:
    """Per-tensor FP8 codes (uint8 ``[N, 512]``) of rows ``x`` (bfloat16 or float32 ``[N, 512]``).

    ``q = bf16(x)`` if ``round_to_bf16_first`` else ``x`` (H15);
    ``code = e4m3_RNE_satfinite(clamp(fl32(q * fl32(1 / kv_scale)), -448, 448))``.
    ``nonfinite`` as ``fp8.encode_e4m3fn`` (the CUDA writer: ``CUDA_SATFINITE``).
    """
    fn = "encode_fp8_rows"
    _check_rows(fn, "x", x)
    s = _check_kv_scale(fn, kv_scale)
    nonfinite = validate_nonfinite(fn, nonfinite)
    if not isinstance(round_to_bf16_first, bool):
        fail(fn, "round_to_bf16_first", "must be a bool", type(round_to_bf16_first).__name__)
    q = x.to(torch.bfloat16) if round_to_bf16_first else x
    q = q.to(torch.float32)
    inv = torch.tensor(1.0 / s, dtype=torch.float64).to(torch.float32).to(torch.float64)  # fl32(1/s)
    if nonfinite is NonFinite.FINITE:
        if not bool(torch.isfinite(q).all()):
            fail(fn, "x", "must be finite under nonfinite=FINITE", f"{int((~torch.isfinite(q)).sum())} non-finite")
        # q * inv may still overflow fp32 for a tiny kv_scale: the writer's clamp saturates it.
        nonfinite = NonFinite.CUDA_SATFINITE
    y = (q.to(torch.float64) * inv.to(q.device)).to(torch.float32)  # exact product, one rounding
    torch_mode = nonfinite in (NonFinite.TORCH, NonFinite.TORCH_SATURATING)
    return encode_e4m3fn(y, nonfinite=nonfinite, clamp=None if torch_mode else E4M3_MAX)


def decode_fp8_rows(codes: torch.Tensor, kv_scale: float = 1.0) -> torch.Tensor:
    """float32 ``fl32(decode_e4m3fn(code) * kv_scale)`` (exact when ``kv_scale`` is a power of two)."""
    fn = "decode_fp8_rows"
    check_dtype(fn, "codes", codes, _FP8_CACHE_DTYPES)
    s = _check_kv_scale(fn, kv_scale)
    c = codes.view(torch.uint8) if codes.dtype != torch.uint8 else codes
    return (decode_e4m3fn(c).to(torch.float64) * s).to(torch.float32)


def insert_fp8_rows(cache: torch.Tensor, x: torch.Tensor, slot_mapping: torch.Tensor,
                    kv_scale: float = 1.0, round_to_bf16_first: bool = True,
                    nonfinite: NonFinite | str = NonFinite.FINITE,
                    slot_skip: SlotSkip | str = SlotSkip.ALL_NEGATIVE) -> torch.Tensor:
    """Write ``encode_fp8_rows(x[t])`` to slot ``slot_mapping[t]``; returns a new cache.

    cache: uint8 or float8_e4m3fn ``[num_blocks, bs, 512]`` (result has the same dtype).
    """
    fn = "insert_fp8_rows"
    nb, bs = _geometry(fn, cache, _FP8_CACHE_DTYPES)
    _check_rows(fn, "x", x)
    tokens, slots = _written(fn, slot_mapping, x.shape[0], nb * bs, slot_skip)
    codes = encode_fp8_rows(x[tokens.to(x.device)], kv_scale, round_to_bf16_first, nonfinite)
    out = clone_storage(cache)
    raw = out.view(torch.uint8) if out.dtype != torch.uint8 else out
    dev = cache.device
    raw[(slots // bs).to(dev), (slots % bs).to(dev)] = codes.to(dev)
    return out


def read_fp8_rows(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Raw FP8 codes (uint8 ``[S, 512]``) stored at global ``slots``."""
    fn = "read_fp8_rows"
    nb, bs = _geometry(fn, cache, _FP8_CACHE_DTYPES)
    s = _slots(fn, slots, nb * bs).to(cache.device)
    raw = cache.view(torch.uint8) if cache.dtype != torch.uint8 else cache
    return raw[s // bs, s % bs]


def dequantize_fp8_rows(cache: torch.Tensor, slots: torch.Tensor, kv_scale: float = 1.0) -> torch.Tensor:
    """float32 rows ``[S, 512]``: ``decode_fp8_rows(read_fp8_rows(cache, slots), kv_scale)``."""
    return decode_fp8_rows(read_fp8_rows(cache, slots), kv_scale)


def requantize_e4m3(x: torch.Tensor) -> torch.Tensor:
    """bf16 ``x.shape``: each value of ``x`` (bf16 / fp32 ``[..., 512]``) re-encoded as a unit-scale
    E4M3FN code (RNE, saturating: finite overflow and +-Inf -> +-448, NaN -> NaN with its sign:
    ``NonFinite.TORCH_SATURATING``) and decoded again -- a per-tensor FP8 row with ``kv_scale = 1``
    (``GatherOutput.E4M3_REQUANT``). E4M3 values are exact in bf16."""
    fn = "requantize_e4m3"
    check_tensor(fn, "x", x)
    check_dtype(fn, "x", x, (torch.bfloat16, torch.float32))
    codes = encode_fp8_rows(x.reshape(-1, x.shape[-1]) if x.dim() else x, 1.0, round_to_bf16_first=False,
                            nonfinite=NonFinite.TORCH_SATURATING)
    return decode_fp8_rows(codes).to(torch.bfloat16).reshape(x.shape)
