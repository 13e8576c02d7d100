"""DeepSeek-V3.2 656-byte KV-cache rows: FlashMLA V32 quantiser, paged insert/read, dequantisation.

Layout of one row (datapath 1.5; ``V:third_party/flashmla/flash_mla_interface.py`` docstring
"For DeepSeek V3, DeepSeek V3.1, and DeepSeek V3.2"; ``FM:tests/quant.py`` ``V32_FP8Sparse``).
Unlike the DSv4 584-byte record the row is **interleaved per token** (no page split):

==============  =====================================================================
bytes           content
==============  =====================================================================
``[0, 512)``    512 OCP E4M3FN codes of the NoPE (``kv_lora_rank``) dims, byte ``i`` = dim ``i``;
                tile ``t = i // 128`` (4 tiles)
``[512, 528)``  4 little-endian IEEE fp32 tile scales; scale ``t`` at bytes ``512+4t .. 515+4t``;
                a *dequantisation multiplier*: value = ``decode(code) * scale``
``[528, 656)``  64 little-endian bf16 RoPE values, dim ``512 + j`` at bytes ``528+2j, 529+2j``;
                not quantised, not scaled
==============  =====================================================================

Value dim (``d_v``) is 512 = the NoPE dims only; ``d_qk`` = 576 (attention.md 1.3).

Paged caches. A cache holds ``num_blocks`` pages of ``block_size`` rows; rows inside a page are
**exactly 656 bytes apart** (FlashMLA SM90 sparse decode asserts ``stride_kv_row == 656``,
``FM:csrc/sm90/decode/sparse_fp8/splitkv_mla.cuh`` ``KernelTemplate::run``); the page stride is
free (``cache.stride(0)``; FlashMLA's tests allocate ``(block_size + 1) * 656`` bytes per page,
``FM:tests/quant.py:35-53``). Accepted tensor forms (dtype ``uint8``):

* ``[num_blocks, page_stride]`` with ``page_stride >= block_size * 656`` (the page buffer);
* ``[num_blocks, block_size, 656]`` with strides ``(page_stride, 656, 1)`` (the kernel view);
* ``[num_blocks, block_size, 1, 656]`` (FlashMLA's ``k_cache`` with ``h_k = 1``).

Slot ``s`` lives in page ``s // block_size`` at row ``s % block_size`` (FlashMLA decode indices
are ``page * block_size + offset``, ``V:third_party/flashmla/flash_mla_interface.py`` docstring of
``indices``).

Quantiser (``quantize_v32``): FlashMLA's V32 test quantiser, ``FM:tests/quant.py``
``quantize_k_cache`` / ``_cast_scale_inv_to_ue8m0``: per 128-wide tile,
``scale = 2**ceil(log2(max(fl32(amax / 448), 1e-4f)))`` -- the ``ScaleRule.SCALE_CLAMP`` (Q_S)
rule of datapath 2.0 on 128-wide tiles -- stored as fp32; codes ``e4m3(x / scale)`` (RNE). The
exponent is computed exactly (``quant.tile_exponent``, integer logic on the fp32 bits), never with
``log2``.
Input must be finite bf16 (the cache dtype FlashMLA quantises); then ``|x / scale| <= 448`` always
(``fl32(amax/448)`` is never rounded onto a power of two from above for bf16 ``amax``), so the
torch cast FlashMLA uses and a saturating RNE encoder give the same code. RoPE bf16 copied.

Dequantisation (``dequantize_v32``) under a ``V32ScaleDecode`` consumer policy: ``EXACT``
(``code * scale`` exactly, in float64), ``BF16_RNE`` (FlashMLA SM90: bf16 scale, bf16 product),
``SM100_RZ_E8M0`` (the SM100 head64 bug: scale truncated to the power of two at or below it,
attention.md 6 / H11). They agree bit for bit on power-of-two scales.
"""

from __future__ import annotations

import torch

from ..constants import (
    V32_HEAD_DIM,
    V32_N_TILES,
    V32_NOPE_DIM,
    V32_ROPE_BYTE_OFFSET,
    V32_ROPE_DIM,
    V32_ROW_BYTES,
    V32_SCALE_BYTE_OFFSET,
    V32_TILE,
)
from ..errors import INDEX_DTYPES, check_dtype, check_enum, check_int, check_rank, check_shape, fail
from ..formats.fp8 import decode_fp8, encode_e4m3fn, pow2_f64
from ..policies import ScaleRule, SlotSkip, V32ScaleDecode
from ..formats.quant import tile_exponent

