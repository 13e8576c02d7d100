"""Output epilogue: inverse RoPE of the attention output, then FP8 quantisation in 128-wide
groups with UE8M0 scales, in vLLM's group-major layout (attention 3.3, H15; README 2).

Model of vLLM ``fused_inv_rope_fp8_quant``
(``V:models/deepseek_v4/common/ops/fused_inv_rope_fp8_quant.py``):

1. Input: the **bf16** attention output ``o [T, H, 512]`` (the attention kernel already rounded
   it to bf16), upcast to fp32 (``:120``).
2. Inverse GPT-J RoPE on dims 448..511 at ``positions[t]`` with the Triton contraction
   (``RopeArithmetic.FMA_TRITON``: ``e' = fma(e, cos, fl32(o*sin))``,
   ``o' = fma(o, cos, -fl32(e*sin))``, ``:123-138``; see ``rope.py``). NoPE lanes unchanged.
3. Per 128-wide group (4 per head): ``quant.quantize_groups_ue8m0`` (eps 1e-10, ``r = fl32(a *
   fl32(1/448))``, ``e = ceil(log2 r)``, codes ``e4m3(clamp(x / 2**e, +-448))``, ``:150-162``).
4. Layout (``:416-470``): heads are grouped ``g = h // hpg`` (``hpg = heads_per_group``, 8 in
   DSv4 = ``OUT_HEADS_PER_GROUP``), ``G = H / hpg``. Codes are stored group-major
   ``[G, T, hpg*512]`` and exposed as the ``[T, G, hpg*512]`` view ``codes.transpose(0, 1)``.
   Scales live in a buffer of ``G * inner * T_al`` elements, ``T_al = round_up(T, 4)``
   (``OUT_TOKEN_ALIGN``), viewed as ``[G, T, inner]`` with strides ``(inner*T_al, 1, T_al)``
   (MN-major), and exposed transposed as ``[T, G, inner]``:
   - SM90: fp32 scales ``2**e``, ``inner = 4*hpg`` (one per 128-group, head-major order);
   - SM100 (``tma_aligned_scales``): int32, ``inner = hpg``; one int32 per head holds its four
     UE8M0 bytes ``(fp32_bits(2**e) >> 23) & 0xFF = e + 127``, group ``i`` in byte ``i``
     (little end first; the int32 wraps when byte 3 >= 128).
   Storage columns ``T .. T_al-1`` (padding tokens) are zero (``:90-114``: the grid covers
   ``T_al`` token programs and padding programs store zeros).

Scale exponent (``exponent_rule``). The kernel computes ``ceil(tl.log2(r))`` in fp32: the log
is rounded to fp32 *before* the ceil, so for ``r = 2**k * (1 + d)`` with ``log2(1 + d)`` below half
an fp32 ulp of ``k`` the log rounds to the integer ``k`` and the exponent is ``k``, one less than
the exact ``ceil(log2 r) = k + 1``; the group's largest element then exceeds 448 after scaling
and saturates to code 0x7E. Only ``r`` within about ``|k| * 2**-24`` (relative) above a power of
two is affected, i.e. an amax just above ``448 * 2**k``, which needs more than 8 significant bits:
an fp32 RoPE lane (group 3 of each head); bf16 NoPE groups never are.
- ``"log2f"`` (default, the kernel): ``e = ceil(fl32(log2 r))`` with ``log2 r`` evaluated in
  float64 (``detmath.det_log`` times ``fl64(1/ln 2)``, error ~1e-16 relative, far below fp32
  resolution) then rounded to fp32: the correctly rounded ``log2f``, which is what Triton's
  libdevice ``log2f`` returns here (``tests/attention/test_gpu.py::
  test_triton_epilogue_exponent_model`` compares the two on an H200 over dense sweeps above every
  power of two, and the exact rule is observed to differ there).
- ``"exact"``: ``e = ceil(log2 r)`` exactly (``quant.quantize_groups_ue8m0``), the formula of
  attention 3.3 / tier C.

Bytes are exact from the bf16 attention output; the dequantised values are compared with
tier C of attention 7 by the judges (``|deq - inv_rope(out)| <= 16 * 2**(byte - 127)``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..constants import HEAD_DIM, OUT_EPS, OUT_GROUP, OUT_GROUPS_PER_HEAD, OUT_HEADS_PER_GROUP, OUT_TOKEN_ALIGN, UE8M0_BIAS
from ..constants import E4M3_MAX
from ..detmath import det_log
from ..errors import INDEX_DTYPES, check_dtype, check_int, fail
from ..formats.fp8 import encode_fp8, pow2_f64
from ..policies import Fp8Flavour, NonFinite, RopeArithmetic
from ..formats.quant import dequantize_groups_ue8m0, quantize_groups_ue8m0
from ..pipeline.rope import apply_rope

EXPONENT_RULES = ("log2f", "exact")
_INV_LN2 = 1.0 / math.log(2.0)

__all__ = ["EpilogueOut", "inv_rope_fp8_quant", "inverse_rope_output", "pack_scales_sm90",
           "pack_scales_sm100", "unpack_scales_sm100", "quantize_groups_log2f", "EXPONENT_RULES"]


@dataclass(frozen=True)
class EpilogueOut:
    """Result of ``inv_rope_fp8_quant`` (shapes with ``G = H // hpg``, ``Dg = hpg * 512``).

    rotated:       float32 ``[T, H, 512]``: the quantiser input (inverse-roped fp32 values).
    codes:         uint8 ``[G, T, Dg]``: E4M3FN codes, physical group-major buffer.
    exponents:     int32 ``[T, H, 4]``: per-128-group exponent ``e`` (scale ``2**e``,
                   UE8M0 byte ``e + 127``).
    scales_sm90:   float32 ``[G, T, 4*hpg]`` view, strides ``(4*hpg*T_al, 1, T_al)``.
    scales_sm100:  int32 ``[G, T, hpg]`` view, strides ``(hpg*T_al, 1, T_al)``.
    dequantized:   float32 ``[T, H, 512]``: exact ``decode(code) * 2**e``.
    The scale views' ``untyped_storage`` holds the zeroed padding columns ``T .. T_al-1``.
    """

    rotated: torch.Tensor
    codes: torch.Tensor
    exponents: torch.Tensor
    scales_sm90: torch.Tensor
    scales_sm100: torch.Tensor
    dequantized: torch.Tensor

    @property
    def codes_tgd(self) -> torch.Tensor:
        """The ``[T, G, Dg]`` view vLLM returns (``out_buf.transpose(0, 1)``)."""
        return self.codes.transpose(0, 1)

    @property
    def scales_sm90_tgk(self) -> torch.Tensor:
        return self.scales_sm90.transpose(0, 1)

    @property
    def scales_sm100_tgk(self) -> torch.Tensor:
        return self.scales_sm100.transpose(0, 1)


def _check_o(fn: str, o: torch.Tensor, heads_per_group: int) -> tuple[int, int, int]:
    check_dtype(fn, "o", o, (torch.bfloat16,))
    if o.dim() != 3 or o.shape[2] != HEAD_DIM:
        fail(fn, "o", f"must have shape [T, H, {HEAD_DIM}]", f"shape {tuple(o.shape)}")
    check_int(fn, "heads_per_group", heads_per_group, minimum=1)
    T, H, _ = o.shape
    if H % heads_per_group:
        fail(fn, "heads_per_group", f"must divide the head count H={H}", heads_per_group)
    return T, H, H // heads_per_group


def _check_exponents(fn: str, exponents: torch.Tensor, heads_per_group: int) -> tuple[int, int]:
    """Validate the scale packers' arguments (int exponents ``[T, H, 4]``, ``H`` a multiple of
    ``heads_per_group`` >= 1); returns ``(T, H)``."""
    check_dtype(fn, "exponents", exponents, (torch.int32, torch.int64))
    check_int(fn, "heads_per_group", heads_per_group, minimum=1)
    if exponents.dim() != 3 or exponents.shape[2] != OUT_GROUPS_PER_HEAD or exponents.shape[1] % heads_per_group:
        fail(fn, "exponents", f"must have shape [T, H, {OUT_GROUPS_PER_HEAD}] with H a multiple of heads_per_group",
             f"shape {tuple(exponents.shape)}")
    T, H, _ = exponents.shape
    return T, H


def _token_aligned(T: int) -> int:
    return -(-T // OUT_TOKEN_ALIGN) * OUT_TOKEN_ALIGN


def pack_scales_sm90(exponents: torch.Tensor, heads_per_group: int) -> torch.Tensor:
    """fp32 MN-major scale view ``[G, T, 4*hpg]`` (strides ``(4*hpg*T_al, 1, T_al)``) from
    exponents ``[T, H, 4]``; padding token columns of the storage are 0.0."""
    fn = "pack_scales_sm90"
    T, H = _check_exponents(fn, exponents, heads_per_group)
    G, inner, Tal = H // heads_per_group, OUT_GROUPS_PER_HEAD * heads_per_group, _token_aligned(T)
    e = exponents.to(torch.int64)
    # 2**e as fp32 bits (normal range only: e >= -126; eps 1e-10 bounds e >= -42)
    bits = ((e + UE8M0_BIAS) << 23).to(torch.int32).view(torch.float32)  # [T, H, 4]
    store = torch.zeros(G, inner, Tal, dtype=torch.float32, device=exponents.device)
    store[:, :, :T] = bits.reshape(T, G, inner).permute(1, 2, 0)
    return store.reshape(-1).as_strided((G, T, inner), (inner * Tal, 1, Tal))


def pack_scales_sm100(exponents: torch.Tensor, heads_per_group: int) -> torch.Tensor:
    """int32 MN-major scale view ``[G, T, hpg]`` (strides ``(hpg*T_al, 1, T_al)``): per head the
    four UE8M0 bytes ``e_i + 127`` packed little-end first; padding columns are 0."""
    fn = "pack_scales_sm100"
    T, H = _check_exponents(fn, exponents, heads_per_group)
    G, Tal = H // heads_per_group, _token_aligned(T)
    b = (exponents.to(torch.int64) + UE8M0_BIAS) & 0xFF  # [T, H, 4]
    shifts = torch.arange(OUT_GROUPS_PER_HEAD, device=b.device, dtype=torch.int64) * 8
    packed = (b << shifts).sum(dim=-1)  # exact integer sum of disjoint bytes, < 2**32
    packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)  # int32 wrap
    store = torch.zeros(G, heads_per_group, Tal, dtype=torch.int32, device=b.device)
    store[:, :, :T] = packed.reshape(T, G, heads_per_group).permute(1, 2, 0)
    return store.reshape(-1).as_strided((G, T, heads_per_group), (heads_per_group * Tal, 1, Tal))


def unpack_scales_sm100(packed: torch.Tensor) -> torch.Tensor:
    """int32 ``[..., hpg]`` packed scales -> UE8M0 bytes uint8 ``[..., hpg, 4]``."""
    check_dtype("unpack_scales_sm100", "packed", packed, (torch.int32,))
    v = packed.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(OUT_GROUPS_PER_HEAD, device=v.device, dtype=torch.int64) * 8
    return ((v.unsqueeze(-1) >> shifts) & 0xFF).to(torch.uint8)


def quantize_groups_log2f(x: torch.Tensor, group: int = OUT_GROUP, eps: float = OUT_EPS
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """``quant.quantize_groups_ue8m0`` with the kernel's exponent ``ceil(fl32(log2 r))``
    (module docstring, ``exponent_rule="log2f"``). x: finite fp32 ``[..., G*group]``.
    Returns ``(codes uint8, exponents int32 [..., G])``. Same amax / ``r`` arithmetic as
    ``quant.quantize_groups_ue8m0`` (``a = max(max|x|, fl32(eps))``, ``r = fl32(a * fl32(1/448))``);
    codes ``e4m3(clamp(x * 2**-e, +-448))`` (RNE, satfinite)."""
    fn = "quantize_groups_log2f"
    check_dtype(fn, "x", x, (torch.float32,))
    check_int(fn, "group", group, minimum=1)
    if x.dim() == 0 or x.shape[-1] == 0 or x.shape[-1] % group:
        fail(fn, "x", f"must have a last dimension that is a positive multiple of group={group}",
             f"shape {tuple(x.shape)}")
    if not bool(torch.isfinite(x).all()):
        fail(fn, "x", "must be finite")
    g = x.shape[-1] // group
    groups = x.reshape(*x.shape[:-1], g, group)
    eps32 = torch.tensor(eps, dtype=torch.float32, device=x.device)
    a = torch.maximum(groups.abs().amax(dim=-1), eps32)
    inv448 = float(torch.tensor(1.0 / E4M3_MAX, dtype=torch.float32))  # fl32(1/448), as a float64
    r = (a.to(torch.float64) * inv448).to(torch.float32)  # exact product, one rounding
    l32 = (det_log(r.to(torch.float64)) * _INV_LN2).to(torch.float32)
    e = torch.ceil(l32).to(torch.int64)
    y = groups.to(torch.float64) * pow2_f64(-e).unsqueeze(-1)
    codes = encode_fp8(y, Fp8Flavour.E4M3FN, nonfinite=NonFinite.CUDA_SATFINITE, clamp=E4M3_MAX)
    return codes.reshape(x.shape), e.to(torch.int32)


def inverse_rope_output(o: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                        arithmetic: RopeArithmetic | str = RopeArithmetic.FMA_TRITON) -> torch.Tensor:
    """Inverse RoPE of an attention output ``o [T, H, 512]`` (bf16 or fp32) at ``positions [T]``.

    Returns float32 (round to bf16 for a bf16 store: vLLM's ``quantize=False`` path and the ROCm
    decode epilogue, which rotates its fp32 output before the final cast,
    ``V:v1/attention/ops/rocm_aiter_mla_sparse.py:3490-3508``, same Triton contraction)."""
    fn = "inverse_rope_output"
    check_dtype(fn, "o", o, (torch.bfloat16, torch.float32))
    if o.dim() != 3 or o.shape[2] != HEAD_DIM:
        fail(fn, "o", f"must have shape [T, H, {HEAD_DIM}]", f"shape {tuple(o.shape)}")
    check_dtype(fn, "positions", positions, INDEX_DTYPES)
    if tuple(positions.shape) != (o.shape[0],):
        fail(fn, "positions", f"must have shape [T={o.shape[0]}]", f"shape {tuple(positions.shape)}")
    return apply_rope(o, positions, cos_sin, inverse=True, arithmetic=arithmetic)


def inv_rope_fp8_quant(o: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                       heads_per_group: int = OUT_HEADS_PER_GROUP,
                       arithmetic: RopeArithmetic | str = RopeArithmetic.FMA_TRITON,
                       exponent_rule: str = "log2f") -> EpilogueOut:
    """vLLM ``fused_inv_rope_fp8_quant`` bit-exactly (module docstring).

    o:               bf16 ``[T, H, 512]`` attention output; finite.
    positions:       int ``[T]`` query positions (rows of ``cos_sin``).
    cos_sin:         fp32 ``[max_pos, 64]`` ``[cos | sin]`` table.
    heads_per_group: ``hpg`` (DSv4: 8); must divide H.
    arithmetic:      inverse-RoPE arithmetic (default the Triton contraction of the kernel).
    exponent_rule:   ``"log2f"`` (the kernel, default) or ``"exact"`` (module docstring).
    """
    fn = "inv_rope_fp8_quant"
    T, H, G = _check_o(fn, o, heads_per_group)
    check_dtype(fn, "positions", positions, INDEX_DTYPES)
    if tuple(positions.shape) != (T,):
        fail(fn, "positions", f"must have shape [T={T}]", f"shape {tuple(positions.shape)}")
    if not bool(torch.isfinite(o).all()):
        fail(fn, "o", "must be finite (the epilogue quantiser has no non-finite contract)",
             f"{int((~torch.isfinite(o)).sum())} non-finite elements")
    if exponent_rule not in EXPONENT_RULES:
        fail(fn, "exponent_rule", f"must be one of {list(EXPONENT_RULES)}", exponent_rule)
    rotated = apply_rope(o, positions, cos_sin, inverse=True, arithmetic=arithmetic)
    quant = quantize_groups_log2f if exponent_rule == "log2f" else quantize_groups_ue8m0
    codes, e = quant(rotated, group=OUT_GROUP, eps=OUT_EPS)  # [T, H, 512], [T, H, 4]
    deq = dequantize_groups_ue8m0(codes, e, group=OUT_GROUP)
    Dg = heads_per_group * HEAD_DIM
    phys = codes.reshape(T, G, Dg).transpose(0, 1).contiguous()  # [G, T, Dg]
    return EpilogueOut(rotated=rotated, codes=phys, exponents=e,
                       scales_sm90=pack_scales_sm90(e, heads_per_group),
                       scales_sm100=pack_scales_sm100(e, heads_per_group), dequantized=deq)
