"""The 584-byte MODEL1 (``fp8_ds_mla``) paged KV cache: layout, insert, read, dequantise, gather
(datapath 1.1-1.3, 2.0-2.2, 2.4, 3, 4.5; hazards H1, H5, H8, H12).

Page layout for ``bs`` entries per page and page stride ``P`` bytes (``P >= bs * 584``)::

    [0, bs*576)            data rows: entry e at [e*576, e*576 + 576)
                             bytes [0, 448)   FP8 codes of NoPE dims 0..447
                             bytes [448, 576) bfloat16 (little-endian) of dims 448..511, verbatim
    [bs*576, bs*584)       scale rows: entry e at [bs*576 + e*8, +8): 7 UE8M0 bytes + pad byte (0)
    [bs*584, P)            page tail, never written

Global slot ``s`` -> ``page = s // bs``, ``e = s % bs``; byte addresses (int64) in
``slot_addresses``. The page stride is always ``cache.stride(0)`` (H12); accepted cache tensors
(``uint8``) are the 2-D form ``[num_blocks, >= bs*584]`` with strides ``(P, 1)`` and the kernel
views ``[num_blocks, bs, 584]`` (strides ``(P, 584, 1)``) and ``[num_blocks, bs, 1, 584]``. The
storage must hold ``num_blocks * P`` bytes from the view's offset (what vLLM allocates).

Defined bytes (H5): 576 data bytes + 7 scale bytes per written slot (583); the pad byte is 0 from
every vLLM writer (this reference writes 0) but undefined from FlashMLA's quantiser; page tails
and unwritten slots are stale. ``defined_byte_mask`` marks them.

Production writers modelled by the parameters of ``insert`` (datapath 2.1-2.4):
  SWA CUDA/HIP writer            rule=AMAX_CLAMP, slot_skip=ALL_NEGATIVE, nonfinite=CUDA_SATFINITE
                                 (gfx942: flavour=E4M3FNUZ, clamp=FNUZ_GFX942_CLAMP)
  Triton quantize_and_insert     rule=AMAX_CLAMP, slot_skip=MINUS1_ONLY, nonfinite=TRITON
  CuTe-DSL compressor (NVIDIA)   rule=SCALE_CLAMP (bf16 pre-quantisation rows as input, H7)
  Triton compressor (ROCm/XPU)   rule=AMAX_CLAMP, OCP on every platform
"""

from __future__ import annotations

import sys

import torch

from ..constants import (
    DATA_ROW_BYTES,
    HEAD_DIM,
    N_TILES,
    NOPE_DIM,
    PAD_BYTE_INDEX,
    RECORD_BYTES,
    SCALE_ROW_BYTES,
    production_page_stride,
)
from ..errors import INDEX_DTYPES, check_dtype, check_enum, check_int, check_rank, check_tensor, fail
from ..formats.fp8 import validate_flavour, validate_nonfinite, fp8_max
from .gather_plan import gather_plan
from ..storage import clone_storage
from ..policies import Fp8Decode, Fp8Flavour, Fp8Subnormals, NonFinite, ScaleRule, SlotSkip, Ue8m0Consumer
from ..formats.quant import quantize_tiles_trusted, validate_rule, dequantize_tiles, validate_subnormals

__all__ = [
    "empty_cache",
    "kernel_view",
    "cache_geometry",
    "slot_addresses",
    "page_bytes",
    "encode_records",
    "decode_records",
    "insert",
    "read_records",
    "dequantize_slots",
    "dequantize_all",
    "gather",
    "defined_byte_mask",
]


# --------------------------------------------------------------------------- geometry


def empty_cache(num_blocks: int, block_size: int, page_stride: int | None = None, fill: int = 0,
                device: str | torch.device = "cpu") -> torch.Tensor:
    """A 2-D ``uint8`` cache ``[num_blocks, page_stride]`` filled with the byte ``fill``.

    ``page_stride`` defaults to vLLM's ``production_page_stride(block_size)``
    (``round_up(bs*584, 576)``: 37 440 for bs=64, 1 728 for bs=2; datapath 1.2).
    """
    fn = "empty_cache"
    check_int(fn, "num_blocks", num_blocks, minimum=1)
    check_int(fn, "block_size", block_size, minimum=1)
    if page_stride is None:
        page_stride = production_page_stride(block_size)
    check_int(fn, "page_stride", page_stride, minimum=block_size * RECORD_BYTES)
    check_int(fn, "fill", fill, minimum=0)
    if fill > 255:
        fail(fn, "fill", "must be a byte value in [0, 255]", fill)
    return torch.full((num_blocks, page_stride), fill, dtype=torch.uint8, device=device)