__all__ = [
    "v32_page_view",
    "quantize_v32",
    "pack_v32_rows",
    "unpack_v32_rows",
    "encode_v32_rows",
    "v32_nan_row",
    "insert_v32",
    "read_v32",
    "v32_scale_multipliers",
    "dequantize_v32",
    "dequantize_v32_cache",
]

_FP32_EXP_MASK = 0xFF
_FP32_MANT_BITS = 23
_FP32_BIAS = 127


# --------------------------------------------------------------------------- geometry


def v32_page_view(cache: torch.Tensor, block_size: int) -> torch.Tensor:
    """``[num_blocks, block_size, 656]`` uint8 view (strides ``(page_stride, 656, 1)``) of ``cache``.

    ``cache`` is one of the three accepted forms (module docstring); ``page_stride`` is
    ``cache.stride(0)`` in bytes and must be ``>= block_size * 656``. No copy is made.
    """
    fn = "v32_page_view"
    check_dtype(fn, "cache", cache, (torch.uint8,))
    check_int(fn, "block_size", block_size, minimum=1)
    row_bytes = block_size * V32_ROW_BYTES
    if cache.dim() == 2:
        if cache.stride(1) != 1:
            fail(fn, "cache", "2-D page buffer must have a contiguous last dimension", tuple(cache.stride()))
        if cache.shape[1] < row_bytes:
            fail(fn, "cache", f"2-D page buffer must hold block_size*656 = {row_bytes} bytes per page",
                 tuple(cache.shape))
        page_stride = cache.stride(0)
        if cache.shape[0] > 1 and page_stride < row_bytes:
            fail(fn, "cache", f"page stride must be >= block_size*656 = {row_bytes}", page_stride)
        return cache.as_strided((cache.shape[0], block_size, V32_ROW_BYTES), (page_stride, V32_ROW_BYTES, 1),
                                cache.storage_offset())
    if cache.dim() == 4:
        if cache.shape[2] != 1:
            fail(fn, "cache", "4-D form must be [num_blocks, block_size, 1, 656]", tuple(cache.shape))
        cache = cache.squeeze(2)
    if cache.dim() != 3:
        fail(fn, "cache", "must have rank 2, 3 or 4", f"shape {tuple(cache.shape)}")
    if cache.shape[1] != block_size or cache.shape[2] != V32_ROW_BYTES:
        fail(fn, "cache", f"must have shape [num_blocks, {block_size}, {V32_ROW_BYTES}]", tuple(cache.shape))
    if cache.stride(2) != 1 or (block_size > 1 and cache.stride(1) != V32_ROW_BYTES):
        fail(fn, "cache", "rows must be exactly 656 bytes apart with contiguous bytes (strides (*, 656, 1))",
             tuple(cache.stride()))
    if cache.shape[0] > 1 and cache.stride(0) < row_bytes:
        fail(fn, "cache", f"page stride must be >= block_size*656 = {row_bytes}", cache.stride(0))
    return cache


def _check_rows(fn: str, rows: torch.Tensor) -> None:
    check_dtype(fn, "rows", rows, (torch.uint8,))
    if rows.dim() < 1 or rows.shape[-1] != V32_ROW_BYTES:
        fail(fn, "rows", f"must have last dimension {V32_ROW_BYTES}", f"shape {tuple(rows.shape)}")


# --------------------------------------------------------------------------- bytes <-> fields


def _le_bytes(bits: torch.Tensor, nbytes: int) -> torch.Tensor:
    """Little-endian bytes (uint8, new last dim of size ``nbytes``) of non-negative int64 ``bits``."""
    shifts = torch.arange(nbytes, device=bits.device, dtype=torch.int64) * 8
    return ((bits.unsqueeze(-1) >> shifts) & 0xFF).to(torch.uint8)


def _from_le_bytes(b: torch.Tensor) -> torch.Tensor:
    """int64 value of little-endian bytes along the last dim of uint8 ``b``."""
    shifts = torch.arange(b.shape[-1], device=b.device, dtype=torch.int64) * 8
    return (b.to(torch.int64) << shifts).sum(-1)


