"""The compressor's cache-bytes tolerance tier (datapath 2.3, 5.1, H7, H9).

A compressor kernel (``compress_norm_rope_store_triton``) writes 584-byte records from its own
fp32 ``normed`` (``tl.softmax``, the weighted window sum, the 512-term sum of squares,
``rsqrt.approx``), so its bytes are NOT bit-exact with the reference's records from the bf16
pre-quantisation boundary (H7). This is the rounding-error model derived for
``tests/kernels/test_fuzz_writers.py`` (section "the Triton compressor"), kept here as the one
copy: the ``compressor`` StageSpec and that GPU fuzz test both judge the kernel's ``cache`` output
with this tier:

per dim ``d`` of an entry with window weights ``p_k`` (``W`` window rows)::

    A[d] = 2**-24 * ((W + 8) * sum_k p_k |kv_k[d]| * rrms * |w[d]| + 520 * |normed[d]|)

(W-term weighted sum + softmax and rsqrt error; 512-term variance sum), and

* bytes outside the written records unchanged, pad byte 0;
* RoPE lanes: ``|got - want| <= A[e] + A[o] + 2**-22 (|e| + |o|) + 1 bf16 ulp`` (a rotation does
  not amplify input errors; one fp32 product rounding for the contraction; the bf16 store);
* UE8M0 scale bytes within 1 (the tile amax moving across a power of two);
* dequantised NoPE values: ``|got - want| <= A[d] + 1 bf16 ulp + one FP8 step at the coarser of
  the two tile scales`` (an RNE FP8 code moves by at most one step per input step).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from dsv4_numerics.reference.caches.model1 import defined_byte_mask, page_bytes, read_records
from dsv4_numerics.reference.constants import HEAD_DIM, N_TILES, NOPE_DIM, TILE

__all__ = ["TierReport", "compressor_error_bound", "judge_compressed_records", "ulp_bf16", "window_error_bound"]


def compressor_error_bound(state: torch.Tensor, positions: torch.Tensor, ratio: int, norm_weight: torch.Tensor,
                           eps: float, normed: torch.Tensor) -> torch.Tensor:
    """``A [M, 512]`` float64: the error model above for the boundary ``positions`` of one
    request's dense ``state`` (``normed``: the reference's fp32 normed rows of those positions)."""
    from dsv4_numerics.reference.pipeline.compressor import state_windows

    kv, score, valid = state_windows(state, positions, ratio)
    return window_error_bound(kv, score, valid, norm_weight, eps, normed)


def window_error_bound(kv: torch.Tensor, score: torch.Tensor, valid: torch.Tensor, norm_weight: torch.Tensor,
                       eps: float, normed: torch.Tensor) -> torch.Tensor:
    """``A [M, 512]`` float64: the error model above for windows of ``W = kv.shape[1]`` rows
    (``kv`` / ``score`` fp32 ``[M, W, 512]``, ``valid`` bool ``[M, W]``; ``normed``: the
    reference's fp32 rows). Shared by the V4 compressor and the DeepSeek-V4.1 fused compressor
    (``W`` = its ratio, 1 or 2)."""
    W = kv.shape[1]
    p = torch.softmax(torch.where(valid[..., None], score.to(torch.float64),
                                  torch.tensor(float("-inf"), dtype=torch.float64)), dim=1)
    kv64 = kv.to(torch.float64)
    comp = (p * kv64).sum(1)
    rrms = 1.0 / torch.sqrt((comp * comp).mean(1, keepdim=True) + eps)
    mag = (p * kv64.abs()).sum(1)
    w = norm_weight.to(torch.float64).abs()
    return 2.0**-24 * ((W + 8) * mag * rrms * w + 520 * normed.to(torch.float64).abs())


def _bf16_values(b: torch.Tensor) -> torch.Tensor:
    """float64 values of little-endian bf16 byte pairs ``[..., 2n]`` -> ``[..., n]``."""
    bits = (b[..., 0::2].to(torch.int32) | (b[..., 1::2].to(torch.int32) << 8)) << 16
    return bits.view(torch.float32).to(torch.float64)


def ulp_bf16(x: torch.Tensor) -> torch.Tensor:
    e = torch.floor(torch.log2(torch.where(x > 0, x, torch.ones_like(x))))
    return torch.pow(2.0, torch.maximum(e, torch.full_like(e, -126.0)) - 7)


def _over(err: torch.Tensor, bound: torch.Tensor, ratio: torch.Tensor) -> torch.Tensor:
    """Where the tier fails: ``err > bound`` (the tier's definition, no rounding of a quotient in
    between) or ``err / bound`` above 1 or NaN (``ratio``: NaN already mapped to inf)."""
    return (err > bound) | (ratio > 1.0)


@dataclass
class TierReport:
    passed: bool
    rule: str
    message: str = ""
    headroom: float = math.inf  # min bound/|error| over RoPE lanes and NoPE values (inf: bit-exact)
    details: dict[str, Any] = field(default_factory=dict)


def judge_compressed_records(got: torch.Tensor, want: torch.Tensor, initial: torch.Tensor, slots: torch.Tensor,
                             block_size: int, A: torch.Tensor) -> TierReport:
    """The tier (module docstring) for the records at ``slots`` (``A`` rows in slot order)."""
    from dsv4_numerics.reference.formats.fp8 import decode_e4m3fn

    got, want, initial = got.detach().cpu(), want.cpu(), initial.cpu()
    slots = slots.to(torch.int64).cpu()
    before = page_bytes(initial, block_size)
    got_b = page_bytes(got, block_size)
    if tuple(got_b.shape) != tuple(before.shape):
        return TierReport(False, "cache:shape", f"cache pages {tuple(got_b.shape)}, expected {tuple(before.shape)}", 0.0)
    mask = defined_byte_mask(before, slots, block_size, include_pad=True)
    moved = ~mask & (got_b != before)
    if bool(moved.any()):
        return TierReport(False, "cache:clobber", f"the kernel changed {int(moved.sum())} bytes outside its records", 0.0)
    if slots.numel() == 0:
        return TierReport(True, "cache:bit_exact")
    gd, gs = read_records(got, slots, block_size)
    wd, ws = read_records(want, slots, block_size)
    exact = int(((gd == wd).all(1) & (gs == ws).all(1)).sum())
    det = {"records": int(slots.numel()), "bit_identical_records": exact}
    if exact == slots.numel():
        return TierReport(True, "cache:bit_exact", "", math.inf, det)
    if not bool((gs[:, 7] == 0).all()):
        return TierReport(False, "cache:pad_byte", "pad byte not 0", 0.0, det)
    rg, rw = _bf16_values(gd[:, NOPE_DIM:]), _bf16_values(wd[:, NOPE_DIM:])
    Ar = A[:, NOPE_DIM:]
    pair = (Ar[:, 0::2] + Ar[:, 1::2]).repeat_interleave(2, dim=1)
    mag = (rw[:, 0::2].abs() + rw[:, 1::2].abs()).repeat_interleave(2, dim=1)
    rbound = pair + 2.0**-22 * mag + ulp_bf16(torch.maximum(rg.abs(), rw.abs()))
    rerr = (rg - rw).abs()
    rerr = torch.where(torch.isnan(rg) & torch.isnan(rw), torch.zeros_like(rerr), rerr)
    ratio_r = torch.nan_to_num(rerr / rbound, nan=math.inf)
    worst_r = float(ratio_r.max()) if ratio_r.numel() else 0.0
    det["rope_over_bound"] = worst_r
    over_r = _over(rerr, rbound, ratio_r)
    if bool(over_r.any()):
        i = over_r.nonzero()[0].tolist()
        return TierReport(False, "cache:rope_tier", f"{int(over_r.sum())} RoPE lanes beyond the tier, first record/lane "
                          f"{i}: got {float(rg[i[0], i[1]])} want {float(rw[i[0], i[1]])} bound "
                          f"{float(rbound[i[0], i[1]])}", 1.0 / worst_r, det)
    ds = (gs[:, :N_TILES].to(torch.int64) - ws[:, :N_TILES].to(torch.int64)).abs()
    det["scale_byte_max_diff"] = int(ds.max())
    if int(ds.max()) > 1:
        return TierReport(False, "cache:scale_bytes", f"UE8M0 scale bytes differ by {int(ds.max())} (> 1)", 0.0, det)

    def deq(d, s):
        v = decode_e4m3fn(d[:, :NOPE_DIM]).to(torch.float64).reshape(-1, N_TILES, TILE)
        return v * torch.pow(2.0, s[:, :N_TILES].to(torch.float64) - 127).unsqueeze(-1)

    xg, xw = deq(gd, gs), deq(wd, ws)
    smax = torch.maximum(gs[:, :N_TILES], ws[:, :N_TILES]).to(torch.float64).unsqueeze(-1) - 127
    m = torch.maximum(xg.abs(), xw.abs())
    ex = torch.where(m > 0, torch.floor(torch.log2(torch.where(m > 0, m, torch.ones_like(m)))), smax - 6)
    step = torch.pow(2.0, torch.maximum(ex, smax - 6) - 3)
    nbound = step + ulp_bf16(m) + A[:, :NOPE_DIM].reshape(-1, N_TILES, TILE)
    nerr = (xg - xw).abs()
    ratio_n = torch.nan_to_num(nerr / nbound, nan=math.inf)
    worst_n = float(ratio_n.max())
    det["nope_over_bound"] = worst_n
    worst = max(worst_r, worst_n)
    head = math.inf if worst == 0 else 1.0 / worst
    over_n = _over(nerr, nbound, ratio_n)
    if bool(over_n.any()):
        i = over_n.nonzero()[0].tolist()
        return TierReport(False, "cache:nope_tier", f"{int(over_n.sum())} NoPE values beyond the tier, first "
                          f"record/tile/elem {i}: got {float(xg[tuple(i)])} want {float(xw[tuple(i)])} bound "
                          f"{float(nbound[tuple(i)])}", head, det)
    return TierReport(True, "cache:compressor_tier", "", head, det)
