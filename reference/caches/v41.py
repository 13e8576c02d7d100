"""The DeepSeek-V4.1 paged KV caches: the 528-byte MXFP8 and 288-byte NVFP4 records in both byte
orders (datapath 1.6, hazard H13): layout, encode, insert, read, dequantise, defined bytes.

Records (``reference.policies.V41Record``), ``D`` data bytes + ``S`` scale bytes = ``R`` per token:

    MXFP8  R = 528: D = 512 E4M3FN codes of dims 0..511 (RoPE dims quantised too),
                    S = 16 UE8M0 bytes, scale g covers dims [32g, 32g + 32)
    NVFP4  R = 288: D = 256 bytes, byte j = code(2j) | code(2j+1) << 4 (E2M1, ``reference.formats.fp4``),
                    S = 32 E4M3FN bytes, scale g covers dims [16g, 16g + 16)

Page layout for ``bs`` entries per page and page stride ``P >= bs * R`` (``V41Layout``)::

    INTERLEAVED   entry e at [e*R, e*R + R): its D data bytes, then its S scale bytes
    PAGE_FOOTER   data rows: entry e at [e*D, e*D + D); scale rows: entry e at [bs*D + e*S, +S)
    both          [bs*R, P) page tail, never written

Global slot ``s`` -> ``page = s // bs``, ``e = s % bs``. The page stride is ``cache.stride(0)``.
Accepted caches (``uint8``): ``[num_blocks, >= bs*R]`` with unit byte stride, or the view
``[num_blocks, bs, R]`` with strides ``(P, R, 1)`` (for PAGE_FOOTER its "rows" are not records).
Every byte of a written record is defined (no pad byte); tails and unwritten slots are stale.

Producers (quantisation rules derived from the sources; ``PRODUCERS`` bundles them):
  vLLM 0.33.0 (Triton ``_quantize_and_insert_k_mxfp8_kernel``, ``_rope_quant_insert_mxfp8_kernel``,
  ``_rope_quant_insert_nvfp4_kernel``): INTERLEAVED; MXFP8 ``ScaleRule.AMAX_CLAMP`` (``amax`` floored
  at 1e-4, times ``fl32(1/448)``: equal to the division, see ``quant.quantize_groups_ue8m0``),
  ``NonFinite.TRITON``; NVFP4 ``Nvfp4ScaleRule.RECIP_MUL``, ``Nvfp4NonFinite.TRITON``.
  FlashInfer 0.7.2 (``dsv41_fp8/fp4_quantize_{pack,append}_sparse_mla_cache``): PAGE_FOOTER; MXFP8
  ``ScaleRule.SCALE_CLAMP`` (``max(fl32(max(amax, 1e-4) / 448), 1e-4)``, the torch trajectory for
  NaN/Inf: ``NonFinite.TORCH``); NVFP4 ``Nvfp4ScaleRule.DIV_RN``, ``Nvfp4NonFinite.POISON``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..constants import (
    E2M1_MAX,
    E4M3_MAX,
    HEAD_DIM,
    NVFP4_POISON_SCALE_BYTE,
    V41_MXFP8_DATA_BYTES,
    V41_MXFP8_GROUP,
    V41_MXFP8_RECORD_BYTES,
    V41_NVFP4_DATA_BYTES,
    V41_NVFP4_GROUP,
    V41_NVFP4_RECORD_BYTES,
)
from ..errors import INDEX_DTYPES, check_dtype, check_enum, check_int, check_rank, check_tensor, fail
from ..formats.fp4 import encode_e2m1_trusted, nvfp4_scale_bytes_trusted, decode_e2m1, div_rn_f32, pack_e2m1, unpack_e2m1
from ..formats.fp8 import validate_nonfinite, decode_e4m3fn, decode_fp8, decode_ue8m0
from .gather_plan import gather_plan
from ..storage import clone_storage
from ..policies import (
    E2m1Zero,
    Fp8Flavour,
    NonFinite,
    Nvfp4NonFinite,
    Nvfp4ScaleRule,
    ScaleRule,
    SlotSkip,
    Ue8m0Consumer,
    V41Layout,
    V41Record,
)
from ..formats.quant import quantize_rows_f64, validate_rule

__all__ = [
    "V41Producer",
    "PRODUCERS",
    "record_bytes",
    "empty_cache",
    "cache_geometry",
    "slot_addresses",
    "encode_records",
    "decode_records",
    "insert",
    "read_records",
    "dequantize_slots",
    "dequantize_all",
    "gather",
    "defined_byte_mask",
]

# (data bytes, scale bytes) per record.
_PARTS = {
    V41Record.MXFP8: (V41_MXFP8_DATA_BYTES, V41_MXFP8_RECORD_BYTES - V41_MXFP8_DATA_BYTES),
    V41Record.NVFP4: (V41_NVFP4_DATA_BYTES, V41_NVFP4_RECORD_BYTES - V41_NVFP4_DATA_BYTES),
}
_MXFP8_NONFINITE = (NonFinite.FINITE, NonFinite.TRITON, NonFinite.TORCH)


@dataclass(frozen=True)
class V41Producer:
    """One producer's complete V4.1 contract: byte order and both records' quantisation rules."""

    name: str
    layout: V41Layout
    mxfp8_rule: ScaleRule
    mxfp8_nonfinite: NonFinite
    nvfp4_rule: Nvfp4ScaleRule
    nvfp4_nonfinite: Nvfp4NonFinite


PRODUCERS = {
    "vllm_0.33.0": V41Producer("vllm_0.33.0", V41Layout.INTERLEAVED, ScaleRule.AMAX_CLAMP, NonFinite.TRITON,
                               Nvfp4ScaleRule.RECIP_MUL, Nvfp4NonFinite.TRITON),
    "flashinfer_0.7.2": V41Producer("flashinfer_0.7.2", V41Layout.PAGE_FOOTER, ScaleRule.SCALE_CLAMP,
                                    NonFinite.TORCH, Nvfp4ScaleRule.DIV_RN, Nvfp4NonFinite.POISON),
}


def as_record(fn: str, record: object) -> V41Record:
    return check_enum(fn, "record", V41Record, record)


def _layout(fn: str, layout: object) -> V41Layout:
    return check_enum(fn, "layout", V41Layout, layout)


def record_bytes(record: V41Record | str) -> int:
    """Bytes per token: 528 (MXFP8) or 288 (NVFP4)."""
    d, s = _PARTS[as_record("record_bytes", record)]
    return d + s


# --------------------------------------------------------------------------- geometry


def empty_cache(num_blocks: int, block_size: int, record: V41Record | str, page_stride: int | None = None,
                fill: int = 0) -> torch.Tensor:
    """A 2-D ``uint8`` cache ``[num_blocks, page_stride]`` filled with ``fill``; the page stride
    defaults to ``block_size * R`` (no page tail)."""
    fn = "empty_cache"
    rb = record_bytes(as_record(fn, record))
    check_int(fn, "num_blocks", num_blocks, minimum=1)
    check_int(fn, "block_size", block_size, minimum=1)
    page_stride = block_size * rb if page_stride is None else page_stride
    check_int(fn, "page_stride", page_stride, minimum=block_size * rb)
    check_int(fn, "fill", fill, minimum=0)
    if fill > 255:
        fail(fn, "fill", "must be a byte value in [0, 255]", fill)
    return torch.full((num_blocks, page_stride), fill, dtype=torch.uint8)


def cache_geometry(fn: str, cache: torch.Tensor, block_size: int, record: V41Record) -> tuple[int, int, int]:
    """Validate ``cache`` for ``record`` and return ``(num_blocks, block_size, page_stride)``."""
    rb = sum(_PARTS[record])
    check_dtype(fn, "cache", cache, (torch.uint8,))
    check_int(fn, "block_size", block_size, minimum=1)
    check_rank(fn, "cache", cache, (2, 3))
    nb, p, need = cache.shape[0], cache.stride(0), block_size * rb
    if nb < 1:
        fail(fn, "cache", "must have at least one page", f"shape {tuple(cache.shape)}")
    if cache.dim() == 2:
        ok = cache.stride(1) == 1 and cache.shape[1] >= need
        width = cache.shape[1]
    else:
        ok = cache.shape[1] == block_size and cache.shape[2] == rb and cache.stride(2) == 1
        ok = ok and (block_size == 1 or cache.stride(1) == rb)
        width = need
    if not ok:
        fail(fn, "cache", f"must be [num_blocks, >= block_size*{rb} = {need}] or [num_blocks, "
             f"block_size={block_size}, {rb}] with unit byte stride ({record.value})",
             f"shape {tuple(cache.shape)} strides {cache.stride()}")
    if nb == 1:
        p = max(p, width)
    elif p < width:
        fail(fn, "cache", f"page stride cache.stride(0) must be >= {width} (pages must not overlap)", p)
    if cache.untyped_storage().nbytes() - cache.storage_offset() < nb * p:
        fail(fn, "cache", f"storage must hold num_blocks*page_stride = {nb * p} bytes from the view's offset")
    return nb, block_size, p


def _addresses(s: torch.Tensor, bs: int, p: int, record: V41Record, layout: V41Layout) -> tuple[torch.Tensor, torch.Tensor]:
    d, sc = _PARTS[record]
    page, e = s // bs, s % bs
    if layout is V41Layout.INTERLEAVED:
        data = page * p + e * (d + sc)
        return data, data + d
    return page * p + e * d, page * p + bs * d + e * sc


def slot_addresses(slots: torch.Tensor, block_size: int, page_stride: int, record: V41Record | str,
                   layout: V41Layout | str) -> tuple[torch.Tensor, torch.Tensor]:
    """Byte addresses (int64) of the data bytes and of the scale bytes of global ``slots`` (>= 0)."""
    fn = "slot_addresses"
    record, layout = as_record(fn, record), _layout(fn, layout)
    check_dtype(fn, "slots", slots, INDEX_DTYPES)
    check_int(fn, "block_size", block_size, minimum=1)
    check_int(fn, "page_stride", page_stride, minimum=block_size * sum(_PARTS[record]))
    s = slots.to(torch.int64)
    if bool((s < 0).any()):
        fail(fn, "slots", "must be >= 0 (filter the -1 sentinels first)")
    return _addresses(s, block_size, page_stride, record, layout)


# --------------------------------------------------------------------------- records


def _check_k(fn: str, k: torch.Tensor) -> None:
    check_tensor(fn, "k", k)
    check_dtype(fn, "k", k, (torch.bfloat16, torch.float32))
    check_rank(fn, "k", k, 2)
    if k.shape[1] != HEAD_DIM:
        fail(fn, "k", f"must have last dimension {HEAD_DIM} (all latent dims, RoPE included)", f"shape {tuple(k.shape)}")


def encode_records(
    k: torch.Tensor,
    record: V41Record | str,
    mxfp8_rule: ScaleRule | str = ScaleRule.AMAX_CLAMP,
    nonfinite: NonFinite | Nvfp4NonFinite | str = "finite",
    nvfp4_rule: Nvfp4ScaleRule | str = Nvfp4ScaleRule.RECIP_MUL,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode rows ``k [N, 512]`` (bf16, or fp32 as vLLM's ``rope_quant_insert`` quantises its fp32
    rotation) into ``(data uint8 [N, D], scales uint8 [N, S])`` of ``record``.

    MXFP8: per 32-group ``e = tile_exponent(amax, mxfp8_rule, 448)``, codes
    ``e4m3fn(clamp(x * 2**-e, -448, 448))`` (RNE, exact scaling), byte ``clamp(e + 127, 0, 255)``;
    ``nonfinite`` in FINITE / TRITON (vLLM) / TORCH (FlashInfer), as ``quant.quantize_tiles``
    documents them. An all-zero group writes byte 105 (AMAX_CLAMP) or 114 (SCALE_CLAMP), codes 0.
    NVFP4: per 16-group scale byte ``fp4.nvfp4_scale_bytes(amax, nvfp4_rule)``, codes
    ``e2m1(div_rn(x, decoded scale))`` packed low nibble first; ``nonfinite`` in FINITE / POISON
    (FlashInfer) / TRITON (vLLM), as ``policies.Nvfp4NonFinite`` documents them.
    An all-zero group writes scale byte 0x01 and code bytes 0x00.
    """
    fn = "encode_records"
    _check_k(fn, k)
    record = as_record(fn, record)
    if record is V41Record.MXFP8:
        rule = validate_rule(fn, mxfp8_rule)
        nf = validate_nonfinite(fn, nonfinite)
        if nf not in _MXFP8_NONFINITE:
            fail(fn, "nonfinite", f"must be one of {[x.value for x in _MXFP8_NONFINITE]} for the MXFP8 record", nf)
        if nf is NonFinite.FINITE:
            _require_finite(fn, k)
        return _encode_mxfp8(k, rule, nf)
    rule4 = check_enum(fn, "nvfp4_rule", Nvfp4ScaleRule, nvfp4_rule)
    nf4 = check_enum(fn, "nonfinite", Nvfp4NonFinite, nonfinite, " for the NVFP4 record")
    if nf4 is Nvfp4NonFinite.FINITE:
        _require_finite(fn, k)
    if nf4 is Nvfp4NonFinite.TRITON:
        return _encode_nvfp4_triton(fn, k, rule4)
    return _encode_nvfp4(k, rule4)


