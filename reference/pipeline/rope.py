"""GPT-J RoPE on the 64 RoPE dims of a DSv4 latent row, forward and inverse, bit-exact.

Spec: datapath 2.1 step 3 (shipped SWA writer), 2.3 / 2.4 (compressor RoPE), 5 (cos/sin cache,
YaRN), hazard H6 (FMA contraction); attention 3.2 (convention), 3.3 (inverse RoPE of the output).

Convention (attention 3.2)
- A row is ``[..., 512]``: dims ``[0, 448)`` NoPE (untouched), dims ``[448, 512)`` RoPE.
- GPT-J (interleaved) pairs: pair ``j`` (``0 <= j < 32``) is ``(e, o) = (x[448+2j], x[449+2j])``
  and uses ``cos[j], sin[j]`` of the position's cache row.
- The cos/sin cache is fp32 ``[max_pos, 64]`` = ``[cos(32) | sin(32)]``
  (``V:model_executor/layers/rotary_embedding/deepseek_scaling_rope.py:224-255``,
  ``V:models/deepseek_v4/common/ops/fused_inv_rope_fp8_quant.py:131-133``).
- Forward: ``e' = e*cos - o*sin``, ``o' = e*sin + o*cos``.
  Inverse (attention 3.3): ``e' = e*cos + o*sin``, ``o' = o*cos - e*sin``.

Arithmetic (``RopeArithmetic``; ``fl32`` = IEEE binary32 round-to-nearest-even; every formula is
evaluated *exactly* as written, with one fp32 rounding per ``fl32``/``fma``):

===========  ==========================================  ==========================================
policy       forward                                     inverse
===========  ==========================================  ==========================================
FMA          e' = fma(e, cos, -fl32(o*sin))              e' = fma(e, cos, fl32(o*sin))
(CUDA SWA    o' = fma(e, sin,  fl32(o*cos))              o' = fma(-e, sin, fl32(o*cos))
writer, H6)  (PROBE-verified, datapath 2.1 step 3)       (same rule: the product with e is fused)
FMA_TRITON   e' = fma(e, cos, -fl32(o*sin))              e' = fma(e, cos,  fl32(o*sin))
(Triton)     o' = fma(o, cos,  fl32(e*sin))              o' = fma(o, cos, -fl32(e*sin))
SEPARATE     e' = fl32(fl32(e*cos) - fl32(o*sin))        e' = fl32(fl32(e*cos) + fl32(o*sin))
             o' = fl32(fl32(e*sin) + fl32(o*cos))        o' = fl32(fl32(o*cos) - fl32(e*sin))
===========  ==========================================  ==========================================

FMA_TRITON models LLVM's contraction of ``a*b +- c*d`` written in Triton source: the *left*
product is fused (``fadd/fsub (fmul a b) (fmul c d) -> fma(a, b, +-(c*d))`` when both products
have equal use counts). Sources: compressor ``even*cos - odd*sin``, ``odd*cos + even*sin``
(``V:models/deepseek_v4/common/ops/fused_compress_quant_cache.py:329-330``); inverse
``x*cos + x'*sin`` / ``x*cos - x'*sin`` (``V:.../fused_inv_rope_fp8_quant.py:134-138``). The even
lane of the compressor is PROBE-verified (datapath 2.3); the odd lane and the inverse forms are
inferred from the source expression and checked by the GPU test
``tests/attention/test_rope.py::test_triton_contraction_matches`` where Triton is available.

Exact FMA emulation (``fma_f32``). For fp32 ``a, b, c`` the product ``a*b`` has at most 48
significant bits and is exact in float64. ``fl64(a*b + c)`` followed by ``fl32`` would round
twice (wrong in about 2**-29 of random cases). Instead the float64 sum is rounded *to odd*: with
the error-free TwoSum ``s + err = a*b + c`` (exact), the result is ``s`` if ``err == 0`` or the
last bit of ``s`` is 1, else the float64 neighbour of ``s`` in the direction of ``err``. Rounding
a round-to-odd result of precision 53 >= 24 + 2 to fp32 equals rounding the exact value to fp32
(Boldo & Melquiond, "Emulation of FMA and correctly rounded sums: proved algorithms using
rounding to odd", IEEE TC 2008). Every step is an IEEE float64 add/sub/mul, a comparison or
``nextafter``, so CPU and GPU give identical bits.

Rounding bound of forward-then-inverse (used by the tests): per pair, with ``R = |e| + |o|``,
``u = 2**-24`` and the table's ``delta = |cos**2 + sin**2 - 1|`` (exact, ``<= 2u + u**2`` for a
correctly rounded table), ``|x'' - x| <= R * (delta + 12u)``; see ``roundtrip_error_bound``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..constants import HEAD_DIM, ROPE_DIM, ROPE_OFFSET
from ..errors import INDEX_DTYPES, check_dtype, check_enum, check_int, fail
from ..policies import RopeArithmetic

__all__ = [
    "YarnConfig",
    "CosSinFlavour",
    "cos_sin_cache",
    "identity_cos_sin",
    "apply_rope",
    "rope_pairs",
    "fma_f32",
    "round_to_odd_sum_f64",
    "roundtrip_error_bound",
]

_FLOAT_INPUTS = (torch.float32, torch.bfloat16, torch.float16)
HALF_ROPE = ROPE_DIM // 2  # 32 pairs per row


# --------------------------------------------------------------------------- exact fp32 fma
def round_to_odd_sum_f64(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``RO_53(a + b)``: the float64 sum of float64 ``a`` and ``b`` rounded to odd.

    TwoSum (Knuth) gives ``s = fl64(a+b)`` and the exact error ``err`` (no FMA needed; valid when
    ``a + b`` does not overflow). If ``err != 0`` and ``s`` has an even last significand bit,
    the result is the float64 neighbour of ``s`` towards ``err``, which has an odd last bit.
    Non-finite ``s`` is returned unchanged.
    """
    s = a + b
    bp = s - a
    ap = s - bp
    err = (a - ap) + (b - bp)
    even = (s.view(torch.int64) & 1) == 0
    toward = torch.where(err > 0, torch.full_like(s, math.inf), torch.full_like(s, -math.inf))
    bump = (err != 0) & even & torch.isfinite(s)
    return torch.where(bump, torch.nextafter(s, toward), s)


