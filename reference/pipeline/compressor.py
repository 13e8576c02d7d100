"""The DSv4 KV compressor, datapath 5.1 steps 2-7 (C4: ratio 4 with overlap; C128: ratio 128).

Per request, the *state* of the raw token at position ``u`` is one fp32 row
``[kv_u (coff*512) | score_u + ape[u % ratio] (coff*512)]`` (step 2, ``build_state``;
``V:models/deepseek_v4/common/ops/save_partial_states.py:56-89``); ``coff = 2`` for C4
(``C4_OVERLAP_COFF``), 1 for C128.

At a boundary position ``p`` (``(p + 1) % ratio == 0``) one compressed entry ``j = p // ratio``
is produced from the window ``u = p - W + 1 .. p`` (``W = 8`` for C4, 128 for C128):

3. window row ``k`` (``u = p - W + 1 + k``) reads columns ``[0, 512)`` of its kv/score halves
   if ``k < ratio`` and ``[512, 1024)`` otherwise (C4 rows 4-7; C128 always the first half);
   rows with ``u < 0`` are masked (score ``-inf``, kv 0)
   (``V:.../fused_compress_quant_cache.py:203-248``).
4. ``compressed[d] = sum_k softmax_k(score[k, d]) * kv[k, d]`` independently per dim.
5. ``normed = compressed * rsqrt(mean_d(compressed**2) + eps) * w`` (``w`` bf16 -> fp32).
6. NoPE: quantise ``bf16(normed[:448])`` with the producer's ``ScaleRule`` (Q_S CuTe-DSL on
   NVIDIA, Q_A Triton on ROCm/XPU, H1); RoPE: ``bf16(RoPE(normed[448:], pos))`` of the
   **unrounded fp32** normed values (H9) at ``pos = p - ratio + 1``.
   Position check: Triton uses ``(p // ratio) * ratio`` (``:324``), CuTe ``(p // 4) * 4`` for C4
   and ``p - 127`` for C128 (datapath 2.4); for a boundary ``p = (j+1)*ratio - 1`` all three
   equal ``j * ratio = p - ratio + 1`` (``compressed_rope_position``).
7. The record goes to the compressed slot of entry ``j`` (``indices_slots.
   get_compressed_slot_mapping``); it is visible to queries at ``q`` with ``(q+1)//ratio > j``.

Arithmetic (H7): steps 4-5 are computed in float64 with a fixed order (max, ``detmath.det_exp``,
sequential sums over the window, sequential sum of squares over dims, IEEE ``sqrt`` and
division) and rounded once to fp32, so the reference ``normed`` is deterministic on every device
and within ~1 fp32 ulp of the exact value. Producers use fp32 with their own reduction trees
(Triton ``tl.softmax`` + ``rsqrt.approx``; CuTe online softmax + ``exp2`` fastmath), so the fp32
``normed`` is a *tolerance* check, while the bytes are exact **from the bf16 pre-quantisation
boundary** (``CompressorBoundary.row_bf16``, the input of ``cache_model1.insert``) and from the
fp32 RoPE input (``rope_in``) under a named ``RopeArithmetic``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..constants import C4_OVERLAP_COFF, C4_RATIO, C128_COFF, C128_RATIO, HEAD_DIM, NOPE_DIM
from ..detmath import det_exp
from ..errors import INDEX_DTYPES, check_dtype, check_int, fail
from ..policies import Fp8Flavour, RopeArithmetic, ScaleRule
from .rope import apply_rope

__all__ = [
    "CompressorBoundary",
    "compressor_geometry",
    "compressed_rope_position",
    "build_state",
    "state_windows",
    "compress_windows",
    "compressor_boundary",
    "compress_and_insert",
]


def compressor_geometry(ratio: int) -> tuple[int, int]:
    """``(coff, window)`` of a compress ratio: C4 -> (2, 8), C128 -> (1, 128)."""
    if ratio == C4_RATIO:
        return C4_OVERLAP_COFF, C4_OVERLAP_COFF * C4_RATIO
    if ratio == C128_RATIO:
        return C128_COFF, C128_RATIO
    fail("compressor_geometry", "ratio", f"must be {C4_RATIO} or {C128_RATIO}", ratio)


def compressed_rope_position(positions: torch.Tensor, ratio: int) -> torch.Tensor:
    """RoPE position ``p - ratio + 1`` of the entry completed at boundary ``p`` (step 6)."""
    return positions.to(torch.int64) - ratio + 1


def _check_ratio(fn: str, ratio: object) -> tuple[int, int]:
    if ratio not in (C4_RATIO, C128_RATIO) or isinstance(ratio, bool):
        fail(fn, "ratio", f"must be {C4_RATIO} or {C128_RATIO}", ratio)
    return compressor_geometry(ratio)


def build_state(kv: torch.Tensor, score: torch.Tensor, positions: torch.Tensor, ape: torch.Tensor,
                ratio: int) -> torch.Tensor:
    """State rows (step 2): ``[kv_u | fl32(score_u + ape[u % ratio])]`` fp32 ``[P, 2*coff*512]``.

    kv, score: fp32 ``[P, coff*512]`` (the fp32 ``kv_score`` projection split in two);
    positions: int ``[P]`` (>= 0); ape: fp32 ``[ratio, coff*512]``. The fp32 add is formed in
    float64 and rounded once (innocuous double rounding, 53 >= 2*24+2)."""
    fn = "build_state"
    coff, _ = _check_ratio(fn, ratio)
    w = coff * HEAD_DIM
    for name, t in (("kv", kv), ("score", score)):
        check_dtype(fn, name, t, (torch.float32,))
        if t.dim() != 2 or t.shape[1] != w:
            fail(fn, name, f"must have shape [P, {w}]", f"shape {tuple(t.shape)}")
    if score.shape[0] != kv.shape[0]:
        fail(fn, "score", f"must have as many rows as kv ({kv.shape[0]})", score.shape[0])
    check_dtype(fn, "positions", positions, INDEX_DTYPES)
    if tuple(positions.shape) != (kv.shape[0],) or (positions.numel() and int(positions.min()) < 0):
        fail(fn, "positions", f"must have shape [{kv.shape[0]}] and values >= 0", f"shape {tuple(positions.shape)}")
    check_dtype(fn, "ape", ape, (torch.float32,))
    if tuple(ape.shape) != (ratio, w):
        fail(fn, "ape", f"must have shape [{ratio}, {w}]", f"shape {tuple(ape.shape)}")
    biased = (score.to(torch.float64) + ape[positions.to(torch.int64) % ratio].to(torch.float64)).to(torch.float32)
    return torch.cat((kv, biased), dim=1)


def state_windows(state: torch.Tensor, positions: torch.Tensor, ratio: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Window gather (step 3) for boundary positions of ONE request.

    state: fp32 ``[P, 2*coff*512]``, row ``u`` = state of position ``u`` (``u < P``);
    positions: int ``[M]`` boundary positions ``p`` with ``(p+1) % ratio == 0`` and ``p < P``.
    Returns ``(kv [M, W, 512], score [M, W, 512], valid [M, W])`` fp32/bool: masked rows have
    kv 0 and score ``-inf``."""
    fn = "state_windows"
    coff, W = _check_ratio(fn, ratio)
    check_dtype(fn, "state", state, (torch.float32,))
    if state.dim() != 2 or state.shape[1] != 2 * coff * HEAD_DIM:
        fail(fn, "state", f"must have shape [P, {2 * coff * HEAD_DIM}]", f"shape {tuple(state.shape)}")
    check_dtype(fn, "positions", positions, INDEX_DTYPES)
    if positions.dim() != 1:
        fail(fn, "positions", "must have shape [M]", f"shape {tuple(positions.shape)}")
    p = positions.to(torch.int64)
    if p.numel():
        if bool(((p + 1) % ratio != 0).any()) or int(p.min()) < 0:
            fail(fn, "positions", f"must be boundary positions (p + 1) % {ratio} == 0, p >= 0",
                 p[((p + 1) % ratio != 0) | (p < 0)][:4].tolist())
        if int(p.max()) >= state.shape[0]:
            fail(fn, "positions", f"must be < the number of state rows ({state.shape[0]})", int(p.max()))
    k = torch.arange(W, device=state.device)
    u = p[:, None] - W + 1 + k[None, :]  # [M, W]
    valid = u >= 0
    rows = state[u.clamp_min(0)]  # [M, W, 2*coff*512]
    half = (k >= ratio).to(torch.int64) * HEAD_DIM  # column offset inside the kv / score parts
    cols = half[:, None] + torch.arange(HEAD_DIM, device=state.device)[None, :]  # [W, 512]
    kv = torch.gather(rows, 2, cols.unsqueeze(0).expand(p.numel(), W, HEAD_DIM))
    score = torch.gather(rows, 2, (cols + coff * HEAD_DIM).unsqueeze(0).expand(p.numel(), W, HEAD_DIM))
    kv = torch.where(valid[..., None], kv, torch.zeros_like(kv))
    score = torch.where(valid[..., None], score, torch.full_like(score, float("-inf")))
    return kv, score, valid