def pack_v32_rows(codes: torch.Tensor, scales: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Assemble 656-byte rows from their fields.

    codes  ``[N, 512]`` uint8 E4M3FN codes; scales ``[N, 4]`` float32 tile multipliers (any fp32,
    including non-powers of two: the format carries arbitrary fp32); rope ``[N, 64]`` bfloat16.
    Returns ``[N, 656]`` uint8 (byte map in the module docstring). Scales/RoPE are written
    little-endian from their bit patterns (platform independent).
    """
    fn = "pack_v32_rows"
    check_dtype(fn, "codes", codes, (torch.uint8,))
    check_dtype(fn, "scales", scales, (torch.float32,))
    check_dtype(fn, "rope", rope, (torch.bfloat16,))
    check_shape(fn, "codes", codes, (None, V32_NOPE_DIM))
    n = codes.shape[0]
    check_shape(fn, "scales", scales, (n, V32_N_TILES))
    check_shape(fn, "rope", rope, (n, V32_ROPE_DIM))
    scale_bits = scales.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    rope_bits = rope.contiguous().view(torch.int16).to(torch.int64) & 0xFFFF
    return torch.cat(
        [codes, _le_bytes(scale_bits, 4).reshape(n, -1), _le_bytes(rope_bits, 2).reshape(n, -1)], dim=1
    )


def unpack_v32_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split ``[..., 656]`` uint8 rows into ``(codes [..., 512] uint8, scales [..., 4] float32,
    rope [..., 64] bfloat16)``; exact inverse of ``pack_v32_rows`` (bit patterns kept, NaN included)."""
    fn = "unpack_v32_rows"
    _check_rows(fn, rows)
    lead = rows.shape[:-1]
    codes = rows[..., :V32_SCALE_BYTE_OFFSET].contiguous()
    sb = rows[..., V32_SCALE_BYTE_OFFSET:V32_ROPE_BYTE_OFFSET].reshape(*lead, V32_N_TILES, 4)
    sbits = _from_le_bytes(sb)
    sbits = torch.where(sbits >= 2**31, sbits - 2**32, sbits).to(torch.int32)
    scales = sbits.view(torch.float32)
    rb = rows[..., V32_ROPE_BYTE_OFFSET:].reshape(*lead, V32_ROPE_DIM, 2)
    rbits = _from_le_bytes(rb)
    rbits = torch.where(rbits >= 2**15, rbits - 2**16, rbits).to(torch.int16)
    rope = rbits.view(torch.bfloat16)
    return codes, scales, rope


# --------------------------------------------------------------------------- quantiser


def quantize_v32(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashMLA's V32 quantiser on latent rows ``k`` ``[N, 576]`` bfloat16 (finite).

    Returns ``(codes [N, 512] uint8, scales [N, 4] float32, rope [N, 64] bfloat16)``:
    per 128-wide tile ``t``: ``amax`` = max |x| (exact in bf16), ``r = fl32(amax / 448)``,
    ``e = ceil(log2(max(r, 1e-4f)))`` (exact), scale = ``2**e`` (fp32, exact),
    code = E4M3FN RNE of ``x * 2**-e`` (exact product). ``FM:tests/quant.py:35-53``;
    datapath 2.0 rule Q_S. Non-finite input is out of contract (``InputError``).
    """
    fn = "quantize_v32"
    check_dtype(fn, "k", k, (torch.bfloat16,))
    check_shape(fn, "k", k, (None, V32_HEAD_DIM))
    if not bool(torch.isfinite(k).all()):
        fail(fn, "k", "must be finite (non-finite input is out of the V32 quantiser's contract)")
    n = k.shape[0]
    nope = k[:, :V32_NOPE_DIM].to(torch.float32).reshape(n, V32_N_TILES, V32_TILE)
    amax = nope.abs().amax(dim=-1)  # exact: bf16 values are exact in fp32
    e = tile_exponent(amax, ScaleRule.SCALE_CLAMP).to(torch.int64)  # [N, 4], Q_S on 128-wide tiles
    scales = pow2_f64(e).to(torch.float32)  # exact: e in [-13, 120]
    v = nope.to(torch.float64) * pow2_f64(-e).unsqueeze(-1)  # exact scaling by a power of two
    codes = encode_e4m3fn(v.reshape(n, V32_NOPE_DIM))
    rope = k[:, V32_NOPE_DIM:].contiguous()
    return codes, scales, rope


def encode_v32_rows(k: torch.Tensor) -> torch.Tensor:
    """``pack_v32_rows(*quantize_v32(k))``: ``[N, 576]`` bf16 latent rows -> ``[N, 656]`` uint8."""
    return pack_v32_rows(*quantize_v32(k))


def v32_nan_row(device: str | torch.device = "cpu") -> torch.Tensor:
    """One NaN-poison row ``[656]`` uint8: every code 0x7F (E4M3FN NaN), every scale the fp32 NaN
    0x7FC00000, every RoPE value the bf16 NaN 0x7FC0. Used to poison rows no valid index points at
    (FlashMLA's decode test poisons unreferenced rows, ``FM:tests/lib.py:273-284``)."""
    codes = torch.full((1, V32_NOPE_DIM), 0x7F, dtype=torch.uint8)
    scales = torch.full((1, V32_N_TILES), float("nan"), dtype=torch.float32)
    rope = torch.full((1, V32_ROPE_DIM), float("nan"), dtype=torch.bfloat16)
    return pack_v32_rows(codes, scales, rope)[0].to(device)


# --------------------------------------------------------------------------- paged insert / read


def _check_slots(fn: str, slots: torch.Tensor, n_slots: int, allow_skip: SlotSkip | None) -> torch.Tensor:
    check_dtype(fn, "slots", slots, INDEX_DTYPES)
    check_rank(fn, "slots", slots, 1)
    s = slots.to(torch.int64)
    if allow_skip is None:
        keep = torch.ones_like(s, dtype=torch.bool)
    elif allow_skip is SlotSkip.MINUS1_ONLY:
        keep = s != -1
        if bool((s[keep] < 0).any()):
            fail(fn, "slots", "may hold -1 (skip) but no other negative value under SlotSkip.MINUS1_ONLY")
    else:
        keep = s >= 0
    live = s[keep]
    if bool((live < 0).any()) or bool((live >= n_slots).any()):
        fail(fn, "slots", f"must lie in [0, num_blocks*block_size = {n_slots})",
             f"min {int(live.min())}, max {int(live.max())}" if live.numel() else None)
    return keep


def insert_v32(cache: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, block_size: int,
               slot_skip: SlotSkip | str = SlotSkip.MINUS1_ONLY) -> torch.Tensor:
    """Write ``rows`` ``[N, 656]`` uint8 into a copy of ``cache`` at global ``slots`` ``[N]``.

    Returns a new tensor with ``cache``'s shape and strides (page padding and every unwritten
    slot keep their bytes). ``slot_skip`` says which negative slots are skipped (MINUS1_ONLY:
    only ``-1``, other negatives raise; ALL_NEGATIVE: all). Slots must be ``< num_blocks *
    block_size`` and unique among written rows (two writes to one slot race on a GPU).
    """
    fn = "insert_v32"
    view_in = v32_page_view(cache, block_size)
    _check_rows(fn, rows)
    check_rank(fn, "rows", rows, 2)
    skip = check_enum(fn, "slot_skip", SlotSkip, slot_skip)
    check_shape(fn, "slots", slots, (rows.shape[0],))
    nb = view_in.shape[0]
    keep = _check_slots(fn, slots, nb * block_size, skip)
    s = slots.to(torch.int64)[keep]
    if s.numel() != torch.unique(s).numel():
        fail(fn, "slots", "must be unique among the rows written")
    out = torch.empty_strided(cache.shape, cache.stride(), dtype=cache.dtype, device=cache.device)
    out.copy_(cache)
    view = v32_page_view(out, block_size)
    view[s // block_size, s % block_size] = rows[keep].to(out.device)
    return out


def read_v32(cache: torch.Tensor, slots: torch.Tensor, block_size: int) -> torch.Tensor:
    """Rows ``[S, 656]`` uint8 at global ``slots`` ``[S]`` (each in ``[0, num_blocks*block_size)``)."""
    fn = "read_v32"
    view = v32_page_view(cache, block_size)
    _check_slots(fn, slots, view.shape[0] * block_size, None)
    s = slots.to(torch.int64)
    return view[s // block_size, s % block_size].contiguous()


# --------------------------------------------------------------------------- dequantisation


def v32_scale_multipliers(scales: torch.Tensor, policy: V32ScaleDecode | str = V32ScaleDecode.EXACT) -> torch.Tensor:
    """The multiplier each consumer policy applies for fp32 ``scales`` (any shape); float64.

    EXACT: the fp32 value itself. BF16_RNE: ``bf16(scale)`` (RNE; FlashMLA SM90
    ``(bf16)scales_float``). SM100_RZ_E8M0: ``2**(E - 127)`` with ``E`` the fp32 biased exponent
    field, i.e. round toward zero to a power of two (``0.75 -> 0.5``, ``2**k -> 2**k``);
    modelled for positive normal finite fp32 scales, and NaN (-> NaN: the UE8M0 NaN byte 0xFF;
    poisoned rows), ``InputError`` otherwise (what ``cvt.rz.satfinite.ue8m0x2.f32`` does with 0,
    subnormals, negatives or Inf was not established).
    """
    fn = "v32_scale_multipliers"
    check_dtype(fn, "scales", scales, (torch.float32,))
    pol = check_enum(fn, "policy", V32ScaleDecode, policy)
    if pol is V32ScaleDecode.EXACT:
        return scales.to(torch.float64)
    if pol is V32ScaleDecode.BF16_RNE:
        return scales.to(torch.bfloat16).to(torch.float64)
    bits = scales.contiguous().view(torch.int32).to(torch.int64)
    efield = (bits >> _FP32_MANT_BITS) & _FP32_EXP_MASK
    nan = torch.isnan(scales)
    ok = ((bits > 0) & (efield >= 1) & (efield <= 254)) | nan
    if not bool(ok.all()):
        fail(fn, "scales", "must be positive normal finite fp32 (or NaN) under SM100_RZ_E8M0 (modelled domain)",
             f"{int((~ok).sum())} offending scales")
    mult = pow2_f64(torch.where(nan, torch.full_like(efield, _FP32_BIAS), efield) - _FP32_BIAS)
    return torch.where(nan, torch.full_like(mult, float("nan")), mult)


def dequantize_v32(rows: torch.Tensor, policy: V32ScaleDecode | str = V32ScaleDecode.EXACT) -> torch.Tensor:
    """Dequantised latent rows ``[..., 576]`` float64 of ``[..., 656]`` uint8 rows.

    dims ``[0, 512)``: ``decode_e4m3fn(code) * m`` with ``m = v32_scale_multipliers(scale, policy)``
    (exact in float64 for EXACT and SM100_RZ_E8M0; for BF16_RNE the product is rounded to bf16,
    as FlashMLA SM90's bf16 multiply does). dims ``[512, 576)``: the bf16 RoPE values, exact.
    NaN codes/scales/RoPE propagate (they are the caller's poison; the attention oracle never
    reads rows no valid index points at).
    """
    fn = "dequantize_v32"
    _check_rows(fn, rows)
    codes, scales, rope = unpack_v32_rows(rows)
    lead = rows.shape[:-1]
    vals = decode_fp8(codes).to(torch.float64).reshape(*lead, V32_N_TILES, V32_TILE)
    mult = v32_scale_multipliers(scales, policy).unsqueeze(-1)
    nope = vals * mult  # exact: <= 4 + 24 significant bits
    if V32ScaleDecode(policy) is V32ScaleDecode.BF16_RNE:
        nope = nope.to(torch.float32).to(torch.bfloat16).to(torch.float64)  # <= 12 bits: fp32 step exact
    return torch.cat([nope.reshape(*lead, V32_NOPE_DIM), rope.to(torch.float64)], dim=-1)


def dequantize_v32_cache(cache: torch.Tensor, block_size: int,
                         policy: V32ScaleDecode | str = V32ScaleDecode.EXACT) -> torch.Tensor:
    """Every slot of a paged V32 cache dequantised: ``[num_blocks * block_size, 576]`` float64,
    row ``s`` = slot ``s`` (the attention oracle's ``rows`` for FlashMLA decode indices)."""
    view = v32_page_view(cache, block_size)
    return dequantize_v32(view.reshape(-1, V32_ROW_BYTES) if view.is_contiguous()
                          else view.contiguous().reshape(-1, V32_ROW_BYTES), policy)
