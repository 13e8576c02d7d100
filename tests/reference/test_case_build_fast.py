"""The fast case-building paths give the bytes of the plain per-request loops.

``layer.synthetic_history`` and ``layer.write_tokens`` write all requests with one ``insert`` per
cache (and, with ``donate=True``, in place); ``attend(build_segments=False)`` skips dequantising
the caches. Each is compared bit for bit with the obviously-correct form kept here: one
``insert`` / ``compress_and_insert`` per request on a fresh copy of the cache, and ``attend``
with its segments. Shapes cover SWA / C4A / C128A, empty prefixes, several requests sharing
pages of 2 and 64 entries, and prefixes that start mid-window.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from dsv4_numerics.reference.pipeline import layer as L
from dsv4_numerics.reference.caches.model1 import insert
from dsv4_numerics.reference.pipeline.compressor import build_state, compress_and_insert, compressor_geometry
from dsv4_numerics.reference.constants import HEAD_DIM
from dsv4_numerics.reference.indices.slots import local_to_global_slots

SHAPES = [  # (ratio, heads, seq_lens, query_lens, comp_block_size, seed)
    (1, 16, [1, 200, 129, 300], [1, 1, 1, 1], None, 3),
    (4, 16, [4, 3, 2051, 900, 1], [1, 1, 1, 1, 1], None, 7),
    (4, 16, [300, 1200, 17], [3, 20, 17], None, 8),
    (128, 16, [1000, 260, 129, 2100], [1, 1, 1, 1], 2, 5),
    (128, 16, [1000, 260, 129], [2, 3, 1], 64, 10),
]


def _slow_history(spec, weights, state, prefix_lens, seed):
    """``synthetic_history`` as one insert per request (the generator draws in the same order)."""
    g = torch.Generator().manual_seed(seed)
    swa, comp = state.swa_cache, state.comp_cache
    rows_l, valid_l = list(state.state_rows), list(state.state_valid)
    for r, n_prefix in enumerate(prefix_lens):
        if n_prefix == 0:
            continue
        p = torch.arange(max(0, n_prefix - spec.window), n_prefix)
        kv = L.realistic_rows(p.numel(), g)
        slots = local_to_global_slots(p, torch.full_like(p, r), state.swa_block_table, spec.swa_block_size)
        swa = insert(swa, L.kv_rows_roped(spec, weights, kv, p), slots, spec.swa_block_size, spec.swa_rule)
        if not spec.compressed:
            continue
        n = n_prefix // spec.ratio
        if n:
            j = torch.arange(n)
            cslots = local_to_global_slots(j, torch.full_like(j, r), state.comp_block_table, spec.comp_bs)
            comp = insert(comp, L.realistic_rows(n, g), cslots, spec.comp_bs, spec.comp_rule)
        coff, W = compressor_geometry(spec.ratio)
        sp = torch.arange(max(0, n_prefix - W), n_prefix)
        rr, vv = rows_l[r].clone(), valid_l[r].clone()
        rr[sp] = torch.randn(sp.numel(), 2 * coff * HEAD_DIM, generator=g)
        vv[sp] = True
        rows_l[r], valid_l[r] = rr, vv
    return replace(state, swa_cache=swa, comp_cache=comp, state_rows=tuple(rows_l), state_valid=tuple(valid_l))


def _slow_comp_cache(spec, weights, state, layout, kv_score):
    """The compressed cache after the step's tokens, by ``compress_and_insert`` per request."""
    coff, _ = compressor_geometry(spec.ratio)
    w = coff * HEAD_DIM
    pos, comp = layout.positions(), state.comp_cache
    qsl = layout.query_start_loc().tolist()
    for r in range(len(layout.seq_lens)):
        t0, t1 = qsl[r], qsl[r + 1]
        p = pos[t0:t1]
        rows = state.state_rows[r].clone()
        rows[p] = build_state(kv_score[t0:t1, :w].contiguous(), kv_score[t0:t1, w:].contiguous(), p, weights.ape,
                              spec.ratio)
        bpos = p[(p + 1) % spec.ratio == 0]
        if bpos.numel():
            j = bpos // spec.ratio
            cslots = local_to_global_slots(j, torch.full_like(j, r), state.comp_block_table, spec.comp_bs)
            comp, _ = compress_and_insert(comp, spec.comp_bs, rows, bpos, cslots, spec.ratio, weights.norm_weight,
                                          spec.norm_eps, weights.cos_sin, spec.comp_rule, spec.comp_rope)
    return comp


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride() and bool(
        torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))