def kernel_view(cache: torch.Tensor, block_size: int) -> torch.Tensor:
    """The kernels' ``[num_blocks, bs, 584]`` view (strides ``(P, 584, 1)``) of any accepted cache.

    Its "584-byte rows" are not records (datapath 1.2); only the page-split reading is meaningful.
    """
    nb, bs, p = cache_geometry("kernel_view", cache, block_size)
    return torch.as_strided(cache, (nb, bs, RECORD_BYTES), (p, RECORD_BYTES, 1), cache.storage_offset())


def cache_geometry(fn: str, cache: torch.Tensor, block_size: int) -> tuple[int, int, int]:
    """Validate ``cache`` and return ``(num_blocks, block_size, page_stride)`` (page stride = stride(0))."""
    check_dtype(fn, "cache", cache, (torch.uint8,))
    check_int(fn, "block_size", block_size, minimum=1)
    check_rank(fn, "cache", cache, (2, 3, 4))
    nb, p = cache.shape[0], cache.stride(0)
    need = block_size * RECORD_BYTES
    if nb < 1:
        fail(fn, "cache", "must have at least one page", f"shape {tuple(cache.shape)}")
    if cache.dim() == 2:
        if cache.stride(1) != 1 or cache.shape[1] < need:
            fail(fn, "cache", f"2-D form must be [num_blocks, >= block_size*584 = {need}] with unit "
                 "byte stride", f"shape {tuple(cache.shape)} strides {cache.stride()}")
    else:
        rows = cache.shape[1]
        ok = rows == block_size and cache.shape[-1] == RECORD_BYTES and cache.stride(-1) == 1
        ok = ok and (rows == 1 or cache.stride(1) == RECORD_BYTES)
        if cache.dim() == 4:
            ok = ok and cache.shape[2] == 1
        if not ok:
            fail(fn, "cache", f"kernel view must be [num_blocks, block_size={block_size}, (1,) 584] with "
                 "strides (page_stride, 584, (.,) 1)", f"shape {tuple(cache.shape)} strides {cache.stride()}")
    if nb > 1 and p < need:
        fail(fn, "cache", f"page stride cache.stride(0) must be >= block_size*584 = {need}", p)
    if nb > 1 and cache.dim() == 2 and p < cache.shape[1]:
        fail(fn, "cache", "2-D form must not overlap pages (stride(0) >= shape[1])",
             f"shape {tuple(cache.shape)} strides {cache.stride()}")
    if nb == 1:
        p = max(p, need) if cache.dim() > 2 else max(p, cache.shape[1])
    avail = cache.untyped_storage().nbytes() - cache.storage_offset()
    if avail < nb * p:
        fail(fn, "cache", f"storage must hold num_blocks*page_stride = {nb * p} bytes from the view's "
             "offset (vLLM allocates whole pages)", f"{avail} bytes")
    return nb, block_size, p


def flat_bytes(cache: torch.Tensor, nb: int, p: int) -> torch.Tensor:
    """1-D uint8 view of the ``nb * p`` page bytes backing ``cache`` (writes go to ``cache``)."""
    return torch.as_strided(cache, (nb * p,), (1,), cache.storage_offset())


def page_bytes(cache: torch.Tensor, block_size: int) -> torch.Tensor:
    """A ``[num_blocks, page_stride]`` uint8 view of every byte of every page (tails included)."""
    nb, _, p = cache_geometry("page_bytes", cache, block_size)
    return torch.as_strided(cache, (nb, p), (p, 1), cache.storage_offset())