def compress_windows(kv: torch.Tensor, score: torch.Tensor, valid: torch.Tensor, norm_weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
    """Steps 4-5 in float64 (fixed order), rounded once: fp32 ``normed [M, 512]``.

    kv, score: fp32 ``[M, W, 512]``; valid: bool ``[M, W]`` (at least one valid row each);
    norm_weight: ``[512]`` bf16 (or fp32); eps: RMSNorm epsilon (> 0)."""
    fn = "compress_windows"
    check_dtype(fn, "kv", kv, (torch.float32,))
    check_dtype(fn, "score", score, (torch.float32,))
    if kv.dim() != 3 or kv.shape[2] != HEAD_DIM or score.shape != kv.shape:
        fail(fn, "kv,score", f"must both have shape [M, W, {HEAD_DIM}]", f"{tuple(kv.shape)}, {tuple(score.shape)}")
    check_dtype(fn, "valid", valid, (torch.bool,))
    if tuple(valid.shape) != tuple(kv.shape[:2]):
        fail(fn, "valid", f"must have shape {list(kv.shape[:2])}", f"shape {tuple(valid.shape)}")
    if valid.numel() and not bool(valid.any(dim=1).all()):
        fail(fn, "valid", "must have at least one valid row per window")
    check_dtype(fn, "norm_weight", norm_weight, (torch.bfloat16, torch.float32))
    if tuple(norm_weight.shape) != (HEAD_DIM,):
        fail(fn, "norm_weight", f"must have shape [{HEAD_DIM}]", f"shape {tuple(norm_weight.shape)}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (eps > 0):
        fail(fn, "eps", "must be a number > 0", eps)
    s = torch.where(valid[..., None], score.to(torch.float64), torch.full(score.shape, float("-inf"),
                    dtype=torch.float64, device=score.device))
    v = torch.where(valid[..., None], kv.to(torch.float64), torch.zeros(kv.shape, dtype=torch.float64,
                    device=kv.device))
    m = s.amax(dim=1, keepdim=True)  # [M, 1, 512]
    p = det_exp(torch.where(valid[..., None], s - m, s))  # masked rows: exp(-inf) = 0
    num = torch.zeros(kv.shape[0], HEAD_DIM, dtype=torch.float64, device=kv.device)
    den = torch.zeros_like(num)
    for k in range(kv.shape[1]):  # fixed order over the window
        num = num + p[:, k] * v[:, k]
        den = den + p[:, k]
    comp = num / den
    sq = comp * comp
    acc = torch.zeros(kv.shape[0], dtype=torch.float64, device=kv.device)
    for d in range(HEAD_DIM):  # fixed order over dims
        acc = acc + sq[:, d]
    rrms = 1.0 / torch.sqrt(acc * (1.0 / HEAD_DIM) + float(eps))  # exact: 1/512 is a power of two
    normed = comp * rrms[:, None] * norm_weight.to(torch.float64)[None, :]
    return normed.to(torch.float32)


@dataclass(frozen=True)
class CompressorBoundary:
    """The pre-quantisation boundary of the compressor (H7, H9), ``M`` entries.

    normed:         fp32 ``[M, 512]`` (tolerance-checked against producers).
    nope_bf16:      bf16 ``[M, 448]``: ``bf16(normed[:448])``, the quantiser input.
    rope_in:        fp32 ``[M, 64]``: ``normed[448:]``, the RoPE input (unrounded).
    rope_positions: int64 ``[M]``: ``p - ratio + 1``.
    rope_out:       fp32 ``[M, 64]``: RoPE of ``rope_in`` under the chosen arithmetic.
    row_bf16:       bf16 ``[M, 512]``: ``[nope_bf16 | bf16(rope_out)]``: exactly what
                    ``cache_model1.insert`` turns into the 584 cache bytes.
    """

    normed: torch.Tensor
    nope_bf16: torch.Tensor
    rope_in: torch.Tensor
    rope_positions: torch.Tensor
    rope_out: torch.Tensor
    row_bf16: torch.Tensor


def compressor_boundary(state: torch.Tensor, positions: torch.Tensor, ratio: int, norm_weight: torch.Tensor,
                        eps: float, cos_sin: torch.Tensor,
                        arithmetic: RopeArithmetic | str = RopeArithmetic.FMA_TRITON) -> CompressorBoundary:
    """Steps 3-6 (up to the quantiser) for boundary ``positions`` of one request.

    ``arithmetic``: the RoPE contraction of the producer: ``FMA_TRITON`` (Triton compressor,
    even lane PROBE-verified, datapath 2.3) or ``SEPARATE`` (the CuTe kernel's written form
    ``x*cos - x'*sin``; its contraction was not verified on hardware, datapath 2.4)."""
    kv, score, valid = state_windows(state, positions, ratio)
    normed = compress_windows(kv, score, valid, norm_weight, eps)
    rope_pos = compressed_rope_position(positions, ratio)
    rope_in = normed[:, NOPE_DIM:]
    full = torch.zeros(normed.shape[0], HEAD_DIM, dtype=torch.float32, device=normed.device)
    full[:, NOPE_DIM:] = rope_in
    rope_out = apply_rope(full, rope_pos, cos_sin, inverse=False, arithmetic=arithmetic)[:, NOPE_DIM:]
    nope_bf16 = normed[:, :NOPE_DIM].to(torch.bfloat16)
    row = torch.cat((nope_bf16, rope_out.to(torch.bfloat16)), dim=1)
    return CompressorBoundary(normed, nope_bf16, rope_in.clone(), rope_pos, rope_out, row)


def compress_and_insert(cache: torch.Tensor, block_size: int, state: torch.Tensor, positions: torch.Tensor,
                        slots: torch.Tensor, ratio: int, norm_weight: torch.Tensor, eps: float,
                        cos_sin: torch.Tensor, rule: ScaleRule | str = ScaleRule.SCALE_CLAMP,
                        arithmetic: RopeArithmetic | str = RopeArithmetic.FMA_TRITON,
                        flavour: Fp8Flavour | str = Fp8Flavour.E4M3FN) -> tuple[torch.Tensor, CompressorBoundary]:
    """Steps 3-7: compress the boundary ``positions`` of one request and write entry ``j`` of each
    to ``slots`` (int ``[M]``, ``-1`` = skip) of the compressed ``cache`` with the producer's
    ``rule`` (default Q_S: the CuTe-DSL compressor on NVIDIA; Q_A for the Triton compressor).
    Returns ``(new cache, boundary)``; the input cache is not modified."""
    from ..caches.model1 import insert  # local import: cache_model1 is a sibling of equal rank

    fn = "compress_and_insert"
    check_int(fn, "block_size", block_size, minimum=1)
    check_dtype(fn, "slots", slots, INDEX_DTYPES)
    if tuple(slots.shape) != tuple(positions.shape):
        fail(fn, "slots", f"must have the shape of positions {tuple(positions.shape)}", f"shape {tuple(slots.shape)}")
    b = compressor_boundary(state, positions, ratio, norm_weight, eps, cos_sin, arithmetic)
    new = insert(cache, b.row_bf16, slots, block_size, rule, flavour=flavour)
    return new, b
