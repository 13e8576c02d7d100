"""The DeepSeek-V4.1 fused compressor: ring-buffer state, pool + RMSNorm, compressed-cache insert.

Models vLLM 0.33.0 ``models/deepseek_v41/common/ops/fused_compress_quant_cache.py``
(``V41:`` below): ``fused_save_compress_norm`` (``V41:22-317``) then ``rope_quant_insert``
(``V41:318-580``), the two ops the V4.1 attention layer schedules for a compressed layer.
Its state is NOT the V4 ``compressor``'s (``reference.pipeline.compressor``, ratios 4 / 128,
one dense state row per position with ``2*coff*512`` columns, overlapping windows):

* ratio ``r`` is 1 or 2; a group is ``r`` consecutive positions, closed by position ``p`` with
  ``(p + 1) % r == 0``; the window is the group itself (``W = r``, no overlap, no APE term: the
  input ``kv_score`` rows already hold ``[kv (512) | score (512)]`` for ratio 2 and ``kv (512)``
  for ratio 1);
* ratio 2 keeps a ring per request: ``state_cache`` fp32 ``[blocks, capacity, 1024]``, position
  ``p`` in row ``p % capacity`` of the block ``state_slots[t] // capacity``
  (``state_slots[t] = block * capacity + p % capacity``; negative = no state).

Per packed token ``t < T = len(state_slots)`` (``token_to_req_indices[t] = r``, chunk
``[qsl[r], qsl[r+1])``):

1. Latent (``V41:180-246``). Ratio 1: every ``t`` with ``state_slots[t] >= 0``; pooled =
   ``kv_score[t, :512]``. Ratio 2: every ``t`` with ``(p_t + 1) % 2 == 0`` and
   ``state_slots[t] >= 0``; the group's rows are ``(prev, kv_score[t])`` with ``prev =
   kv_score[t - 1]`` inside the chunk and, for the chunk's first token, the ring row
   ``state_cache[state_slots[t] // capacity, (p_t - 1) % capacity]`` as it was BEFORE the call;
   pooled ``[d] = sum_k softmax_k(score[k, d]) * kv[k, d]``. Then ``normed = pooled *
   rsqrt(mean(pooled**2) + eps) * w`` and ``latent[t] = bf16(normed)`` (rows not produced are not
   written). Arithmetic: ``compressor.compress_windows`` (float64, fixed order, one fp32 rounding);
   producers differ by their reductions and ``rsqrt.approx`` (H7), so the latent is judged by the
   compressor's derived tier (``oracles.compressor_tier``).
2. Ring update, ratio 2 (``V41:230-244``): per request whose first token has ``state_slots >= 0``,
   the chunk's last ``min(len, capacity)`` tokens ``u`` with ``state_slots[u] >= 0`` store
   ``kv_score[u]`` verbatim to their ring slot, after every read of step 1 (``tl.debug_barrier``).
   Exact copies: bit-exact.
3. Insert (``rope_quant_insert``, ``V41:318-580``) of the BF16 latent of every ``t < len(slots)``
   with ``slots[t] >= 0`` and ``(p_t + 1) % r == 0`` at RoPE position ``p_t // r * r``, per record:

   * ``mxfp8_528`` / ``nvfp4_288`` (V4.1 records, ``V41Layout.INTERLEAVED``): ALL 256 GPT-J pairs
     rotated in fp32 (NoPE pairs with ``(cos, sin) = (1, 0)``, so signed zeros may change), RoPE
     pairs ``224 + j`` with ``cos_sin[pos, j]`` / ``cos_sin[pos, 32 + j]``; the fp32 row is
     quantised by ``caches.v41.insert`` (MXFP8 ``ScaleRule.AMAX_CLAMP``, NVFP4
     ``Nvfp4ScaleRule.RECIP_MUL``);
   * ``model1_584`` (the V4 FP8 record): ``[latent[:448] | bf16(RoPE(latent[448:]))]`` by
     ``caches.model1.insert`` (``ScaleRule.AMAX_CLAMP``, 64-wide tiles, pad scale byte 0);
   * ``plain_bf16``: ``bf16`` of the all-pairs rotation; ``plain_fp8``: that bf16 row times
     ``fl32(1 / fp8_scale)``, E4M3 RNE saturating (``caches.plain.insert_fp8_rows``); the kernel's
     ``1.0 / scale`` is Triton's ``div.full`` (approximate), exact for a power-of-two scale only.

   Bit-exact from the latent: the stage judges a kernel's cache against this insert of the
   kernel's OWN latent (the latent itself by the tier of step 1).

Not modelled: ``prev_rows`` / ``prev_row_indices`` (context-parallel predecessor rows, PCP), the
ROCm un-joined pooling form, ``SANITIZE_CACHE_NANS`` (gfx950).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..constants import HEAD_DIM, NOPE_DIM, ROPE_DIM
from ..errors import INDEX_DTYPES, check_dtype, check_int, check_rank, fail
from ..policies import Nvfp4ScaleRule, RopeArithmetic, ScaleRule, V41Layout
from .compressor import compress_windows
from .rope import rope_pairs

__all__ = ["V41_COMPRESS_RATIOS", "V41_INSERT_RECORDS", "V41Compressed", "v41_save_compress", "v41_publish_rows",
           "v41_rope_quant_insert"]

V41_COMPRESS_RATIOS = (1, 2)
# The cache record a ``rope_quant_insert`` call writes (picked by the cache's dtype and last dimension).
V41_INSERT_RECORDS = ("mxfp8_528", "nvfp4_288", "model1_584", "plain_bf16", "plain_fp8")
_STATE_WIDTH = 2 * HEAD_DIM  # [kv | score]


@dataclass(frozen=True)
class V41Compressed:
    """Result of :func:`v41_save_compress` (``M`` produced latents).

    tokens: int64 ``[M]`` packed token indices; kv / score: fp32 ``[M, r, 512]`` the group rows
    (score zeros for ratio 1); normed: fp32 ``[M, 512]``; latent: bf16 ``[M, 512]``; state: the
    ring after the call (a new tensor; ``None`` for ratio 1)."""

    tokens: torch.Tensor
    kv: torch.Tensor
    score: torch.Tensor
    normed: torch.Tensor
    latent: torch.Tensor
    state: torch.Tensor | None


def _check_ratio(fn: str, ratio: object) -> int:
    if isinstance(ratio, bool) or ratio not in V41_COMPRESS_RATIOS:
        fail(fn, "compress_ratio", f"must be one of {list(V41_COMPRESS_RATIOS)}", ratio)
    return int(ratio)


def _index_vec(fn: str, name: str, t: object, min_len: int) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        fail(fn, name, "must be an integer tensor", type(t).__name__)
    check_dtype(fn, name, t, INDEX_DTYPES)
    check_rank(fn, name, t, 1)
    if t.shape[0] < min_len:
        fail(fn, name, f"must have at least {min_len} entries", t.shape[0])
    return t.to(torch.int64).cpu()


def v41_save_compress(kv_score: torch.Tensor, positions: torch.Tensor, state_cache: torch.Tensor | None,
                      state_slots: torch.Tensor, query_start_loc: torch.Tensor | None,
                      token_to_req_indices: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                      compress_ratio: int) -> V41Compressed:
    """Steps 1-2 of the module docstring (``fused_save_compress_norm``), on CPU.

    kv_score: fp32 ``[>= T, 512 * r]``; positions: int ``[>= T]`` (>= 0); state_slots: int ``[T]``;
    ratio 2 also: state_cache fp32 ``[blocks, capacity, 1024]``, query_start_loc int ``[R + 1]``
    (non-decreasing, ``qsl[R] <= T``), token_to_req_indices int ``[>= T]`` (each token's request);
    norm_weight bf16 / fp32 ``[512]``; eps > 0."""
    fn = "v41_save_compress"
    r = _check_ratio(fn, compress_ratio)
    check_dtype(fn, "kv_score", kv_score, (torch.float32,))
    if kv_score.dim() != 2 or kv_score.shape[1] != HEAD_DIM * r:
        fail(fn, "kv_score", f"must have shape [T, {HEAD_DIM * r}] for compress_ratio {r}", tuple(kv_score.shape))
    slots = _index_vec(fn, "state_slots", state_slots, 0)
    T = slots.shape[0]
    if kv_score.shape[0] < T:
        fail(fn, "kv_score", f"must have at least len(state_slots) = {T} rows", kv_score.shape[0])
    pos = _index_vec(fn, "positions", positions, T)[:T]
    if T and int(pos.min()) < 0:
        fail(fn, "positions", "must be >= 0", int(pos.min()))
    raw = kv_score.detach().cpu()
    state = None
    if r == 1:
        tokens = (slots >= 0).nonzero().flatten()
        kv = raw[tokens, :HEAD_DIM].unsqueeze(1)
        score = torch.zeros_like(kv)
    else:
        if not isinstance(state_cache, torch.Tensor):
            fail(fn, "state_cache", "is required for compress_ratio 2", type(state_cache).__name__)
        check_dtype(fn, "state_cache", state_cache, (torch.float32,))
        if state_cache.dim() != 3 or state_cache.shape[2] != _STATE_WIDTH:
            fail(fn, "state_cache", f"must have shape [blocks, capacity, {_STATE_WIDTH}]", tuple(state_cache.shape))
        nb, cap = state_cache.shape[0], state_cache.shape[1]
        if T and int(slots.max()) >= nb * cap:
            fail(fn, "state_slots", f"must be < blocks * capacity = {nb * cap}", int(slots.max()))
        qsl = _index_vec(fn, "query_start_loc", query_start_loc, 1)
        if bool((qsl[1:] < qsl[:-1]).any()) or int(qsl[0]) < 0 or int(qsl[-1]) > T:
            fail(fn, "query_start_loc", f"must be non-decreasing in [0, {T}]", qsl.tolist())
        req = _index_vec(fn, "token_to_req_indices", token_to_req_indices, T)[:T]
        n_req = qsl.shape[0] - 1
        if T and (int(req.min()) < 0 or int(req.max()) >= n_req):
            fail(fn, "token_to_req_indices", f"must name a request in [0, {n_req})", req.tolist())
        old = state_cache.detach().cpu()
        ends = ((pos + 1) % r == 0) & (slots >= 0)
        tokens = ends.nonzero().flatten()
        rows_prev, rows_cur = [], []
        for t in tokens.tolist():
            first = t == int(qsl[int(req[t])])
            if first:
                s = int(slots[t])
                prev = old[s // cap, (int(pos[t]) - 1) % cap]
            else:
                prev = raw[t - 1, :_STATE_WIDTH]
            rows_prev.append(prev)
            rows_cur.append(raw[t, :_STATE_WIDTH])
        if tokens.numel():
            pair = torch.stack((torch.stack(rows_prev), torch.stack(rows_cur)), dim=1)  # [M, 2, 1024]
        else:
            pair = torch.zeros((0, 2, _STATE_WIDTH), dtype=torch.float32)
        kv, score = pair[..., :HEAD_DIM].contiguous(), pair[..., HEAD_DIM:].contiguous()
        state = old.clone()
        for q in range(n_req):
            start, end = int(qsl[q]), int(qsl[q + 1])
            if start >= end or int(slots[start]) < 0:
                continue
            for u in range(end - min(end - start, cap), end):
                s = int(slots[u])
                if s >= 0:
                    state[s // cap, s % cap] = raw[u, :_STATE_WIDTH]
    valid = torch.ones(kv.shape[:2], dtype=torch.bool)
    normed = compress_windows(kv, score, valid, norm_weight.detach().cpu(), eps)
    return V41Compressed(tokens, kv, score, normed, normed.to(torch.bfloat16), state)


def _rotated_pairs(latent: torch.Tensor, rope_pos: torch.Tensor, cos_sin: torch.Tensor, all_pairs: bool,
                   arith: RopeArithmetic) -> torch.Tensor:
    """fp32 ``[M, 512]`` (``all_pairs``) or ``[M, 64]``: the kernel's rotation of the bf16 latent."""
    x = latent.to(torch.float64)
    cs = cos_sin.detach().cpu().to(torch.float32).to(torch.float64)[rope_pos]  # [M, 64]
    cos, sin = cs[:, :ROPE_DIM // 2], cs[:, ROPE_DIM // 2:]
    if all_pairs:
        n_nope = NOPE_DIM // 2
        cos = torch.cat((torch.ones(x.shape[0], n_nope, dtype=torch.float64), cos), dim=1)
        sin = torch.cat((torch.zeros(x.shape[0], n_nope, dtype=torch.float64), sin), dim=1)
    else:
        x = x[:, NOPE_DIM:]
    e, o = rope_pairs(x[:, 0::2], x[:, 1::2], cos, sin, False, arith)
    return torch.stack((e, o), dim=-1).reshape(x.shape).to(torch.float32)


def v41_publish_rows(latent: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, slots: torch.Tensor,
                     compress_ratio: int, record: str,
                     arith: RopeArithmetic | str = RopeArithmetic.FMA_TRITON) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows, row_slots)``: what ``rope_quant_insert`` quantises (step 3) for every token it
    writes, and the slot of each: fp32 ``[M, 512]`` for the V4.1 records, bf16 for the others.
    latent: bf16 ``[>= L, 512]``; positions int ``[>= L]``; cos_sin fp32 / bf16 ``[max_pos, 64]``
    (cos 32 | sin 32); slots int ``[L]``."""
    fn = "v41_publish_rows"
    r = _check_ratio(fn, compress_ratio)
    if record not in V41_INSERT_RECORDS:
        fail(fn, "record", f"must be one of {list(V41_INSERT_RECORDS)}", record)
    check_dtype(fn, "latent", latent, (torch.bfloat16,))
    if latent.dim() != 2 or latent.shape[1] != HEAD_DIM:
        fail(fn, "latent", f"must have shape [T, {HEAD_DIM}]", tuple(latent.shape))
    s = _index_vec(fn, "slots", slots, 0)
    L = s.shape[0]
    if latent.shape[0] < L:
        fail(fn, "latent", f"must have at least len(slots) = {L} rows", latent.shape[0])
    pos = _index_vec(fn, "positions", positions, L)[:L]
    check_dtype(fn, "cos_sin", cos_sin, (torch.float32, torch.bfloat16))
    if cos_sin.dim() != 2 or cos_sin.shape[1] != ROPE_DIM:
        fail(fn, "cos_sin", f"must have shape [max_pos, {ROPE_DIM}]", tuple(cos_sin.shape))
    take = ((s >= 0) & ((pos + 1) % r == 0)).nonzero().flatten()
    rope_pos = pos[take] // r * r
    if take.numel() and (int(rope_pos.min()) < 0 or int(rope_pos.max()) >= cos_sin.shape[0]):
        fail(fn, "positions", f"must give RoPE positions in [0, {cos_sin.shape[0]})", rope_pos.tolist()[:4])
    lat = latent.detach().cpu()[take]
    arith = RopeArithmetic(arith)
    if record == "model1_584":
        rope = _rotated_pairs(lat, rope_pos, cos_sin, False, arith).to(torch.bfloat16)
        return torch.cat((lat[:, :NOPE_DIM], rope), dim=1), s[take]
    rows = _rotated_pairs(lat, rope_pos, cos_sin, True, arith)
    return (rows if record in ("mxfp8_528", "nvfp4_288") else rows.to(torch.bfloat16)), s[take]


def v41_rope_quant_insert(cache: torch.Tensor, latent: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                          slots: torch.Tensor, compress_ratio: int, record: str, block_size: int,
                          fp8_scale: float | None = None,
                          scale_rule: ScaleRule | str = ScaleRule.AMAX_CLAMP,
                          nvfp4_rule: Nvfp4ScaleRule | str = Nvfp4ScaleRule.RECIP_MUL,
                          layout: V41Layout | str = V41Layout.INTERLEAVED,
                          arith: RopeArithmetic | str = RopeArithmetic.FMA_TRITON) -> torch.Tensor:
    """Step 3: a NEW cache with the latent of every written token inserted (``rope_quant_insert``).

    cache: uint8 ``[num_blocks, page_stride]`` (or a kernel view) for ``mxfp8_528`` /
    ``nvfp4_288`` / ``model1_584``; bfloat16 ``[num_blocks, bs, 512]`` for ``plain_bf16``; uint8 /
    float8_e4m3fn ``[num_blocks, bs, 512]`` for ``plain_fp8`` with ``fp8_scale`` (a positive fp32
    value). Policies: ``scale_rule`` (MXFP8 and 584-byte tiles), ``nvfp4_rule``, ``layout`` (V4.1
    byte order), ``arith`` (the RoPE contraction)."""
    from ..caches import model1 as cache_model1
    from ..caches import plain as cache_plain
    from ..caches import v41 as cache_v41

    fn = "v41_rope_quant_insert"
    bs = check_int(fn, "block_size", block_size, minimum=1)
    rows, row_slots = v41_publish_rows(latent, positions, cos_sin, slots, compress_ratio, record, arith)
    if record in ("mxfp8_528", "nvfp4_288"):
        return cache_v41.insert(cache, rows, row_slots, bs, record, layout, scale_rule, "finite", nvfp4_rule)
    if record == "model1_584":
        return cache_model1.insert(cache, rows, row_slots, bs, scale_rule)
    if record == "plain_bf16":
        return cache_plain.insert_bf16_rows(cache, rows, row_slots)
    if fp8_scale is None:
        fail(fn, "fp8_scale", "is required for record plain_fp8")
    return cache_plain.insert_fp8_rows(cache, rows, row_slots, kv_scale=float(fp8_scale))
