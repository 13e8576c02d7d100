"""One DSv4 attention layer step, composed from the reference stages (README 1; attention 3;
datapath 2, 4, 5).

Layer types (``LayerSpec.ratio``): 1 = SWA-only, 4 = C4A (sliding window + indexer top-k over a
4x compressed cache), 128 = C128A (sliding window + every visible entry of a 128x compressed
cache). For one batch step (``BatchLayout``: per request ``seq_len`` after the step and
``query_len`` new tokens; token ``i`` of request ``r`` sits at ``p = seq_len - query_len + i``):

1. ``write_tokens``: the SWA writer (datapath 2.1): ``bf16(RoPE_FMA(kv, p))`` quantised with
   Q_A into the SWA cache at the token's slot; the compressor state rows (datapath 5.1 step 2)
   and, at boundary positions ``(p+1) % ratio == 0``, the compressed entry ``j = p // ratio``
   (``compressor.compress_and_insert``, Q_S by default = CuTe on NVIDIA) at its compressed slot.
2. ``attend``: q is roped like the writer's q branch (``bf16(RoPE_FMA(q, p))``; the weightless
   per-head RMSNorm is assumed done upstream). Indices are built with the index builders:
   - ``form="decode"`` (FlashMLA decode / ROCm decode): segment 0 = SWA cache rows by global slot
     (``indices_window.compute_swa_indices_and_lens``); segment 1 = compressed cache rows:
     C4A ``indices_slots.compute_global_topk_indices_and_lens`` of a local top-k, C128A
     ``indices_window.build_c128a_topk_metadata``. ``IndexRule.MINUS1_ONLY`` (FlashMLA decode).
   - ``form="prefill"`` (FlashMLA prefill): one bf16 workspace per step: compressed entries
     ``[0, seq_len//ratio)`` at rows ``r*M + i`` and the gathered window at ``r*M + N + i``
     (``cache_model1.gather`` twice, as ``V:models/deepseek_v4/nvidia/flashmla.py:329-349``),
     combined indices from ``indices_prefill.combine_topk_swa_indices``;
     ``IndexRule.ANY_OUT_OF_RANGE_INVALID``.
   The oracle (``attention.sparse_attention``) runs on the exact dequantised rows; its float64
   output is rounded (fp32 then bf16, the kernels' single store rounding) and passed through the
   output epilogue (``epilogue.inv_rope_fp8_quant``).
3. ``layer_step`` = ``write_tokens`` then ``attend`` (vLLM inserts before attending, so a token
   sees itself and, at a boundary, its own new compressed entry).

C4A top-k: the indexer is not modelled; ``synthetic_topk`` draws, per token, a random subset of
the visible entries ``[0, (p+1)//4)`` of size ``min(visible, index_topk)`` in random order,
``-1`` after (datapath 5.2 "For synthetic data"). A caller may pass its own local top-k.

Realistic kernel inputs: ``flashmla_decode_inputs`` builds FlashMLA MODEL1 decode calls for the
production configurations (``FLASHMLA_MODEL1_CONFIGS``, FMLA
``tests/test_flash_mla_sparse_decoding.py`` "MODEL1 CONFIG1-4") from a batch of sequence
lengths, using ``synthetic_history`` for the tokens before the step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch

from ..attention.ordered import OracleOut, Segment, sparse_attention
from ..caches.model1 import dequantize_all, empty_cache, gather, insert, kernel_view
from .compressor import build_state, compressor_boundary, compressor_geometry
from ..constants import (
    C4_RATIO,
    C128_RATIO,
    C128A_TOPK_ALIGN,
    HEAD_DIM,
    KV_BLOCK_SIZE,
    OUT_HEADS_PER_GROUP,
    SOFTMAX_SCALE,
    SWA_WINDOW,
    production_page_stride,
)
from ..attention.epilogue import EpilogueOut, inv_rope_fp8_quant
from ..errors import check_dtype, check_int, fail
from ..indices.prefill import combine_topk_swa_indices
from ..indices.slots import compute_global_topk_indices_and_lens, local_to_global_slots
from ..indices.window import build_c128a_topk_metadata, compute_swa_indices_and_lens
from ..policies import IndexRule, RopeArithmetic, ScaleRule
from .rope import YarnConfig, apply_rope, cos_sin_cache

__all__ = [
    "BatchLayout",
    "LayerSpec",
    "LayerWeights",
    "LayerState",
    "StepResult",
    "FLASHMLA_MODEL1_CONFIGS",
    "make_weights",
    "init_layer_state",
    "synthetic_history",
    "synthetic_topk",
    "write_tokens",
    "attend",
    "layer_step",
    "flashmla_decode_inputs",
]

COMPRESS_ROPE_THETA = 160000.0  # attention 3.2 / datapath 5: compressed layers
MAIN_ROPE_THETA = 10000.0  # SWA-only layers
YARN_CONFIG = YarnConfig(16.0, 65536)


# --------------------------------------------------------------------------- configuration
@dataclass(frozen=True)
class BatchLayout:
    """Requests of one step: ``seq_lens[r]`` tokens after the step, ``query_lens[r]`` of them new.
    Decode requests have ``query_len = 1``; tokens are numbered request-major."""

    seq_lens: tuple[int, ...]
    query_lens: tuple[int, ...]

    def __post_init__(self):
        fn = "BatchLayout"
        if len(self.seq_lens) != len(self.query_lens) or not self.seq_lens:
            fail(fn, "seq_lens,query_lens", "must be non-empty and of equal length")
        for s, q in zip(self.seq_lens, self.query_lens):
            check_int(fn, "seq_lens", s, minimum=1)
            check_int(fn, "query_lens", q, minimum=1)
            if q > s:
                fail(fn, "query_lens", "must be <= seq_lens", (q, s))

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    def query_start_loc(self) -> torch.Tensor:
        return torch.tensor([0] + list(torch.tensor(self.query_lens).cumsum(0).tolist()), dtype=torch.int32)

    def token_to_req(self) -> torch.Tensor:
        return torch.cat([torch.full((q,), r, dtype=torch.int32) for r, q in enumerate(self.query_lens)])

    def positions(self) -> torch.Tensor:
        return torch.cat([torch.arange(s - q, s, dtype=torch.int64) for s, q in zip(self.seq_lens, self.query_lens)])


@dataclass(frozen=True)
class LayerSpec:
    """One attention layer's configuration.

    ratio: 1 (SWA-only), 4 (C4A), 128 (C128A). num_heads: 64 / 128 (FlashMLA). index_topk: C4A
    top-k (512 Flash, 1024 Pro). swa_block_size: SWA page entries (vLLM 64; FlashMLA's MODEL1
    configs use 256). comp_block_size: compressed page entries (None: ``256 // ratio``: 64 / 2).
    c128a_width: C128A row width ``Wc`` (multiple of 128; None: smallest multiple of 128 that
    holds the longest sequence's entries). scale: softmax scale. norm_eps: compressor RMSNorm eps.
    swa_rule / comp_rule: producers' scale rules (Q_A SWA writer; Q_S CuTe compressor, H1).
    kv_rope / comp_rope: RoPE arithmetic of the SWA writer (FMA, PROBE-verified) and of the
    compressor (FMA_TRITON models the Triton compressor; the CuTe contraction is unverified).
    """

    ratio: int
    num_heads: int
    index_topk: int = 512
    swa_block_size: int = 64
    comp_block_size: int | None = None
    c128a_width: int | None = None
    window: int = SWA_WINDOW
    scale: float = SOFTMAX_SCALE
    norm_eps: float = 1e-6
    heads_per_group: int = OUT_HEADS_PER_GROUP
    swa_rule: ScaleRule = ScaleRule.AMAX_CLAMP
    comp_rule: ScaleRule = ScaleRule.SCALE_CLAMP
    kv_rope: RopeArithmetic = RopeArithmetic.FMA
    comp_rope: RopeArithmetic = RopeArithmetic.FMA_TRITON

    def __post_init__(self):
        fn = "LayerSpec"
        if self.ratio not in (1, C4_RATIO, C128_RATIO):
            fail(fn, "ratio", f"must be 1, {C4_RATIO} or {C128_RATIO}", self.ratio)
        check_int(fn, "num_heads", self.num_heads, minimum=1)
        check_int(fn, "index_topk", self.index_topk, minimum=1)
        check_int(fn, "swa_block_size", self.swa_block_size, minimum=1)
        check_int(fn, "window", self.window, minimum=1)
        if self.comp_block_size is not None:
            check_int(fn, "comp_block_size", self.comp_block_size, minimum=1)
        if self.c128a_width is not None and (self.c128a_width <= 0 or self.c128a_width % C128A_TOPK_ALIGN):
            fail(fn, "c128a_width", f"must be a positive multiple of {C128A_TOPK_ALIGN}", self.c128a_width)
        if self.num_heads % self.heads_per_group:
            fail(fn, "heads_per_group", f"must divide num_heads={self.num_heads}", self.heads_per_group)

    @property
    def compressed(self) -> bool:
        return self.ratio > 1

    @property
    def comp_bs(self) -> int:
        return self.comp_block_size if self.comp_block_size is not None else KV_BLOCK_SIZE // self.ratio


@dataclass(frozen=True)
class LayerWeights:
    """Per-layer parameters: sink [H] fp32, cos/sin table, compressor norm weight [512] bf16 and
    ape [ratio, coff*512] fp32 (None on SWA-only layers)."""

    sink: torch.Tensor
    cos_sin: torch.Tensor
    norm_weight: torch.Tensor | None = None
    ape: torch.Tensor | None = None


def make_weights(spec: LayerSpec, max_pos: int, seed: int = 0, sink_infs: bool = True) -> LayerWeights:
    """Deterministic weights. Sinks ~ N(0, 1) with (``sink_infs``) one ``+inf`` and one ``-inf``
    head (FMLA ``tests/lib.py`` draws ~30% of each); the last heads of a 64-head layer stay finite.
    RoPE table per layer type (attention 3.2): plain theta 1e4 (SWA-only), theta 1.6e5 + YaRN
    (factor 16, original 65536) on compressed layers."""
    check_int("make_weights", "max_pos", max_pos, minimum=1)
    g = torch.Generator().manual_seed(seed)
    sink = torch.randn(spec.num_heads, generator=g)
    if sink_infs and spec.num_heads >= 4:
        sink[1] = math.inf
        sink[2] = -math.inf
    if spec.compressed:
        cs = cos_sin_cache(max_pos, theta=COMPRESS_ROPE_THETA, yarn=YARN_CONFIG)
        coff, _ = compressor_geometry(spec.ratio)
        w = (0.5 + 0.5 * torch.rand(HEAD_DIM, generator=g)).to(torch.bfloat16)
        ape = torch.randn(spec.ratio, coff * HEAD_DIM, generator=g) * 0.1
        return LayerWeights(sink, cs, w, ape)
    return LayerWeights(sink, cos_sin_cache(max_pos, theta=MAIN_ROPE_THETA))


@dataclass(frozen=True)
class LayerState:
    """Caches and history of one layer (never mutated: every update returns a new state).

    swa_cache / comp_cache: uint8 2-D caches ``[num_blocks, page_stride]`` (comp None on SWA-only).
    swa_block_table / comp_block_table: int32 ``[R, B]`` (pages assigned in a shuffled order).
    state_rows: per request fp32 ``[capacity, 2*coff*512]`` compressor state (compressed layers).
    state_valid: per request bool ``[capacity]``: which state rows hold a written token.
    """

    swa_cache: torch.Tensor
    swa_block_table: torch.Tensor
    comp_cache: torch.Tensor | None
    comp_block_table: torch.Tensor | None
    state_rows: tuple[torch.Tensor, ...] = ()
    state_valid: tuple[torch.Tensor, ...] = ()


def _shuffled_table(R: int, blocks_per_req: int, g: torch.Generator) -> torch.Tensor:
    perm = torch.randperm(R * blocks_per_req, generator=g).to(torch.int32)
    return perm.reshape(R, blocks_per_req)


def init_layer_state(spec: LayerSpec, capacity: list[int] | tuple[int, ...], seed: int = 0,
                     poison: bool = True) -> LayerState:
    """Empty caches for requests that will hold up to ``capacity[r]`` tokens, with shuffled
    (permuted) block tables and production page strides. ``poison`` fills every byte with 0xFF so
    unwritten slots decode to NaN (FMLA ``tests/lib.py`` poisons unreferenced rows)."""
    fn = "init_layer_state"
    if not capacity:
        fail(fn, "capacity", "must list at least one request")
    for c in capacity:
        check_int(fn, "capacity", c, minimum=1)
    g = torch.Generator().manual_seed(seed)
    R = len(capacity)
    fill = 0xFF if poison else 0
    nbr = -(-max(capacity) // spec.swa_block_size)
    swa = empty_cache(R * nbr, spec.swa_block_size, production_page_stride(spec.swa_block_size), fill=fill)
    swa_bt = _shuffled_table(R, nbr, g)
    if not spec.compressed:
        return LayerState(swa, swa_bt, None, None)
    nc = max(1, -(-(max(capacity) // spec.ratio) // spec.comp_bs))
    comp = empty_cache(R * nc, spec.comp_bs, production_page_stride(spec.comp_bs), fill=fill)
    comp_bt = _shuffled_table(R, nc, g)
    coff, _ = compressor_geometry(spec.ratio)
    rows = tuple(torch.zeros(c, 2 * coff * HEAD_DIM) for c in capacity)
    valid = tuple(torch.zeros(c, dtype=torch.bool) for c in capacity)
    return LayerState(swa, swa_bt, comp, comp_bt, rows, valid)


# --------------------------------------------------------------------------- writers
def kv_rows_roped(spec: LayerSpec, weights: LayerWeights, kv: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    return apply_rope(kv, pos, weights.cos_sin, arithmetic=spec.kv_rope).to(torch.bfloat16)


def write_tokens(spec: LayerSpec, weights: LayerWeights, state: LayerState, layout: BatchLayout,
                 kv: torch.Tensor, kv_score: torch.Tensor | None = None,
                 donate: bool = False) -> tuple[LayerState, dict]:
    """Write the step's new tokens (module docstring step 1); returns ``(new state, info)``.

    kv: bf16 ``[T, 512]`` pre-RoPE latent rows (normalised upstream). kv_score: fp32
    ``[T, 2*coff*512]`` = ``[kv part | score part]`` of the compressor projection (compressed
    layers only). info: ``swa_slots [T]``, ``comp_positions`` / ``comp_slots`` of the entries
    written, ``boundaries`` (``CompressorBoundary`` per request with entries).
    donate: True lets the step update ``state``'s caches and state rows in place (for a caller
    that discards ``state``): the same result without copying whole caches and state rows."""
    fn = "write_tokens"
    T = layout.num_tokens
    check_dtype(fn, "kv", kv, (torch.bfloat16,))
    if tuple(kv.shape) != (T, HEAD_DIM):
        fail(fn, "kv", f"must have shape [T={T}, {HEAD_DIM}]", f"shape {tuple(kv.shape)}")
    pos = layout.positions()
    req = layout.token_to_req()
    swa_slots = local_to_global_slots(pos, req, state.swa_block_table, spec.swa_block_size)
    rows = kv_rows_roped(spec, weights, kv, pos)
    swa = insert(state.swa_cache, rows, swa_slots, spec.swa_block_size, spec.swa_rule, inplace=donate)
    info: dict = {"swa_slots": swa_slots, "comp_positions": [], "comp_slots": [], "boundaries": []}
    if not spec.compressed:
        return replace(state, swa_cache=swa), info
    coff, _ = compressor_geometry(spec.ratio)
    if kv_score is None:
        fail(fn, "kv_score", "is required on compressed layers")
    check_dtype(fn, "kv_score", kv_score, (torch.float32,))
    if tuple(kv_score.shape) != (T, 2 * coff * HEAD_DIM):
        fail(fn, "kv_score", f"must have shape [T={T}, {2 * coff * HEAD_DIM}]", f"shape {tuple(kv_score.shape)}")
    w = coff * HEAD_DIM
    new_rows = list(state.state_rows)
    new_valid = list(state.state_valid)
    comp = state.comp_cache
    qsl = layout.query_start_loc().tolist()
    # compress_and_insert per request, with the inserts of all requests done at once: the records
    # are per row and the slots distinct, so the bytes are those of one insert per request.
    comp_rows: list[torch.Tensor] = []
    for r in range(len(layout.seq_lens)):
        t0, t1 = qsl[r], qsl[r + 1]
        p = pos[t0:t1]
        if int(p.max()) >= new_rows[r].shape[0]:
            fail(fn, "layout", f"request {r} exceeds the state capacity {new_rows[r].shape[0]}", int(p.max()))
        st = build_state(kv_score[t0:t1, :w].contiguous(), kv_score[t0:t1, w:].contiguous(), p, weights.ape, spec.ratio)
        rows_r = new_rows[r] if donate else new_rows[r].clone()
        rows_r[p] = st
        valid_r = new_valid[r] if donate else new_valid[r].clone()
        valid_r[p] = True
        new_rows[r], new_valid[r] = rows_r, valid_r
        bpos = p[(p + 1) % spec.ratio == 0]
        if bpos.numel() == 0:
            continue
        u_lo = int(bpos.min()) - compressor_geometry(spec.ratio)[1] + 1
        need = torch.arange(max(u_lo, 0), int(bpos.max()) + 1)
        if not bool(valid_r[need].all()):
            fail(fn, "state", f"request {r}: compressor window rows {need[~valid_r[need]][:4].tolist()} "
                 "were never written (write the history first)")
        j = bpos // spec.ratio
        cslots = local_to_global_slots(j, torch.full_like(j, r), state.comp_block_table, spec.comp_bs)
        b = compressor_boundary(rows_r, bpos, spec.ratio, weights.norm_weight, spec.norm_eps, weights.cos_sin,
                                spec.comp_rope)
        comp_rows.append(b.row_bf16)
        info["comp_positions"].append(bpos)
        info["comp_slots"].append(cslots)
        info["boundaries"].append(b)
    if comp_rows:
        comp = insert(comp, torch.cat(comp_rows), torch.cat(info["comp_slots"]), spec.comp_bs, spec.comp_rule,
                      inplace=donate)
    return replace(state, swa_cache=swa, comp_cache=comp, state_rows=tuple(new_rows),
                   state_valid=tuple(new_valid)), info


def synthetic_history(spec: LayerSpec, weights: LayerWeights, state: LayerState, prefix_lens: list[int],
                      seed: int = 0, donate: bool = False) -> LayerState:
    """Fill the caches as if each request had ``prefix_lens[r]`` earlier tokens, cheaply.

    Writes the SWA rows of the last ``window`` prefix positions (older rows are never read) and
    every compressed entry ``j < prefix//ratio`` directly as bf16 rows of RMS-normalised
    Gaussians times a weight in [0.5, 1] with Q_S / Q_A per ``spec.comp_rule`` (datapath 5.2
    "synthetic data"; the compressor itself is not run for the history), plus random compressor
    state rows for the last ``window`` positions so a following step can compress.
    donate: as ``write_tokens`` (``state`` updated in place; for a caller that discards it)."""
    fn = "synthetic_history"
    g = torch.Generator().manual_seed(seed)
    R = len(prefix_lens)
    if R != state.swa_block_table.shape[0]:
        fail(fn, "prefix_lens", f"must have one entry per request ({state.swa_block_table.shape[0]})", R)
    swa, comp = state.swa_cache, state.comp_cache
    rows_l, valid_l = list(state.state_rows), list(state.state_valid)
    # Rows and slots are drawn request by request (the generator's order), then written with one
    # insert per cache: the records are per row and the slots distinct, so one insert of all rows
    # writes the same bytes as one insert per request, without copying the whole cache each time.
    swa_rows, swa_slots, comp_rows, comp_slots = [], [], [], []
    for r, L in enumerate(prefix_lens):
        check_int(fn, "prefix_lens", L, minimum=0)
        if L == 0:
            continue
        p = torch.arange(max(0, L - spec.window), L)
        kv = realistic_rows(p.numel(), g)
        swa_slots.append(local_to_global_slots(p, torch.full_like(p, r), state.swa_block_table, spec.swa_block_size))
        swa_rows.append(kv_rows_roped(spec, weights, kv, p))
        if not spec.compressed:
            continue
        n = L // spec.ratio
        if n:
            j = torch.arange(n)
            comp_slots.append(local_to_global_slots(j, torch.full_like(j, r), state.comp_block_table, spec.comp_bs))
            comp_rows.append(realistic_rows(n, g))
        coff, W = compressor_geometry(spec.ratio)
        sp = torch.arange(max(0, L - W), L)
        rr, vv = (rows_l[r], valid_l[r]) if donate else (rows_l[r].clone(), valid_l[r].clone())
        rr[sp] = torch.randn(sp.numel(), 2 * coff * HEAD_DIM, generator=g)
        vv[sp] = True
        rows_l[r], valid_l[r] = rr, vv
    if swa_rows:
        swa = insert(swa, torch.cat(swa_rows), torch.cat(swa_slots), spec.swa_block_size, spec.swa_rule,
                     inplace=donate)
    if comp_rows:
        comp = insert(comp, torch.cat(comp_rows), torch.cat(comp_slots), spec.comp_bs, spec.comp_rule,
                      inplace=donate)
    return replace(state, swa_cache=swa, comp_cache=comp, state_rows=tuple(rows_l), state_valid=tuple(valid_l))


def realistic_rows(n: int, g: torch.Generator) -> torch.Tensor:
    """bf16 ``[n, 512]``: RMS-normalised Gaussians times U[0.5, 1] (datapath 5.2)."""
    x = torch.randn(n, HEAD_DIM, generator=g, dtype=torch.float64)
    x = x / x.pow(2).mean(dim=1, keepdim=True).sqrt()
    return (x * (0.5 + 0.5 * torch.rand(n, 1, generator=g, dtype=torch.float64))).to(torch.bfloat16)


def synthetic_topk(positions: torch.Tensor, index_topk: int, ratio: int = C4_RATIO, seed: int = 0) -> torch.Tensor:
    """Local C4 top-k ``[T, index_topk]`` int32: a random subset of ``[0, (p+1)//ratio)`` of size
    ``min(visible, index_topk)`` in random order, then ``-1`` (the indexer is not modelled)."""
    g = torch.Generator().manual_seed(seed)
    out = torch.full((positions.numel(), index_topk), -1, dtype=torch.int32)
    for t, p in enumerate(positions.tolist()):
        vis = (p + 1) // ratio
        k = min(vis, index_topk)
        if k:
            out[t, :k] = torch.randperm(vis, generator=g)[:k].to(torch.int32)
    return out


# --------------------------------------------------------------------------- attention
@dataclass
class StepResult:
    """What one ``attend`` produced: everything a kernel comparison needs.

    positions [T]; q_roped bf16 [T, H, 512]; segments (the oracle's exact inputs); indices:
    dict of the index tensors built (decode: swa_indices/swa_lens/comp_indices/comp_lens;
    prefill: combined_indices/combined_lens/workspace); oracle: ``OracleOut``; out_bf16:
    bf16 [T, H, 512] (oracle output rounded fp32 -> bf16); epilogue: ``EpilogueOut``.
    """

    positions: torch.Tensor
    q_roped: torch.Tensor
    segments: list
    indices: dict
    oracle: OracleOut | None
    out_bf16: torch.Tensor | None
    epilogue: EpilogueOut | None
    write_info: dict = field(default_factory=dict)


def _c128a_width(spec: LayerSpec, layout: BatchLayout) -> int:
    if spec.c128a_width is not None:
        return spec.c128a_width
    n = max(layout.seq_lens) // spec.ratio
    return max(C128A_TOPK_ALIGN, -(-n // C128A_TOPK_ALIGN) * C128A_TOPK_ALIGN)


def _local_topk(spec: LayerSpec, layout: BatchLayout, topk_local: torch.Tensor | None, seed: int) -> torch.Tensor:
    pos = layout.positions()
    if spec.ratio == C4_RATIO:
        if topk_local is None:
            return synthetic_topk(pos, spec.index_topk, spec.ratio, seed)
        check_dtype("attend", "topk_local", topk_local, (torch.int32, torch.int64))
        if topk_local.dim() != 2 or topk_local.shape[0] != pos.numel():
            fail("attend", "topk_local", f"must have shape [T={pos.numel()}, K]", f"shape {tuple(topk_local.shape)}")
        return topk_local.to(torch.int32)
    # C128A: every visible entry (prefill rows of the C128A builder are request-local k < n_t)
    W = _c128a_width(spec, layout)
    n = torch.clamp(torch.div(pos + 1, spec.ratio, rounding_mode="floor"), max=W)
    k = torch.arange(W)
    return torch.where(k[None, :] < n[:, None], k[None, :], torch.tensor(-1)).to(torch.int32)


def attend(spec: LayerSpec, weights: LayerWeights, state: LayerState, layout: BatchLayout, q: torch.Tensor,
           form: str = "decode", topk_local: torch.Tensor | None = None, seed: int = 0,
           chunk_tokens: int | None = None, run_oracle: bool = True, build_segments: bool = True) -> StepResult:
    """Attention of the step's query tokens over the current caches (module docstring step 2).

    q: bf16 ``[T, H, 512]`` pre-RoPE queries. form: ``"decode"`` (two segments on the paged
    caches, FlashMLA decode indices) or ``"prefill"`` (one combined segment on a bf16 workspace).
    topk_local: C4A request-local top-k ``[T, K]`` (None: ``synthetic_topk``).
    run_oracle: False builds only the inputs (``oracle``, ``out_bf16``, ``epilogue`` are None).
    build_segments: False (only with ``run_oracle=False``) leaves the decode segments out
    (``segments`` empty): dequantising whole caches is most of a large decode case's cost and
    a case builder needs only the index tensors. Prefill segments (the workspace) are always built."""
    fn = "attend"
    T = layout.num_tokens
    check_dtype(fn, "q", q, (torch.bfloat16,))
    if tuple(q.shape) != (T, spec.num_heads, HEAD_DIM):
        fail(fn, "q", f"must have shape [T={T}, H={spec.num_heads}, {HEAD_DIM}]", f"shape {tuple(q.shape)}")
    if form not in ("decode", "prefill"):
        fail(fn, "form", "must be 'decode' or 'prefill'", form)
    if run_oracle and not build_segments:
        fail(fn, "build_segments", "must be True when run_oracle=True (the oracle reads the segments)")
    pos = layout.positions()
    req = layout.token_to_req()
    qsl = layout.query_start_loc()
    seq = torch.tensor(layout.seq_lens, dtype=torch.int32)
    q_roped = apply_rope(q, pos, weights.cos_sin, arithmetic=spec.kv_rope).to(torch.bfloat16)
    valid_tok = torch.ones(T, dtype=torch.bool)
    indices: dict = {}
    if form == "decode":
        swa_idx, swa_len = compute_swa_indices_and_lens(qsl, seq, req, valid_tok, state.swa_block_table,
                                                        spec.swa_block_size, window_size=spec.window)
        segments = []
        if build_segments:
            swa_rows = dequantize_all(state.swa_cache, spec.swa_block_size)
            segments.append(Segment(swa_rows, swa_idx, swa_len, IndexRule.MINUS1_ONLY))
        indices.update(swa_indices=swa_idx, swa_lens=swa_len)
        if spec.compressed:
            if spec.ratio == C4_RATIO:
                local = _local_topk(spec, layout, topk_local, seed)
                cidx, clen = compute_global_topk_indices_and_lens(local, req, state.comp_block_table,
                                                                  spec.comp_bs, valid_tok)
            else:
                cidx, clen, _ = build_c128a_topk_metadata(pos, spec.ratio, T, req, state.comp_block_table,
                                                          spec.comp_bs, torch.zeros(T, dtype=torch.int64),
                                                          _c128a_width(spec, layout))
            if build_segments:
                comp_rows = dequantize_all(state.comp_cache, spec.comp_bs)
                segments.append(Segment(comp_rows, cidx, clen, IndexRule.MINUS1_ONLY))
            indices.update(comp_indices=cidx, comp_lens=clen)
    else:
        qlens = torch.tensor(layout.query_lens, dtype=torch.int32)
        prefix = seq - qlens
        gather_lens = qlens + torch.clamp(prefix, min=0, max=spec.window - 1)
        n_comp = torch.div(seq, spec.ratio, rounding_mode="floor") if spec.compressed else torch.zeros_like(seq)
        N = int(n_comp.max())
        M = N + int(gather_lens.max())
        R = len(layout.seq_lens)
        ws = torch.zeros(R, M, HEAD_DIM, dtype=torch.bfloat16)
        if spec.compressed and N:
            crow, _ = gather(state.comp_cache, state.comp_block_table, n_comp, spec.comp_bs)
            ws[:, : crow.shape[1]] = crow
        srow, _ = gather(state.swa_cache, state.swa_block_table, seq, spec.swa_block_size,
                         gather_lens=gather_lens, offset=N)
        ws[:, : srow.shape[1]] = torch.where(torch.arange(srow.shape[1])[None, :, None] >= N, srow,
                                             ws[:, : srow.shape[1]])
        if spec.compressed:
            local = _local_topk(spec, layout, topk_local, seed)
            top = spec.index_topk if spec.ratio == C4_RATIO else local.shape[1]
        else:
            local = torch.full((T, 1), -1, dtype=torch.int32)
            top = 0
        comb, clen = combine_topk_swa_indices(local, qsl, seq, gather_lens, spec.window, spec.ratio, top, M, N)
        rows = ws.reshape(R * M, HEAD_DIM)
        segments = [Segment(rows, comb, clen, IndexRule.ANY_OUT_OF_RANGE_INVALID)]
        indices.update(combined_indices=comb, combined_lens=clen, workspace=rows, N=N, M=M,
                       gather_lens=gather_lens)
    if not run_oracle:
        return StepResult(pos, q_roped, segments, indices, None, None, None)
    res = sparse_attention(q_roped, segments, spec.scale, weights.sink, chunk_tokens=chunk_tokens)
    out_bf16 = res.out.to(torch.float32).to(torch.bfloat16)
    epi = inv_rope_fp8_quant(torch.nan_to_num(out_bf16), pos, weights.cos_sin, spec.heads_per_group)
    return StepResult(pos, q_roped, segments, indices, res, out_bf16, epi)


def layer_step(spec: LayerSpec, weights: LayerWeights, state: LayerState, layout: BatchLayout, q: torch.Tensor,
               kv: torch.Tensor, kv_score: torch.Tensor | None = None, form: str = "decode",
               topk_local: torch.Tensor | None = None, seed: int = 0) -> tuple[LayerState, StepResult]:
    """``write_tokens`` then ``attend``: one DSv4 attention layer for one batch step."""
    new_state, info = write_tokens(spec, weights, state, layout, kv, kv_score)
    res = attend(spec, weights, new_state, layout, q, form=form, topk_local=topk_local, seed=seed)
    res.write_info = info
    return new_state, res


# --------------------------------------------------------------------------- kernel inputs
# FlashMLA MODEL1 production decode configurations (FMLA tests/test_flash_mla_sparse_decoding.py
# "MODEL1 CONFIG1-4"): h_q, topk (SWA), block_size (SWA page), extra_topk, extra_block_size.
FLASHMLA_MODEL1_CONFIGS = {
    "config1": dict(h_q=64, topk=128, block_size=256, extra_topk=512, extra_block_size=64),
    "config2": dict(h_q=128, topk=128, block_size=256, extra_topk=1024, extra_block_size=64),
    "config3": dict(h_q=64, topk=128, block_size=256, extra_topk=1024, extra_block_size=2),
    "config4": dict(h_q=128, topk=128, block_size=256, extra_topk=1024, extra_block_size=2),
}


def flashmla_decode_inputs(config: str, seq_lens: list[int], seed: int = 0, scale: float = 512**-0.55) -> dict:
    """Inputs of one FlashMLA MODEL1 decode call (``flash_mla_with_kvcache``) at a production
    configuration, plus the oracle's canonical view.

    ``extra_block_size`` 64 is a C4A layer (``extra_topk`` = index top-k), 2 a C128A layer
    (``extra_topk`` = the C128A row width). Each request decodes one token at ``seq_len - 1``.
    Returns dict: ``q`` bf16 [b, 1, h, 512] (roped), ``k_cache`` uint8 [nb, bs, 1, 584],
    ``indices`` int32 [b, 1, topk], ``topk_length`` int32 [b], ``extra_k_cache``,
    ``extra_indices_in_kvcache`` [b, 1, extra_topk], ``extra_topk_length`` [b], ``attn_sink`` [h],
    ``softmax_scale``, ``segments`` (list[Segment]) and ``positions`` [b]."""
    fn = "flashmla_decode_inputs"
    if config not in FLASHMLA_MODEL1_CONFIGS:
        fail(fn, "config", f"must be one of {sorted(FLASHMLA_MODEL1_CONFIGS)}", config)
    c = FLASHMLA_MODEL1_CONFIGS[config]
    ratio = C4_RATIO if c["extra_block_size"] == 64 else C128_RATIO
    spec = LayerSpec(ratio=ratio, num_heads=c["h_q"], index_topk=c["extra_topk"], swa_block_size=c["block_size"],
                     comp_block_size=c["extra_block_size"], scale=scale,
                     c128a_width=c["extra_topk"] if ratio == C128_RATIO else None, window=c["topk"])
    layout = BatchLayout(tuple(seq_lens), tuple(1 for _ in seq_lens))
    weights = make_weights(spec, max(seq_lens), seed)
    st = init_layer_state(spec, list(seq_lens), seed)
    st = synthetic_history(spec, weights, st, [s - 1 for s in seq_lens], seed)
    g = torch.Generator().manual_seed(seed + 1)
    T = len(seq_lens)
    kv = realistic_rows(T, g)
    coff, _ = compressor_geometry(ratio)
    kv_score = torch.randn(T, 2 * coff * HEAD_DIM, generator=g)
    q = torch.randn(T, spec.num_heads, HEAD_DIM, generator=g).clamp(-1, 1).to(torch.bfloat16)
    st, res = layer_step(spec, weights, st, layout, q, kv, kv_score, form="decode", seed=seed)
    sw = res.indices
    return {
        "q": res.q_roped[:, None],
        "k_cache": kernel_view(st.swa_cache, spec.swa_block_size).unsqueeze(2),
        "indices": sw["swa_indices"][:, None],
        "topk_length": sw["swa_lens"],
        "extra_k_cache": kernel_view(st.comp_cache, spec.comp_bs).unsqueeze(2),
        "extra_indices_in_kvcache": sw["comp_indices"][:, None],
        "extra_topk_length": sw["comp_lens"],
        "attn_sink": weights.sink,
        "softmax_scale": scale,
        "segments": res.segments,
        "positions": res.positions,
        "oracle": res.oracle,
    }