def _require_finite(fn: str, k: torch.Tensor) -> None:
    if not bool(torch.isfinite(k).all()):
        fail(fn, "k", "must be finite under nonfinite=finite (pick the producer's non-finite policy "
             "to model NaN/Inf)", f"{int((~torch.isfinite(k)).sum())} non-finite elements")


def _encode_mxfp8(k: torch.Tensor, rule: ScaleRule, nf: NonFinite) -> tuple[torch.Tensor, torch.Tensor]:
    """Each 32-group padded with +0 to a 64-wide tile (a group's amax, NaN and Inf status are the
    tile's) and quantised by the float64 tile quantiser; the padding codes are dropped."""
    n, g = k.shape[0], HEAD_DIM // V41_MXFP8_GROUP
    groups = k.to(torch.float32).reshape(n, g, V41_MXFP8_GROUP)
    tiles = torch.cat((groups, torch.zeros_like(groups)), dim=-1).reshape(n, 2 * HEAD_DIM)
    codes, sbytes = quantize_rows_f64(tiles, rule, Fp8Flavour.E4M3FN, nf, E4M3_MAX)
    return codes.reshape(n, g, 2 * V41_MXFP8_GROUP)[..., :V41_MXFP8_GROUP].reshape(n, HEAD_DIM), sbytes