def _states_equal(a, b) -> None:
    assert _same(a.swa_cache, b.swa_cache)
    assert (a.comp_cache is None) == (b.comp_cache is None)
    if a.comp_cache is not None:
        assert _same(a.comp_cache, b.comp_cache)
    assert len(a.state_rows) == len(b.state_rows)
    for x, y in zip(a.state_rows + a.state_valid, b.state_rows + b.state_valid):
        assert _same(x, y)


@pytest.mark.parametrize("ratio,heads,seq,ql,cbs,seed", SHAPES)
def test_fast_history_write_and_indices_are_bit_identical(ratio, heads, seq, ql, cbs, seed):
    spec = L.LayerSpec(ratio=ratio, num_heads=heads, index_topk=512, comp_block_size=cbs)
    layout = L.BatchLayout(tuple(seq), tuple(ql))
    weights = L.make_weights(spec, max(seq) + 1, seed)
    prefix = [s - q for s, q in zip(seq, ql)]
    fresh = lambda: L.init_layer_state(spec, seq, seed, poison=True)  # noqa: E731
    slow = _slow_history(spec, weights, fresh(), prefix, seed)
    batched = L.synthetic_history(spec, weights, fresh(), prefix, seed)
    start = fresh()
    before = start.swa_cache.clone()
    donated = L.synthetic_history(spec, weights, start, prefix, seed, donate=True)
    _states_equal(slow, batched)
    _states_equal(slow, donated)
    if any(prefix):
        assert not torch.equal(start.swa_cache, before)  # donate did write in place (not vacuous)

    g = torch.Generator().manual_seed(seed + 7)
    T = layout.num_tokens
    kv = torch.randn(T, HEAD_DIM, generator=g).mul(0.3).to(torch.bfloat16)
    coff = 2 if ratio == 4 else 1
    ks = torch.randn(T, 2 * coff * HEAD_DIM, generator=g) if ratio > 1 else None
    kept = L.write_tokens(spec, weights, slow, layout, kv, ks)[0]
    _states_equal(slow, batched)  # donate=False left its input alone
    donated_w = L.write_tokens(spec, weights, batched, layout, kv, ks, donate=True)[0]
    _states_equal(kept, donated_w)
    if spec.compressed:
        assert _same(kept.comp_cache, _slow_comp_cache(spec, weights, slow, layout, ks))

    q = torch.randn(T, heads, HEAD_DIM, generator=g).clamp(-1, 1).to(torch.bfloat16)
    for form in ("decode", "prefill"):
        full = L.attend(spec, weights, kept, layout, q, form=form, seed=seed, run_oracle=False)
        lean = L.attend(spec, weights, kept, layout, q, form=form, seed=seed, run_oracle=False,
                        build_segments=False)
        assert _same(full.q_roped, lean.q_roped) and _same(full.positions, lean.positions)
        assert full.indices.keys() == lean.indices.keys()
        for k, v in full.indices.items():
            assert _same(v, lean.indices[k]) if isinstance(v, torch.Tensor) else v == lean.indices[k]
        assert len(lean.segments) == (0 if form == "decode" else 1)


def test_build_segments_false_needs_run_oracle_false():
    from dsv4_numerics.reference.errors import InputError

    spec = L.LayerSpec(ratio=1, num_heads=8)
    layout = L.BatchLayout((3,), (1,))
    st = L.init_layer_state(spec, [3])
    q = torch.zeros(1, 8, HEAD_DIM, dtype=torch.bfloat16)
    with pytest.raises(InputError, match="build_segments"):
        L.attend(spec, L.make_weights(spec, 4), st, layout, q, build_segments=False)
