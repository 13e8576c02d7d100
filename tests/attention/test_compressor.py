"""Compressor (datapath 5.1): window gather, per-dim softmax, RMSNorm, RoPE position, bytes."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dsv4_numerics.reference.caches.model1 import decode_records, empty_cache, read_records
from dsv4_numerics.reference.pipeline.compressor import (
    build_state,
    compress_and_insert,
    compress_windows,
    compressed_rope_position,
    compressor_boundary,
    state_windows,
)
from dsv4_numerics.reference.errors import InputError
from dsv4_numerics.reference.policies import RopeArithmetic, ScaleRule
from dsv4_numerics.reference.formats.quant import dequantize_tiles, quantize_tiles
from dsv4_numerics.reference.pipeline.rope import apply_rope, cos_sin_cache

ONES = torch.ones(512, dtype=torch.bfloat16)


def c4_state(P: int, first: list[float], second: list[float], score_first=None, score_second=None):
    """C4 state rows: kv = [first[u] * 1 (512) | second[u] * 1 (512)], scores likewise (0 default)."""
    st_ = torch.zeros(P, 2048)
    for u in range(P):
        st_[u, :512] = first[u]
        st_[u, 512:1024] = second[u]
        st_[u, 1024:1536] = 0.0 if score_first is None else score_first[u]
        st_[u, 1536:] = 0.0 if score_second is None else score_second[u]
    return st_


def test_c4_first_boundary_masks_negative_positions_and_uses_second_half():
    # p = 3: window u = -4 .. 3; rows k = 0..3 (u < 0) masked; rows 4..7 (u = 0..3) read the
    # SECOND halves [512, 1024). First halves hold NaN: they must never be read.
    # Equal scores -> uniform softmax -> compressed = mean(1, 2, 3, 4) = 2.5 in every dim;
    # RMSNorm: rms = 2.5, normed = 2.5 / 2.5 * w = w (float64: 2.5 * fl64(1/2.5) rounds to 1).
    st_ = c4_state(4, [math.nan] * 4, [1.0, 2.0, 3.0, 4.0])
    kv, score, valid = state_windows(st_, torch.tensor([3]), 4)
    assert valid.tolist() == [[False] * 4 + [True] * 4]
    w = torch.linspace(0.5, 1.0, 512).to(torch.bfloat16)
    normed = compress_windows(kv, score, valid, w, 2.0**-60)
    assert torch.equal(normed[0], w.float())


def test_c4_window_columns_split_and_softmax_weights():
    # p = 7: rows k = 0..3 are u = 0..3 reading the FIRST half (a_u), k = 4..7 are u = 4..7 reading
    # the SECOND half (b_u). Scores: 0 except row k = 7 (u = 7, second half) with score ln 3
    # -> weights 1/10 for seven rows, 3/10 for the last. compressed = (sum others + 3 b_7) / 10.
    a = [1.0, 2.0, 3.0, 4.0, 99.0, 99.0, 99.0, 99.0]
    b = [-7.0, -7.0, -7.0, -7.0, 5.0, 6.0, 7.0, 8.0]
    ln3 = math.log(3.0)
    st_ = c4_state(8, a, b, score_second=[0.0] * 7 + [ln3])
    kv, score, valid = state_windows(st_, torch.tensor([7]), 4)
    assert kv[0, :, 0].tolist() == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]
    want = (1 + 2 + 3 + 4 + 5 + 6 + 7 + 3 * 8) / 10  # = 5.2 (score ln 3 rounded to fp32: ~1e-8 rel)
    got = compress_windows(kv, score, valid, ONES, 1e-6)
    # every dim equal -> rms = |compressed| -> normed = sign * 1/sqrt(1 + eps/c^2)
    assert abs(got[0, 0].item() - want / math.sqrt(want * want + 1e-6)) <= 2e-7


def test_compress_windows_against_direct_formula():
    # Random window, formula evaluated independently per dim with math.* in Python floats.
    g = torch.Generator().manual_seed(3)
    M, W = 2, 8
    kv = torch.randn(M, W, 512, generator=g)
    score = torch.randn(M, W, 512, generator=g) * 3
    valid = torch.ones(M, W, dtype=torch.bool)
    valid[0, :3] = False
    w = (0.5 + torch.rand(512, generator=g) / 2).to(torch.bfloat16)
    got = compress_windows(kv, score, valid, w, 1e-6)
    for m in range(M):
        comp = []
        for d in range(512):
            rows = [k for k in range(W) if valid[m, k]]
            mx = max(score[m, k, d].item() for k in rows)
            ps = [math.exp(score[m, k, d].item() - mx) for k in rows]
            comp.append(sum(p * kv[m, k, d].item() for p, k in zip(ps, rows)) / sum(ps))
        rms = math.sqrt(sum(c * c for c in comp) / 512 + 1e-6)
        want = torch.tensor([c / rms * w[d].item() for d, c in enumerate(comp)], dtype=torch.float64)
        # float64 evaluation then one fp32 rounding: within 1 fp32 ulp (+ float64 noise)
        assert bool(((got[m].double() - want).abs() <= 2.0**-23 * want.abs() + 1e-30).all())


def test_matches_float32_torch_reference_within_producer_tolerance():
    # H7: fp32 producers differ in reduction order; a plain fp32 torch implementation (softmax,
    # weighted sum, rsqrt) must agree with the float64 reference to a few fp32 ulps.
    g = torch.Generator().manual_seed(4)
    kv = torch.randn(4, 128, 512, generator=g)
    score = torch.randn(4, 128, 512, generator=g)
    valid = torch.ones(4, 128, dtype=torch.bool)
    ref = compress_windows(kv, score, valid, ONES, 1e-6)
    comp = (torch.softmax(score, dim=1) * kv).sum(dim=1)
    f32 = comp * torch.rsqrt(comp.pow(2).mean(dim=1, keepdim=True) + 1e-6)
    assert torch.allclose(f32, ref, rtol=2e-5, atol=1e-6)


@given(st.integers(0, 10**6), st.sampled_from([4, 128]))
def test_rope_position_equals_every_producers_form(j, ratio):
    # boundary p = (j+1)*ratio - 1: p - ratio + 1 == (p // ratio) * ratio (Triton) == (p // 4) * 4
    # (CuTe C4) == p - 127 (CuTe C128)
    p = (j + 1) * ratio - 1
    got = compressed_rope_position(torch.tensor([p]), ratio).item()
    assert got == j * ratio == (p // ratio) * ratio
    assert got == ((p // 4) * 4 if ratio == 4 else p - 127)


def test_build_state_adds_ape_by_position_mod_ratio():
    # score 1.0 + ape[p % 4]: ape rows 0.5, 0.25, 2^-30, -1.0 -> 1.5, 1.25, fl32(1 + 2^-30) = 1.0
    # (2^-30 < half an fp32 ulp of 1), 0.0.
    kv = torch.zeros(4, 1024)
    score = torch.ones(4, 1024)
    ape = torch.tensor([0.5, 0.25, 2.0**-30, -1.0]).repeat_interleave(1024).reshape(4, 1024)
    st_ = build_state(kv, score, torch.tensor([4, 1, 6, 3]), ape, 4)
    assert st_[:, 1024].tolist() == [1.5, 1.25, 1.0, 0.0]


@pytest.mark.parametrize("rule", [ScaleRule.SCALE_CLAMP, ScaleRule.AMAX_CLAMP])
def test_boundary_to_bytes(rule):
    # The bytes are the reference writer applied to the bf16 boundary row: NoPE = Q(rule) of
    # bf16(normed[:448]); RoPE bytes = bf16(RoPE(normed[448:], p - 3)) of the UNROUNDED fp32 input.
    g = torch.Generator().manual_seed(5)
    P = 12
    st_ = torch.randn(P, 2048, generator=g) * 0.01  # small values: Q_A != Q_S tiles (H1)
    tab = cos_sin_cache(64, theta=160000.0)
    cache = empty_cache(2, 64)
    pos = torch.tensor([3, 7, 11])
    slots = torch.tensor([5, 70, -1])
    new, b = compress_and_insert(cache, 64, st_, pos, slots, 4, ONES, 1e-6, tab, rule)
    assert b.rope_positions.tolist() == [0, 4, 8]
    full = torch.zeros(3, 512)
    full[:, 448:] = b.normed[:, 448:]
    assert torch.equal(b.rope_out, apply_rope(full, b.rope_positions, tab, arithmetic=RopeArithmetic.FMA_TRITON)[:, 448:])
    data, scales = read_records(new, torch.tensor([5, 70]), 64)
    codes, sb = quantize_tiles(b.normed[:2, :448].to(torch.bfloat16), rule)
    assert torch.equal(data[:, :448], codes) and torch.equal(scales[:, :7], sb)
    rows = decode_records(data, scales)
    assert torch.equal(rows[:, 448:], b.rope_out[:2].to(torch.bfloat16))
    assert torch.equal(rows[:, :448].float(), dequantize_tiles(codes, sb).float())


def test_validation():
    st_ = torch.zeros(8, 2048)
    with pytest.raises(InputError, match="state_windows.*'positions'.*boundary"):
        state_windows(st_, torch.tensor([4]), 4)
    with pytest.raises(InputError, match="state_windows.*'ratio'"):
        state_windows(st_, torch.tensor([3]), 8)
    with pytest.raises(InputError, match="state_windows.*'state'.*shape"):
        state_windows(torch.zeros(8, 1024), torch.tensor([3]), 4)
    kv, score, valid = state_windows(st_, torch.tensor([3]), 4)
    with pytest.raises(InputError, match="compress_windows.*'valid'.*at least one"):
        compress_windows(kv, score, torch.zeros_like(valid), ONES, 1e-6)
    with pytest.raises(InputError, match="compress_windows.*'eps'"):
        compress_windows(kv, score, valid, ONES, 0.0)
    b = compressor_boundary(st_, torch.tensor([3]), 4, ONES, 1e-6, cos_sin_cache(4))
    assert torch.equal(b.normed, torch.zeros(1, 512))  # zero state -> zero normed (rms = sqrt(eps))