def _encode_nvfp4(k: torch.Tensor, rule: Nvfp4ScaleRule) -> tuple[torch.Tensor, torch.Tensor]:
    n, g = k.shape[0], HEAD_DIM // V41_NVFP4_GROUP
    groups = k.to(torch.float32).reshape(n, g, V41_NVFP4_GROUP)
    bad = ~torch.isfinite(groups).all(dim=-1)  # POISON groups (only reachable under POISON)
    clean = torch.where(bad.unsqueeze(-1), 0.0, groups)
    sbytes = nvfp4_scale_bytes_trusted(clean.abs().amax(dim=-1), rule)
    y = div_rn_f32(clean, decode_e4m3fn(sbytes).unsqueeze(-1))
    codes = encode_e2m1_trusted(y)
    codes = torch.where(bad.unsqueeze(-1), torch.zeros_like(codes), codes)
    sbytes = torch.where(bad, torch.full_like(sbytes, NVFP4_POISON_SCALE_BYTE), sbytes)
    return pack_e2m1(codes.reshape(n, HEAD_DIM)), sbytes


def _encode_nvfp4_triton(fn: str, k: torch.Tensor, rule: Nvfp4ScaleRule) -> tuple[torch.Tensor, torch.Tensor]:
    """``Nvfp4NonFinite.TRITON`` (vLLM 0.33.0): amax over the non-NaN elements (Inf included), the
    scale of that amax (Inf -> 448), ``div_rn`` by the decoded scale, then +-Inf -> +-6 and
    NaN -> +6 (``cvt.rn.satfinite.e2m1x2.f32``). An all-NaN group raises (unspecified clamp)."""
    n, g = k.shape[0], HEAD_DIM // V41_NVFP4_GROUP
    groups = k.to(torch.float32).reshape(n, g, V41_NVFP4_GROUP)
    nan = torch.isnan(groups)
    if bool(nan.all(dim=-1).any()):
        fail(fn, "k", "must not hold a 16-group of NaN only under nonfinite=triton (vLLM's clamp of a NaN "
             "amax is unspecified)", f"{int(nan.all(dim=-1).sum())} all-NaN groups")
    amax = torch.where(nan, 0.0, groups.abs()).amax(dim=-1)
    sbytes = nvfp4_scale_bytes_trusted(amax, rule)
    y = div_rn_f32(groups, decode_e4m3fn(sbytes).unsqueeze(-1))
    codes = encode_e2m1_trusted(torch.where(torch.isnan(y), E2M1_MAX, y))  # +-Inf saturate inside
    return pack_e2m1(codes.reshape(n, HEAD_DIM)), sbytes