def slot_addresses(slots: torch.Tensor, block_size: int, page_stride: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Byte addresses (int64) of the data row and the scale row of global ``slots`` (datapath 1.3).

    ``data = page*P + e*576`` (code of dim i at ``data + i``, bf16 of dim 448+j at ``data + 448 + 2j``);
    ``scale = page*P + bs*576 + e*8`` (tile b at ``scale + b``, pad at ``scale + 7``);
    ``page = s // bs``, ``e = s % bs``. Slots must be >= 0.
    """
    fn = "slot_addresses"
    check_dtype(fn, "slots", slots, INDEX_DTYPES)
    check_int(fn, "block_size", block_size, minimum=1)
    check_int(fn, "page_stride", page_stride, minimum=block_size * RECORD_BYTES)
    s = slots.to(torch.int64)
    if bool((s < 0).any()):
        fail(fn, "slots", "must be >= 0 (filter the -1 sentinels first)")
    return slot_addresses_trusted(s, block_size, page_stride)


def slot_addresses_trusted(s: torch.Tensor, bs: int, p: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``slot_addresses`` of int64 slots already known to be >= 0 (no check, no device sync)."""
    page, e = s // bs, s % bs
    return page * p + e * DATA_ROW_BYTES, page * p + bs * DATA_ROW_BYTES + e * SCALE_ROW_BYTES


def byte_index(addr: torch.Tensor, width: int) -> torch.Tensor:
    """``[S, width]`` int64 byte addresses ``addr[s] + j``, built on ``addr``'s device."""
    return addr.unsqueeze(1) + torch.arange(width, dtype=torch.int64, device=addr.device)


# --------------------------------------------------------------------------- records


def _check_k(fn: str, k: torch.Tensor) -> None:
    check_dtype(fn, "k", k, (torch.bfloat16,))
    check_rank(fn, "k", k, 2)
    if k.shape[1] != HEAD_DIM:
        fail(fn, "k", f"must have last dimension {HEAD_DIM} (448 NoPE + 64 RoPE dims)", f"shape {tuple(k.shape)}")


def encode_records(
    k: torch.Tensor,
    rule: ScaleRule | str,
    flavour: Fp8Flavour | str = Fp8Flavour.E4M3FN,
    nonfinite: NonFinite | str = NonFinite.FINITE,
    clamp: float | None = None,
    subnormals: Fp8Subnormals | str = Fp8Subnormals.KEEP,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode bf16 rows ``k [N, 512]`` (already roped) into MODEL1 record parts.

    Returns ``(data uint8 [N, 576], scales uint8 [N, 8])``: ``data[:, :448]`` = FP8 codes of the
    7 tiles (``quant.quantize_tiles`` under ``rule``/``flavour``/``nonfinite``/``clamp``/``subnormals``),
    ``data[:, 448:]`` = the little-endian bytes of ``k[:, 448:]`` verbatim, ``scales[:, :7]`` = UE8M0
    bytes, ``scales[:, 7]`` = 0 (the vLLM writers' pad byte). Under ``nonfinite=FINITE`` any
    non-finite element of ``k`` (RoPE dims included) raises; otherwise RoPE NaN/Inf are copied.
    """
    fn = "encode_records"
    check_tensor(fn, "k", k)
    _check_k(fn, k)
    rule = validate_rule(fn, rule)
    flavour = validate_flavour(fn, flavour)
    nonfinite = validate_nonfinite(fn, nonfinite)
    subnormals = validate_subnormals(fn, subnormals)
    fmax = fp8_max(flavour)
    if clamp is not None:
        if isinstance(clamp, bool) or not isinstance(clamp, (int, float)) or not (0.0 < float(clamp) <= fmax):
            fail("quantize_tiles", "clamp", f"must be None or a value in (0, {fmax}] for {flavour.value}", clamp)
    if nonfinite is NonFinite.FINITE and not bool(torch.isfinite(k).all()):  # the one device sync
        fail(fn, "k", "must be finite under nonfinite=FINITE (RoPE dims included)",
             f"{int((~torch.isfinite(k)).sum())} non-finite elements")
    return _encode_records(k, rule, flavour, nonfinite, fmax if clamp is None else float(clamp), subnormals)


def _encode_records(k: torch.Tensor, rule: ScaleRule, flavour: Fp8Flavour, nonfinite: NonFinite,
                    m: float, subnormals: Fp8Subnormals = Fp8Subnormals.KEEP) -> tuple[torch.Tensor, torch.Tensor]:
    """``encode_records`` of validated bf16 ``k [N, 512]`` (wide tensor operations, no sync)."""
    codes, sbytes = quantize_tiles_trusted(k[:, :NOPE_DIM], rule, flavour, nonfinite, m, subnormals)
    n = k.shape[0]
    data = torch.empty((n, DATA_ROW_BYTES), dtype=torch.uint8, device=k.device)
    data[:, :NOPE_DIM] = codes
    data[:, NOPE_DIM:] = _bf16_to_le_bytes(k[:, NOPE_DIM:])
    scales = torch.zeros((n, SCALE_ROW_BYTES), dtype=torch.uint8, device=k.device)
    scales[:, :N_TILES] = sbytes
    return data, scales


def _bf16_to_le_bytes(x: torch.Tensor) -> torch.Tensor:
    """Little-endian bytes ``[..., 2*n]`` of bf16 ``x [..., n]`` (explicit, host-endianness free)."""
    if sys.byteorder == "little":  # the in-memory bytes are the little-endian bytes
        return x.contiguous().view(torch.uint8)
    bits = x.contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
    out = torch.stack(((bits & 0xFF), (bits >> 8)), dim=-1)
    return out.reshape(*x.shape[:-1], 2 * x.shape[-1]).to(torch.uint8)


def _le_bytes_to_bf16(b: torch.Tensor) -> torch.Tensor:
    """bf16 ``[..., n]`` from little-endian bytes ``[..., 2*n]``."""
    pairs = b.reshape(*b.shape[:-1], b.shape[-1] // 2, 2).to(torch.int32)
    bits = pairs[..., 0] | (pairs[..., 1] << 8)
    bits = torch.where(bits >= 0x8000, bits - 0x10000, bits).to(torch.int16)
    return bits.view(torch.bfloat16)


def decode_records(
    data: torch.Tensor,
    scales: torch.Tensor,
    flavour: Fp8Flavour | str = Fp8Flavour.E4M3FN,
    consumer: Ue8m0Consumer | str = Ue8m0Consumer.EXACT,
    read: Fp8Decode | str = Fp8Decode.EXACT,
) -> torch.Tensor:
    """bf16 rows ``[N, 512]`` from record parts ``data [N, 576]``, ``scales [N, 8]`` (``read``: how
    the reader decodes exponent-0 FP8 codes, ``reference.policies.Fp8Decode``).

    NoPE: ``code * 2**(s - 127)`` formed exactly (float64) and rounded once to bf16 (RNE), which is
    what every consumer computes (datapath 3: fp32 or bf16 multiply of exact operands). It is
    exact for scale bytes 1..254 unless the product leaves bf16's range (overflow to +-Inf for
    bytes >= 247 with large codes; values below 2**-133 for bytes <= 13, never produced by finite
    writers whose bytes lie in [105, 247]). Bytes 0 and 255 follow ``consumer`` (H4).
    RoPE: the stored bf16 verbatim.
    """
    fn = "decode_records"
    check_dtype(fn, "data", data, (torch.uint8,))
    check_dtype(fn, "scales", scales, (torch.uint8,))
    check_rank(fn, "data", data, 2)
    if data.shape[1] != DATA_ROW_BYTES:
        fail(fn, "data", f"must have shape [N, {DATA_ROW_BYTES}]", f"shape {tuple(data.shape)}")
    if tuple(scales.shape) != (data.shape[0], SCALE_ROW_BYTES):
        fail(fn, "scales", f"must have shape [{data.shape[0]}, {SCALE_ROW_BYTES}]", f"shape {tuple(scales.shape)}")
    flavour = validate_flavour(fn, flavour)
    nope = dequantize_tiles(data[:, :NOPE_DIM], scales[:, :N_TILES], flavour, consumer, read)
    rope = _le_bytes_to_bf16(data[:, NOPE_DIM:])
    return torch.cat((nope.to(torch.bfloat16), rope), dim=1)


# --------------------------------------------------------------------------- insert / read


def _check_slots(fn: str, arg: str, slots: torch.Tensor) -> torch.Tensor:
    check_dtype(fn, arg, slots, INDEX_DTYPES)
    check_rank(fn, arg, slots, 1)
    return slots.to(torch.int64)


def insert(
    cache: torch.Tensor,
    k: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_size: int,
    rule: ScaleRule | str,
    flavour: Fp8Flavour | str = Fp8Flavour.E4M3FN,
    nonfinite: NonFinite | str = NonFinite.FINITE,
    slot_skip: SlotSkip | str = SlotSkip.ALL_NEGATIVE,
    clamp: float | None = None,
    inplace: bool = False,
    subnormals: Fp8Subnormals | str = Fp8Subnormals.KEEP,
) -> torch.Tensor:
    """Quantise ``k`` and write token ``t`` to global slot ``slot_mapping[t]``; returns a NEW cache.

    cache: uint8 cache in an accepted form (module docstring); it is not modified. The result has
    the same sizes, strides and storage offset; bytes outside the written slots' 584 bytes
    (page tails, other slots) are copied unchanged.
    k: bfloat16 ``[N, 512]``, already roped. slot_mapping: int32/int64 ``[L]``, ``L <= N``; only
    tokens ``t < L`` are considered (DP padding rows of ``k`` are ignored, datapath 2.1 step 1).
    slot_skip: ALL_NEGATIVE (CUDA writer) skips every negative slot; MINUS1_ONLY (Triton writer)
    skips ``-1`` and raises for any other negative slot, which that writer would write out of
    bounds (``V:.../cache_utils.py:81-84``). Slots ``>= num_blocks * block_size`` and a slot
    written twice (a race between producer threads) raise InputError.
    rule/flavour/nonfinite/clamp/subnormals: as ``encode_records``.
    inplace: True writes into ``cache`` itself and returns it (same bytes, no whole-cache copy):
    for a caller that discards the input cache (building a case's history).
    """
    fn = "insert"
    nb, bs, p = cache_geometry(fn, cache, block_size)
    check_tensor(fn, "k", k)
    _check_k(fn, k)
    slots = _check_slots(fn, "slot_mapping", slot_mapping)
    slot_skip = check_enum(fn, "slot_skip", SlotSkip, slot_skip)
    if slot_skip is SlotSkip.NEGATIVE_WRAPS:
        fail(fn, "slot_skip", "NEGATIVE_WRAPS is a rule of the plain uniform-FP8 pool (caches.plain); a 584-byte "
             "page writer skips negative slots (MINUS1_ONLY or ALL_NEGATIVE)", slot_skip.value)
    rule = validate_rule(fn, rule)
    flavour = validate_flavour(fn, flavour)
    nonfinite = validate_nonfinite(fn, nonfinite)
    if slots.shape[0] > k.shape[0]:
        fail(fn, "slot_mapping", f"must not be longer than k (N = {k.shape[0]})", f"length {slots.shape[0]}")
    dev = cache.device
    slots = slots.to(dev)
    # Every slot rule in one reduction and one device -> host transfer (one sync): sorting makes
    # a repeated slot two equal neighbours.
    srt = torch.sort(slots).values
    neg_bad = (slots < 0) & (slots != -1)
    stats = torch.stack((
        (slots < 0).sum(),
        neg_bad.any().to(torch.int64) if slot_skip is SlotSkip.MINUS1_ONLY else slots.new_zeros(()),
        slots.max() if slots.numel() else slots.new_full((), -1),
        ((srt[1:] == srt[:-1]) & (srt[1:] >= 0)).any().to(torch.int64) if slots.numel() > 1 else slots.new_zeros(()),
    )).tolist()
    n_skipped, any_neg_bad, smax, dup = stats
    if any_neg_bad:
        fail(fn, "slot_mapping", "may hold no negative value other than -1 under slot_skip="
             "MINUS1_ONLY: the Triton writer skips only -1 and would write other negative slots "
             "out of bounds", f"{slots[neg_bad][:4].tolist()}")
    if smax >= nb * bs:
        fail(fn, "slot_mapping", f"must be < num_blocks*block_size = {nb * bs} (out of range)", f"max {smax}")
    if dup:
        fail(fn, "slot_mapping", "must not write one slot twice (producer threads would race)")
    # Distinct slots: every byte below is written at most once, so the scatter is deterministic on
    # every device. The skipped tokens are dropped first (a second sync only when there are any).
    rows = k[: slots.shape[0]]
    if n_skipped:
        tokens = torch.nonzero(slots >= 0).flatten()
        slots, rows = slots[tokens], rows[tokens.to(k.device)]
    data, scales = encode_records(rows, rule, flavour, nonfinite, clamp, subnormals)
    out = cache if inplace else clone_storage(cache)
    # Row scatter through two non-overlapping views of the page bytes: [nb, bs, 576] data rows at
    # page*P + e*576 and [nb, bs, 8] scale rows at page*P + bs*576 + e*8 (datapath 1.3).
    off = out.storage_offset()
    data_rows = torch.as_strided(out, (nb, bs, DATA_ROW_BYTES), (p, DATA_ROW_BYTES, 1), off)
    scale_rows = torch.as_strided(out, (nb, bs, SCALE_ROW_BYTES), (p, SCALE_ROW_BYTES, 1), off + bs * DATA_ROW_BYTES)
    page, entry = slots // bs, slots % bs
    data_rows[page, entry] = data.to(dev)
    scale_rows[page, entry] = scales.to(dev)
    return out


def read_records(cache: torch.Tensor, slots: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw record parts ``(data uint8 [S, 576], scales uint8 [S, 8])`` of global ``slots`` (>= 0, in range)."""
    fn = "read_records"
    nb, bs, p = cache_geometry(fn, cache, block_size)
    s = _check_slots(fn, "slots", slots).to(cache.device)
    if bool(((s < 0) | (s >= nb * bs)).any()):  # the one device sync
        fail(fn, "slots", f"must lie in [0, num_blocks*block_size = {nb * bs})")
    return _read(cache, s, nb, bs, p)


def _read(cache: torch.Tensor, s: torch.Tensor, nb: int, bs: int, p: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``read_records`` of int64 slots on ``cache``'s device already known to be in range."""
    flat = flat_bytes(cache, nb, p)
    d_addr, s_addr = slot_addresses_trusted(s, bs, p)
    return flat[byte_index(d_addr, DATA_ROW_BYTES)], flat[byte_index(s_addr, SCALE_ROW_BYTES)]


def dequantize_slots(
    cache: torch.Tensor,
    slots: torch.Tensor,
    block_size: int,
    flavour: Fp8Flavour | str = Fp8Flavour.E4M3FN,
    consumer: Ue8m0Consumer | str = Ue8m0Consumer.EXACT,
    read: Fp8Decode | str = Fp8Decode.EXACT,
) -> torch.Tensor:
    """bf16 rows ``[S, 512]`` of global ``slots`` (``decode_records`` of ``read_records``)."""
    data, scales = read_records(cache, slots, block_size)
    return decode_records(data, scales, flavour, consumer, read)


def _decode_slots(cache: torch.Tensor, s: torch.Tensor, nb: int, bs: int, p: int,
                  flavour: Fp8Flavour | str, consumer: Ue8m0Consumer | str,
                  read: Fp8Decode | str = Fp8Decode.EXACT) -> torch.Tensor:
    """``dequantize_slots`` of int64 slots on ``cache``'s device already known to be in range."""
    data, scales = _read(cache, s, nb, bs, p)
    return decode_records(data, scales, flavour, consumer, read)


def dequantize_all(
    cache: torch.Tensor,
    block_size: int,
    flavour: Fp8Flavour | str = Fp8Flavour.E4M3FN,
    consumer: Ue8m0Consumer | str = Ue8m0Consumer.EXACT,
    read: Fp8Decode | str = Fp8Decode.EXACT,
) -> torch.Tensor:
    """bf16 ``[num_blocks * bs, 512]``: row ``s`` = dequantised slot ``s`` (what an attention
    oracle indexes by global slot). Unwritten slots decode whatever stale bytes they hold."""
    nb, bs, p = cache_geometry("dequantize_all", cache, block_size)
    return _decode_slots(cache, torch.arange(nb * bs, device=cache.device), nb, bs, p, flavour, consumer, read)


def gather(
    cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    gather_lens: torch.Tensor | None = None,
    flavour: Fp8Flavour | str = Fp8Flavour.E4M3FN,
    consumer: Ue8m0Consumer | str = Ue8m0Consumer.EXACT,
    offset: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Model of vLLM ``dequantize_and_gather_k_cache`` (``V:.../cache_utils.py:249-365,474-525``;
    CuTe twin ``nvidia/ops/dequant_gather_k_cutedsl.py``; datapath 4.5).

    For request ``b`` with ``L = seq_lens[b]`` and ``g = gather_lens[b]`` (``L`` when None), output
    row ``offset + i`` (``0 <= i < g``) is the dequantised record at request position
    ``pos = L - g + i``, slot ``block_table[b, pos // bs] * bs + pos % bs``.
    Returns ``(out bf16 [R, offset + max(g), 512], valid bool [R, offset + max(g)])``; rows the
    kernel does not write (``valid`` False) are zero here and stale in the kernel's ``out``.
    Inputs: block_table int32/int64 ``[R, max_blocks]``; seq_lens, gather_lens int ``[R]`` with
    ``0 <= g <= L``; the table must cover every gathered position and its entries there must be
    valid pages ``[0, num_blocks)``. Scale bytes 0/255 decode per ``consumer`` (Triton and CuTe
    gathers: ``Ue8m0Consumer.TRITON`` / ``CUTE``).
    """
    fn = "gather"
    nb, bs, p = cache_geometry(fn, cache, block_size)
    plan = gather_plan(fn, block_table, seq_lens, bs, nb, gather_lens, offset)
    out = torch.zeros((plan.requests, plan.width, HEAD_DIM), dtype=torch.bfloat16, device=cache.device)
    valid = torch.zeros((plan.requests, plan.width), dtype=torch.bool, device=cache.device)
    if plan.slot.numel() == 0:
        return out, valid
    rows = _decode_slots(cache, plan.slot.to(cache.device), nb, bs, p, flavour, consumer)
    ri, rr = plan.req.to(cache.device), plan.row.to(cache.device)
    out[ri, rr] = rows
    valid[ri, rr] = True
    return out, valid


# --------------------------------------------------------------------------- defined bytes


def defined_byte_mask(
    cache: torch.Tensor | tuple[int, int],
    written_slots: torch.Tensor,
    block_size: int,
    include_pad: bool = False,
) -> torch.Tensor:
    """bool ``[num_blocks, page_stride]`` over the page bytes: True on the defined bytes of
    ``written_slots`` (H5): 576 data bytes + 7 scale bytes per slot, + the pad byte when
    ``include_pad`` (only meaningful for vLLM producers, which write 0 there).

    cache: an accepted cache tensor (geometry read from it) or a ``(num_blocks, page_stride)`` pair.
    written_slots: int ``[S]``; negative entries (the -1 sentinel) are ignored.
    """
    fn = "defined_byte_mask"
    if isinstance(cache, torch.Tensor):
        nb, bs, p = cache_geometry(fn, cache, block_size)
        device = cache.device
    else:
        if not (isinstance(cache, tuple) and len(cache) == 2):
            fail(fn, "cache", "must be a cache tensor or a (num_blocks, page_stride) tuple", type(cache).__name__)
        nb = check_int(fn, "cache[0] (num_blocks)", cache[0], minimum=1)
        check_int(fn, "block_size", block_size, minimum=1)
        p = check_int(fn, "cache[1] (page_stride)", cache[1], minimum=block_size * RECORD_BYTES)
        bs, device = block_size, torch.device("cpu")
    s = _check_slots(fn, "written_slots", written_slots).cpu()
    s = s[s >= 0]
    if bool((s >= nb * bs).any()):
        fail(fn, "written_slots", f"must be < num_blocks*block_size = {nb * bs}")
    mask = torch.zeros(nb * p, dtype=torch.bool)
    d_addr, s_addr = slot_addresses(s, bs, p)
    mask[(d_addr.unsqueeze(1) + torch.arange(DATA_ROW_BYTES)).flatten()] = True
    n_scale = SCALE_ROW_BYTES if include_pad else PAD_BYTE_INDEX
    mask[(s_addr.unsqueeze(1) + torch.arange(n_scale)).flatten()] = True
    return mask.reshape(nb, p).to(device)