def fma_f32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """Correctly rounded fp32 ``fma(a, b, c) = fl32(a*b + c)`` (one rounding), emulated exactly.

    ``a, b, c``: tensors holding fp32 values (dtype float32, or float64 holding fp32-representable
    values), broadcastable. Returns float32. NaN/Inf follow IEEE (``a*b`` and the sum are formed
    in float64, where fp32 operands cannot overflow). See the module docstring for the proof.
    """
    fn = "fma_f32"
    for name, t in (("a", a), ("b", b), ("c", c)):
        check_dtype(fn, name, t, (torch.float32, torch.float64))
        if t.dtype == torch.float64:
            bad = torch.isfinite(t) & (t.to(torch.float32).to(torch.float64) != t)
            if bool(bad.any()):
                fail(fn, name, "must hold fp32-representable values")
    p = a.to(torch.float64) * b.to(torch.float64)  # exact: <= 48 significant bits
    return round_to_odd_sum_f64(p, c.to(torch.float64)).to(torch.float32)


def _mul32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``fl32(a*b)`` for fp32 values carried in float64 (the float64 product is exact)."""
    return (a * b).to(torch.float32).to(torch.float64)


def _add32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``fl32(a+b)`` for fp32 values carried in float64: ``fl64`` then ``fl32`` is innocuous
    double rounding because 53 >= 2*24 + 2 (Figueroa 1995)."""
    return (a + b).to(torch.float32).to(torch.float64)


def _fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    return round_to_odd_sum_f64(a * b, c).to(torch.float32).to(torch.float64)