def decode_records(
    data: torch.Tensor,
    scales: torch.Tensor,
    record: V41Record | str,
    consumer: Ue8m0Consumer | str = Ue8m0Consumer.EXACT,
    e2m1_zero: E2m1Zero | str = E2m1Zero.SIGNED,
) -> torch.Tensor:
    """bf16 rows ``[N, 512]`` from ``data [N, D]`` and ``scales [N, S]``: ``value * scale`` formed
    exactly (float64) and rounded once to bf16. MXFP8 scale bytes 0/255 follow ``consumer``
    (H4); NVFP4 scales are E4M3FN values (0x7F/0xFF NaN, so a poisoned group reads NaN); the
    NVFP4 code 0x8 reads -0.0 or +0.0 per ``e2m1_zero`` (:class:`~.policies.E2m1Zero`)."""
    fn = "decode_records"
    record = as_record(fn, record)
    e2m1_zero = check_enum(fn, "e2m1_zero", E2m1Zero, e2m1_zero)
    d, sc = _PARTS[record]
    check_dtype(fn, "data", data, (torch.uint8,))
    check_dtype(fn, "scales", scales, (torch.uint8,))
    check_rank(fn, "data", data, 2)
    if data.shape[1] != d:
        fail(fn, "data", f"must have shape [N, {d}] for {record.value}", f"shape {tuple(data.shape)}")
    if tuple(scales.shape) != (data.shape[0], sc):
        fail(fn, "scales", f"must have shape [{data.shape[0]}, {sc}] for {record.value}", f"shape {tuple(scales.shape)}")
    n = data.shape[0]
    if record is V41Record.MXFP8:
        vals = decode_fp8(data, Fp8Flavour.E4M3FN).to(torch.float64)
        mult = decode_ue8m0(scales, consumer).to(torch.float64)
    else:
        vals = decode_e2m1(unpack_e2m1(data)).to(torch.float64)
        if e2m1_zero is E2m1Zero.POSITIVE:
            vals = vals + 0.0  # -0.0 + 0.0 = +0.0 (round to nearest); every other value unchanged
        mult = decode_e4m3fn(scales).to(torch.float64)
    out = vals.reshape(n, sc, HEAD_DIM // sc) * mult.unsqueeze(-1)
    return out.reshape(n, HEAD_DIM).to(torch.bfloat16)


# --------------------------------------------------------------------------- insert / read


def _check_slots(fn: str, arg: str, slots: torch.Tensor) -> torch.Tensor:
    check_dtype(fn, arg, slots, INDEX_DTYPES)
    check_rank(fn, arg, slots, 1)
    return slots.to(torch.int64)


def _views(cache: torch.Tensor, nb: int, bs: int, p: int, record: V41Record, layout: V41Layout):
    """Non-overlapping ``[nb, bs, D]`` data and ``[nb, bs, S]`` scale views of the page bytes."""
    d, sc = _PARTS[record]
    off = cache.storage_offset()
    if layout is V41Layout.INTERLEAVED:
        return (torch.as_strided(cache, (nb, bs, d), (p, d + sc, 1), off),
                torch.as_strided(cache, (nb, bs, sc), (p, d + sc, 1), off + d))
    return (torch.as_strided(cache, (nb, bs, d), (p, d, 1), off),
            torch.as_strided(cache, (nb, bs, sc), (p, sc, 1), off + bs * d))


def insert(
    cache: torch.Tensor,
    k: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_size: int,
    record: V41Record | str,
    layout: V41Layout | str,
    mxfp8_rule: ScaleRule | str = ScaleRule.AMAX_CLAMP,
    nonfinite: NonFinite | Nvfp4NonFinite | str = "finite",
    nvfp4_rule: Nvfp4ScaleRule | str = Nvfp4ScaleRule.RECIP_MUL,
    slot_skip: SlotSkip | str = SlotSkip.ALL_NEGATIVE,
) -> torch.Tensor:
    """Encode ``k`` (``encode_records``) and write token ``t`` to global slot ``slot_mapping[t]`` in
    ``layout``; returns a NEW cache (same sizes, strides, offset; other bytes copied unchanged).

    slot_mapping: int ``[L]``, ``L <= N``. slot_skip: ALL_NEGATIVE skips every negative slot
    (``rope_quant_insert``, ``fused_compress_quant_cache.py:445-447,499-501``); MINUS1_ONLY skips ``-1`` and
    raises for other negatives, which ``_quantize_and_insert_k_mxfp8_kernel`` would write out of
    bounds (``cache_utils.py:207-209``). A slot ``>= num_blocks*bs`` or written twice raises
    InputError (FlashInfer 0.7.2 lets the lowest token win a repeated slot; not modelled).
    """
    fn = "insert"
    record, layout = as_record(fn, record), _layout(fn, layout)
    nb, bs, p = cache_geometry(fn, cache, block_size, record)
    _check_k(fn, k)
    slots = _check_slots(fn, "slot_mapping", slot_mapping)
    if slots.shape[0] > k.shape[0]:
        fail(fn, "slot_mapping", f"must not be longer than k (N = {k.shape[0]})", f"length {slots.shape[0]}")
    slot_skip = check_enum(fn, "slot_skip", SlotSkip, slot_skip)
    if slot_skip is SlotSkip.MINUS1_ONLY and bool(((slots < 0) & (slots != -1)).any()):
        fail(fn, "slot_mapping", "may hold no negative value other than -1 under slot_skip=MINUS1_ONLY: the "
             "Triton writer skips only -1 and would write other negative slots out of bounds")
    keep = slots >= 0
    live = slots[keep]
    if live.numel() and int(live.max()) >= nb * bs:
        fail(fn, "slot_mapping", f"must be < num_blocks*block_size = {nb * bs} (out of range)", f"max {int(live.max())}")
    if live.unique().numel() != live.numel():
        fail(fn, "slot_mapping", "must not write one slot twice (producer threads would race)")
    data, scales = encode_records(k[: slots.shape[0]][keep.to(k.device)], record, mxfp8_rule, nonfinite, nvfp4_rule)
    out = clone_storage(cache)
    dv, sv = _views(out, nb, bs, p, record, layout)
    # k and slot_mapping may live on another device than the cache (the compressor's reference
    # quantises on the CPU): the bytes go where the cache is
    live = live.to(out.device)
    dv[live // bs, live % bs] = data.to(out.device)
    sv[live // bs, live % bs] = scales.to(out.device)
    return out


def read_records(cache: torch.Tensor, slots: torch.Tensor, block_size: int, record: V41Record | str,
                 layout: V41Layout | str) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw ``(data [S, D], scales [S, S_bytes])`` of global ``slots`` read in ``layout``."""
    fn = "read_records"
    record, layout = as_record(fn, record), _layout(fn, layout)
    nb, bs, p = cache_geometry(fn, cache, block_size, record)
    s = _check_slots(fn, "slots", slots)
    if bool(((s < 0) | (s >= nb * bs)).any()):
        fail(fn, "slots", f"must lie in [0, num_blocks*block_size = {nb * bs})")
    dv, sv = _views(cache, nb, bs, p, record, layout)
    return dv[s // bs, s % bs], sv[s // bs, s % bs]


def dequantize_slots(cache: torch.Tensor, slots: torch.Tensor, block_size: int, record: V41Record | str,
                     layout: V41Layout | str, consumer: Ue8m0Consumer | str = Ue8m0Consumer.EXACT,
                     e2m1_zero: E2m1Zero | str = E2m1Zero.SIGNED) -> torch.Tensor:
    """bf16 rows ``[S, 512]`` of global ``slots`` (``decode_records`` of ``read_records``)."""
    data, scales = read_records(cache, slots, block_size, record, layout)
    return decode_records(data, scales, record, consumer, e2m1_zero)


def dequantize_all(cache: torch.Tensor, block_size: int, record: V41Record | str, layout: V41Layout | str,
                   consumer: Ue8m0Consumer | str = Ue8m0Consumer.EXACT) -> torch.Tensor:
    """bf16 ``[num_blocks * bs, 512]``: row ``s`` = dequantised slot ``s`` (stale bytes included)."""
    nb, bs, _ = cache_geometry("dequantize_all", cache, block_size, as_record("dequantize_all", record))
    return dequantize_slots(cache, torch.arange(nb * bs, device=cache.device), block_size, record, layout, consumer)


def gather(cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
           record: V41Record | str, layout: V41Layout | str, gather_lens: torch.Tensor | None = None,
           consumer: Ue8m0Consumer | str = Ue8m0Consumer.EXACT, offset: int = 0,
           e2m1_zero: E2m1Zero | str = E2m1Zero.SIGNED) -> tuple[torch.Tensor, torch.Tensor]:
    """Model of vLLM 0.33.0 ``dequantize_and_gather_k_cache`` on a V4.1 cache
    (``_dequantize_and_gather_k_mxfp8_kernel`` / ``_nvfp4_kernel``, ``V:.../deepseek_v41/common/ops/
    cache_utils.py:528-655``): output row ``offset + i`` of request ``b`` is ``dequantize_slots`` of
    the slot ``gather_plan.gather_plan`` names (position ``L - g + i`` through the block table).
    Returns ``(out bf16 [R, offset + max(g), 512], valid bool [R, offset + max(g)])``; unwritten
    rows are zero here (stale in a kernel's workspace). The kernels form ``value * scale`` in fp32,
    exactly (<= 4 + 4 significant bits, inside the fp32 range), then round once to bf16, as
    ``decode_records`` does; MXFP8 scale bytes 0/255 follow ``consumer`` (Triton: ``exp2(b - 127)``
    -> ``Ue8m0Consumer.TRITON``); NVFP4 scales are E4M3 bytes (0x7F/0xFF read NaN) and code 0x8
    reads per ``e2m1_zero`` (the Triton kernel: ``E2m1Zero.POSITIVE``)."""
    fn = "gather"
    record, layout = as_record(fn, record), _layout(fn, layout)
    nb, bs, _ = cache_geometry(fn, cache, block_size, record)
    plan = gather_plan(fn, block_table, seq_lens, bs, nb, gather_lens, offset)
    out = torch.zeros((plan.requests, plan.width, HEAD_DIM), dtype=torch.bfloat16, device=cache.device)
    valid = torch.zeros((plan.requests, plan.width), dtype=torch.bool, device=cache.device)
    if plan.slot.numel():
        ri, rr = plan.req.to(cache.device), plan.row.to(cache.device)
        out[ri, rr] = dequantize_slots(cache, plan.slot.to(cache.device), bs, record, layout, consumer, e2m1_zero)
        valid[ri, rr] = True
    return out, valid


def defined_byte_mask(cache: torch.Tensor, written_slots: torch.Tensor, block_size: int,
                      record: V41Record | str, layout: V41Layout | str) -> torch.Tensor:
    """bool ``[num_blocks, page_stride]``: True on every byte of the records of ``written_slots``
    (negative entries ignored); V4.1 records have no pad byte, so all R bytes are defined."""
    fn = "defined_byte_mask"
    record, layout = as_record(fn, record), _layout(fn, layout)
    nb, bs, p = cache_geometry(fn, cache, block_size, record)
    s = _check_slots(fn, "written_slots", written_slots)
    s = s[s >= 0]
    if bool((s >= nb * bs).any()):
        fail(fn, "written_slots", f"must be < num_blocks*block_size = {nb * bs}")
    d, sc = _PARTS[record]
    d_addr, s_addr = _addresses(s, bs, p, record, layout)
    dev = d_addr.device
    mask = torch.zeros(nb * p, dtype=torch.bool, device=dev)
    mask[(d_addr.unsqueeze(1) + torch.arange(d, device=dev)).flatten()] = True
    mask[(s_addr.unsqueeze(1) + torch.arange(sc, device=dev)).flatten()] = True
    return mask.reshape(nb, p)