def rope_pairs(e: torch.Tensor, o: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               inverse: bool, arithmetic: RopeArithmetic) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate pairs ``(e, o)`` by ``(cos, sin)``: float64 tensors holding fp32 values
    (broadcastable). Returns ``(e', o')`` as float64 holding fp32 values. No validation: the
    public entry is ``apply_rope``; this is shared with the compressor and the epilogue."""
    A = RopeArithmetic
    if arithmetic == A.SEPARATE:
        if not inverse:
            return _add32(_mul32(e, cos), -_mul32(o, sin)), _add32(_mul32(e, sin), _mul32(o, cos))
        return _add32(_mul32(e, cos), _mul32(o, sin)), _add32(_mul32(o, cos), -_mul32(e, sin))
    if arithmetic == A.FMA:
        if not inverse:
            return _fma32(e, cos, -_mul32(o, sin)), _fma32(e, sin, _mul32(o, cos))
        return _fma32(e, cos, _mul32(o, sin)), _fma32(-e, sin, _mul32(o, cos))
    if arithmetic == A.FMA_TRITON:
        if not inverse:
            return _fma32(e, cos, -_mul32(o, sin)), _fma32(o, cos, _mul32(e, sin))
        return _fma32(e, cos, _mul32(o, sin)), _fma32(o, cos, -_mul32(e, sin))
    raise AssertionError(arithmetic)


# --------------------------------------------------------------------------- cos/sin cache
@dataclass(frozen=True)
class YarnConfig:
    """YaRN frequency scaling of DSv4 compressed layers (datapath 5; attention 3.2).

    ``factor``: scaling factor (DSv4: 16). ``original_max_position``: original context
    (DSv4: 65536). ``beta_fast``/``beta_slow``: correction-range rotations (vLLM defaults 32 / 1).
    mscale is disabled for DSv4 (``V:models/deepseek_v4/common/rope.py:42-43``), so the cache is
    not multiplied by any magnitude factor.
    """

    factor: float
    original_max_position: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0


class CosSinFlavour:
    """How ``cos_sin_cache`` evaluates the table.

    FLOAT64: frequencies, angles and cos/sin in float64 on the CPU, one rounding to fp32
        (angles exact to ~1e-16 relative: the 'true' table).
    VLLM: replays vLLM's own fp32 CPU construction op for op (``_compute_inv_freq`` and
        ``DeepseekV4ScalingRotaryEmbedding._compute_cos_sin_cache``,
        ``V:.../deepseek_scaling_rope.py:73-112,224-237``): fp32 ``base ** (arange/rot)``,
        fp32 angles ``t * inv_freq`` and torch fp32 ``cos``/``sin``. Bit-identical to vLLM's
        buffer when run with the same torch build on the same CPU ISA (torch's vectorised fp32
        ``cos``/``sin`` are not correctly rounded, so other builds may differ by an ulp).
    """

    FLOAT64 = "float64"
    VLLM = "vllm"


def _yarn_correction_dim(rot: float, dim: int, base: float, max_pos: int) -> float:
    # V:model_executor/layers/rotary_embedding/common.py:34-42
    return (dim * math.log(max_pos / (rot * 2 * math.pi))) / (2 * math.log(base))


def _yarn_low_high(cfg: YarnConfig, dim: int, base: float) -> tuple[float, float]:
    # V:.../common.py:46-59 (truncate=True: floor/ceil, clamp to [0, dim-1]); :65-66 singularity guard
    low = math.floor(_yarn_correction_dim(cfg.beta_fast, dim, base, cfg.original_max_position))
    high = math.ceil(_yarn_correction_dim(cfg.beta_slow, dim, base, cfg.original_max_position))
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    return float(low), float(high)


def _inv_freq(rope_dim: int, theta: float, yarn: YarnConfig | None, dtype: torch.dtype) -> torch.Tensor:
    """vLLM ``_compute_inv_freq`` (``deepseek_scaling_rope.py:73-106``) in ``dtype`` on the CPU.
    Plain RoPE (``yarn=None``) is vLLM's SWA-layer setting factor 1.0, whose interpolation and
    extrapolation frequencies coincide; it is evaluated as ``1/pos_freqs`` directly."""
    pos_freqs = theta ** (torch.arange(0, rope_dim, 2, dtype=dtype) / rope_dim)
    extrap = 1.0 / pos_freqs
    if yarn is None:
        return extrap
    interp = 1.0 / (yarn.factor * pos_freqs)
    low, high = _yarn_low_high(yarn, rope_dim, theta)
    ramp = torch.clamp((torch.arange(rope_dim // 2, dtype=dtype) - low) / (high - low), 0, 1)
    mask = 1 - ramp
    return interp * (1 - mask) + extrap * mask


def cos_sin_cache(max_pos: int, rope_dim: int = ROPE_DIM, theta: float = 10000.0,
                  yarn: YarnConfig | None = None, flavour: str = CosSinFlavour.FLOAT64,
                  device: torch.device | str | None = None) -> torch.Tensor:
    """fp32 ``[max_pos, rope_dim]`` table ``[cos(rope_dim/2) | sin(rope_dim/2)]`` (datapath 5).

    Row ``p``, column ``j < rope_dim/2``: ``cos(p * f_j)``; column ``rope_dim/2 + j``:
    ``sin(p * f_j)``, with ``f_j = theta**(-2j/rope_dim)`` (plain) or the YaRN-blended frequency.
    DSv4: SWA-only layers use plain ``theta = 1e4``; compressed layers ``theta = 1.6e5`` with
    ``YarnConfig(16, 65536)`` (attention 3.2). ``max_pos`` is the number of rows (vLLM builds
    ``original_max_position * factor`` rows). Always computed on the CPU (so the bits do not
    depend on the device), then moved to ``device``. See ``CosSinFlavour`` for the two flavours.
    """
    fn = "cos_sin_cache"
    check_int(fn, "max_pos", max_pos, minimum=1)
    check_int(fn, "rope_dim", rope_dim, minimum=2)
    if rope_dim % 2:
        fail(fn, "rope_dim", "must be even", rope_dim)
    if not isinstance(theta, (int, float)) or not math.isfinite(theta) or theta <= 1:
        fail(fn, "theta", "must be a finite number > 1", theta)
    if yarn is not None:
        if not isinstance(yarn, YarnConfig):
            fail(fn, "yarn", "must be a YarnConfig or None", type(yarn).__name__)
        if not (yarn.factor >= 1 and math.isfinite(yarn.factor)):
            fail(fn, "yarn", "must have a finite factor >= 1", yarn.factor)
        check_int(fn, "yarn.original_max_position", yarn.original_max_position, minimum=1)
    if flavour == CosSinFlavour.FLOAT64:
        inv = _inv_freq(rope_dim, float(theta), yarn, torch.float64)
        ang = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv[None, :]
        table = torch.cat((torch.cos(ang), torch.sin(ang)), dim=-1).to(torch.float32)
    elif flavour == CosSinFlavour.VLLM:
        inv = _inv_freq(rope_dim, float(theta), yarn, torch.float32)
        t = torch.arange(max_pos, dtype=torch.float32)
        ang = torch.einsum("i,j -> ij", t, inv)
        table = torch.cat((ang.cos(), ang.sin()), dim=-1)
    else:
        fail(fn, "flavour", "must be 'float64' or 'vllm'", flavour)
    return table.contiguous() if device is None else table.to(device).contiguous()


# --------------------------------------------------------------------------- apply
def identity_cos_sin(rows: int = 1, device: str | torch.device = "cpu") -> torch.Tensor:
    """fp32 ``[rows, 64]`` cos/sin table with ``cos = 1`` (columns 0..31) and ``sin = +0``
    (columns 32..63), the layout of ``cos_sin_cache``: the table the writers are fed when a stage
    wants their quantisation without a rotation. It is not an exact identity on every input:
    ``apply_rope`` through it may turn ``-0.0`` into ``+0.0`` (``e*1 - o*0``), and a non-finite
    RoPE lane poisons its pair partner (``inf * 0 = nan``)."""
    check_int("identity_cos_sin", "rows", rows, minimum=1)
    t = torch.zeros((rows, ROPE_DIM), dtype=torch.float32, device=device)
    t[:, :HALF_ROPE] = 1.0
    return t


def _as_arith(fn: str, arithmetic: object) -> RopeArithmetic:
    return check_enum(fn, "arithmetic", RopeArithmetic, arithmetic)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, inverse: bool = False,
               arithmetic: RopeArithmetic | str = RopeArithmetic.FMA) -> torch.Tensor:
    """RoPE (or inverse RoPE) of dims 448..511 of ``x``; returns float32 ``x.shape``.

    x:          ``[..., 512]`` float32 / bfloat16 / float16 (converted to fp32 exactly).
    positions:  int32/int64, shape equal to a leading prefix of ``x.shape[:-1]`` (e.g. ``[T]``
                for ``x [T, H, 512]``: every head of token ``t`` uses ``positions[t]``); values in
                ``[0, cos_sin.shape[0])``.
    cos_sin:    float32 ``[max_pos, 64]`` = ``[cos(32) | sin(32)]`` (``cos_sin_cache``).
    inverse:    False: forward rotation (writers); True: inverse (output epilogue, attention 3.3).
    arithmetic: ``RopeArithmetic`` (module docstring table); bit-exact for each.

    NoPE dims are returned unchanged (bit for bit). The caller rounds to bf16 if it stores bf16.
    """
    fn = "apply_rope"
    check_dtype(fn, "x", x, _FLOAT_INPUTS)
    if x.dim() < 1 or x.shape[-1] != HEAD_DIM:
        fail(fn, "x", f"must have last dimension {HEAD_DIM}", f"shape {tuple(x.shape)}")
    check_dtype(fn, "positions", positions, INDEX_DTYPES)
    lead = tuple(x.shape[:-1])
    if positions.dim() > len(lead) or tuple(positions.shape) != lead[: positions.dim()]:
        fail(fn, "positions", f"must have a shape that is a prefix of x.shape[:-1] = {list(lead)}",
             f"shape {tuple(positions.shape)}")
    check_dtype(fn, "cos_sin", cos_sin, (torch.float32,))
    if cos_sin.dim() != 2 or cos_sin.shape[1] != ROPE_DIM or cos_sin.shape[0] < 1:
        fail(fn, "cos_sin", f"must have shape [max_pos, {ROPE_DIM}]", f"shape {tuple(cos_sin.shape)}")
    if not isinstance(inverse, bool):
        fail(fn, "inverse", "must be a bool", type(inverse).__name__)
    arith = _as_arith(fn, arithmetic)
    devs = {x.device, positions.device, cos_sin.device}
    if len(devs) > 1:
        fail(fn, "x,positions,cos_sin", "must all be on one device", [str(d) for d in devs])
    if positions.numel() and (int(positions.min()) < 0 or int(positions.max()) >= cos_sin.shape[0]):
        fail(fn, "positions", f"must lie in [0, {cos_sin.shape[0]}) (rows of cos_sin)",
             f"range [{int(positions.min())}, {int(positions.max())}]")

    xf = x.to(torch.float32)
    cs = cos_sin[positions.to(torch.int64)].to(torch.float64)  # positions.shape + (64,)
    cs = cs.reshape(tuple(positions.shape) + (1,) * (len(lead) - positions.dim()) + (ROPE_DIM,))
    cos, sin = cs[..., :HALF_ROPE], cs[..., HALF_ROPE:]
    rope = xf[..., ROPE_OFFSET:].to(torch.float64)
    e, o = rope[..., 0::2], rope[..., 1::2]
    e2, o2 = rope_pairs(e, o, cos, sin, inverse, arith)
    out = xf.clone()
    out[..., ROPE_OFFSET::2] = e2.to(torch.float32)
    out[..., ROPE_OFFSET + 1::2] = o2.to(torch.float32)
    return out


def roundtrip_error_bound(x: torch.Tensor, cos_sin_rows: torch.Tensor) -> torch.Tensor:
    """Per-dim bound on ``|inverse(forward(x)) - x|`` for the RoPE dims (any arithmetic).

    x: ``[..., 64]`` fp32 RoPE dims; cos_sin_rows: ``[..., 64]`` the table rows used (broadcastable).
    Returns float64 ``[..., 64]``: ``R * (delta + 12 u)`` per pair (both lanes), ``R = |e|+|o|``,
    ``delta = |cos**2 + sin**2 - 1|`` (float64, exact up to 2**-52 relative), ``u = 2**-24``.

    Derivation: each output lane of a rotation is ``fl(c1*a1 + c2*a2)`` with at most two fp32
    roundings (one product, one sum/fma), so its error is ``<= 2u (|c1 a1| + |c2 a2|) <= 2u R1``
    with ``R1 = |a1| + |a2|`` (|cos|, |sin| <= 1; the u**2 term is absorbed by rounding 2u up
    to 2.0001u below). Forward: ``|e'| + |o'| <= 2R(1+2u)``. Inverse of the perturbed pair:
    ``e'' = e (cos**2 + sin**2) + cos*eps1 + sin*eps2 + eps3`` with ``|eps1|, |eps2| <= 2uR`` and
    ``|eps3| <= 2u * 2R(1+2u)``, so ``|e'' - e| <= R delta + 4uR + 4uR(1+2u) <= R (delta + 9u)``;
    the same for ``o''``. 12u leaves margin for the float64 evaluation of delta.
    """
    x64 = x.to(torch.float64)
    cs = cos_sin_rows.to(torch.float64)
    c, s = cs[..., :HALF_ROPE], cs[..., HALF_ROPE:]
    delta = (c * c + s * s - 1.0).abs()
    r = x64[..., 0::2].abs() + x64[..., 1::2].abs()
    b = r * (delta + 12 * 2.0**-24)
    return torch.stack((b, b), dim=-1).reshape(b.shape[:-1] + (ROPE_DIM,))
