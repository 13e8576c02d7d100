"""Layer step composition: writers + index builders + oracle + epilogue, per layer type."""

from __future__ import annotations

import functools

import pytest
import torch

from dsv4_numerics.reference.attention.ordered import Segment, sparse_attention
from dsv4_numerics.reference.caches.model1 import decode_records, encode_records
from dsv4_numerics.reference.attention.epilogue import inv_rope_fp8_quant
from dsv4_numerics.reference.errors import InputError
from dsv4_numerics.reference.pipeline.layer import (
    BatchLayout,
    LayerSpec,
    attend,
    flashmla_decode_inputs,
    init_layer_state,
    layer_step,
    make_weights,
    synthetic_topk,
    write_tokens,
)
from dsv4_numerics.reference.policies import ScaleRule
from dsv4_numerics.reference.pipeline.rope import apply_rope


@functools.lru_cache(maxsize=None)
def _run(ratio, seed=0, hist=(150, 40), step=(3, 1), heads=8):
    """Write a history, then one layer step (decode form); cached: tests only read the result."""
    spec = LayerSpec(ratio=ratio, num_heads=heads, index_topk=16, swa_block_size=64, window=128)
    w = make_weights(spec, 512, seed)
    cap = [h + s for h, s in zip(hist, step)]
    st = init_layer_state(spec, cap, seed)
    g = torch.Generator().manual_seed(seed)
    coff = 2 if ratio == 4 else 1
    lay_h = BatchLayout(tuple(hist), tuple(hist))
    T = lay_h.num_tokens
    kvh = torch.randn(T, 512, generator=g).mul(0.5).to(torch.bfloat16)
    ksh = torch.randn(T, 2 * coff * 512, generator=g) if ratio > 1 else None
    st, _ = write_tokens(spec, w, st, lay_h, kvh, ksh)
    lay = BatchLayout(tuple(cap), tuple(step))
    T = lay.num_tokens
    q = torch.randn(T, heads, 512, generator=g).to(torch.bfloat16)
    kv = torch.randn(T, 512, generator=g).mul(0.5).to(torch.bfloat16)
    ks = torch.randn(T, 2 * coff * 512, generator=g) if ratio > 1 else None
    st2, res = layer_step(spec, w, st, lay, q, kv, ks, form="decode", seed=seed)
    return spec, w, st2, lay, q, kvh, kv, res


@pytest.mark.parametrize("ratio", [1, 4, 128])
def test_decode_and_prefill_forms_agree(ratio):
    # Same keys (exact dequantised rows), different index spaces and segment order (decode:
    # SWA then compressed on the paged caches; prefill: compressed then window on the workspace)
    # -> the same softmax; only fp64 summation order differs.
    spec, w, st, lay, q, _, _, dec = _run(ratio)
    pre = attend(spec, w, st, lay, q, form="prefill", seed=0)
    assert torch.equal(dec.oracle.n_valid, pre.oracle.n_valid)
    assert torch.equal(dec.oracle.max_logits, pre.oracle.max_logits)
    assert torch.allclose(dec.oracle.out, pre.oracle.out, rtol=1e-12, atol=1e-14)
    assert torch.allclose(dec.oracle.lse, pre.oracle.lse, rtol=1e-13, atol=1e-14)


def test_visible_counts_per_layer_type():
    # tokens at positions 150, 151, 152 (request 0, query 3) and 40 (request 1):
    # SWA: min(p+1, 128) = 128, 128, 128, 41. C128A: (p+1)//128 = 1, 1, 1, 0.
    # C4A: min((p+1)//4, 16) = 16, 16, 16, 10.
    assert _run(1)[-1].oracle.n_valid.tolist() == [128, 128, 128, 41]
    assert _run(128)[-1].oracle.n_valid.tolist() == [129, 129, 129, 41]
    assert _run(4)[-1].oracle.n_valid.tolist() == [144, 144, 144, 51]


def test_swa_rows_are_the_writer_output_of_the_window():
    # For SWA-only layer, the rows the oracle reads for token t are exactly
    # decode(encode_Q_A(bf16(RoPE_FMA(kv_u, u)))) for u = max(p-127, 0) .. p, in ascending order.
    spec, w, st, lay, q, kvh, kv, res = _run(1)
    seg = res.segments[0]
    for t, lo in ((3, 0), (2, 152 - 127)):  # request 1 at position 40; request 0 at 152
        p = int(res.positions[t])
        hist = kvh[150:190] if t == 3 else kvh[:150]
        step = kv[3:4] if t == 3 else kv[0:3]
        rows_u = torch.cat([hist, step])[lo: p + 1]
        pos_u = torch.arange(lo, p + 1)
        roped = apply_rope(rows_u, pos_u, w.cos_sin).to(torch.bfloat16)
        want = decode_records(*encode_records(roped, ScaleRule.AMAX_CLAMP))
        got = seg.rows[seg.idx[t, : int(seg.length[t])].long()]
        assert torch.equal(got, want)


def test_boundary_token_sees_its_own_compressed_entry():
    # C4A, history 15 tokens (positions 0..14), step token p = 15: (15+1) % 4 == 0, so entry
    # j = 3 is written in this step and is visible to the token itself: (15+1)//4 = 4 entries,
    # n_valid = 16 SWA + 4. Request 1: history 10, step p = 10: 11 SWA + 11//4 = 2 entries.
    spec, w, st, lay, q, _, _, res = _run(4, hist=(15, 10), step=(1, 1))
    assert res.oracle.n_valid.tolist() == [16 + 4, 11 + 2]
    assert len(res.write_info["comp_positions"]) == 1 and res.write_info["comp_positions"][0].tolist() == [15]


def test_oracle_matches_direct_call_and_epilogue_composition():
    spec, w, st, lay, q, _, _, res = _run(4)
    direct = sparse_attention(res.q_roped, res.segments, spec.scale, w.sink)
    assert torch.equal(direct.out, res.oracle.out)
    assert torch.equal(res.out_bf16, res.oracle.out.float().to(torch.bfloat16))
    epi = inv_rope_fp8_quant(res.out_bf16, res.positions, w.cos_sin, spec.heads_per_group)
    assert torch.equal(epi.codes, res.epilogue.codes) and torch.equal(epi.exponents, res.epilogue.exponents)
    # sinks: head 1 is +inf -> exactly zero output; head 2 is -inf -> no effect
    assert bool((res.oracle.out[:, 1] == 0).all())
    nosink = sparse_attention(res.q_roped, res.segments, spec.scale, None)
    assert torch.equal(nosink.out[:, 2], res.oracle.out[:, 2])


def test_synthetic_topk_is_a_prefix_of_distinct_visible_entries():
    pos = torch.tensor([0, 3, 10, 4000])
    tk = synthetic_topk(pos, 16, 4, seed=1)
    for t, p in enumerate(pos.tolist()):
        vis = (p + 1) // 4
        n = min(vis, 16)
        row = tk[t].tolist()
        assert all(v == -1 for v in row[n:]) and len(set(row[:n])) == n
        assert all(0 <= v < vis for v in row[:n])


def test_flashmla_decode_inputs_config1_shapes():
    d = flashmla_decode_inputs("config1", [300, 129], seed=3)
    assert d["q"].shape == (2, 1, 64, 512) and d["k_cache"].shape[1:] == (256, 1, 584)
    assert d["indices"].shape == (2, 1, 128) and d["extra_indices_in_kvcache"].shape == (2, 1, 512)
    assert d["topk_length"].tolist() == [128, 128]
    assert d["extra_topk_length"].tolist() == [300 // 4, 129 // 4]
    assert d["extra_k_cache"].shape[1:] == (64, 1, 584)
    assert isinstance(d["segments"][0], Segment)


def test_layer_validation():
    with pytest.raises(InputError, match="LayerSpec.*'ratio'"):
        LayerSpec(ratio=2, num_heads=8)
    with pytest.raises(InputError, match="BatchLayout.*'query_lens'"):
        BatchLayout((3,), (4,))
    spec = LayerSpec(ratio=4, num_heads=8)
    w = make_weights(spec, 64)
    st = init_layer_state(spec, [16])
    lay = BatchLayout((8,), (1,))  # position 7 is a boundary whose window rows 0..6 were never written
    with pytest.raises(InputError, match="write_tokens.*'state'.*never written"):
        write_tokens(spec, w, st, lay, torch.zeros(1, 512, dtype=torch.bfloat16), torch.zeros(1, 2048))
    with pytest.raises(InputError, match="attend.*'form'"):
        attend(spec, w, st, lay, torch.zeros(1, 8, 512, dtype=torch.bfloat16), form="x")


# --------------------------------------------------------------------------- default cases
def _decode_segments(inp):
    from dsv4_numerics.reference.caches.model1 import dequantize_all

    segs = [Segment(dequantize_all(inp["swa_cache"], inp["swa_block_size"]), inp["swa_indices"], inp["swa_lens"],
                    "minus1_only")]
    if "extra_cache" in inp:
        segs.append(Segment(dequantize_all(inp["extra_cache"], inp["extra_block_size"]), inp["extra_indices"],
                            inp["extra_lens"], "minus1_only"))
    return segs


def test_attention_cases_are_deterministic_json_and_clean():
    import json

    from dsv4_numerics.reference.cases import default_cases

    for stage in ("prefill", "rope", "inv_rope_fp8", "compressor"):  # decode: same builders, skipped for time
        a, b = default_cases(stage), default_cases(stage)
        assert a and [c.name for c in a] == [c.name for c in b]
        for ca, cb in zip(a, b):
            json.dumps(ca.params)
            for k, v in ca.inputs.items():
                if isinstance(v, torch.Tensor):
                    assert torch.equal(v.nan_to_num(), cb.inputs[k].nan_to_num()), (ca.name, k)
    # the layer simulation's cases (the sweep cases: tests/attention/test_sweep_cases.py)
    for c in [c for c in default_cases("decode") if c.params["layer"] != "sweep"]:
        inp = c.inputs
        segs = _decode_segments(inp)
        # every unreferenced slot is NaN-poisoned, yet the oracle output is finite
        assert bool(torch.isnan(segs[0].rows).any())
        r = sparse_attention(inp["q"], segs, inp["scale"], inp["sink"])
        assert bool(torch.isfinite(r.out).all()), c.name
        assert bool((r.out[:, 1] == 0).all())  # sink +inf head
        if c.name == "h64-c4a-lonely-and-empty-extra":
            assert r.n_valid[1].item() == 0 and bool((r.out[1] == 0).all())
            assert r.n_valid[2].item() == int(inp["swa_lens"][2])
    for c in [c for c in default_cases("prefill") if c.params["layer"] != "sweep"]:
        inp = c.inputs
        assert inp["indices"].shape[1] % 128 == 0
        seg = Segment(inp["kv"], inp["indices"], inp["topk_length"], c.params["index_rule"])
        r = sparse_attention(inp["q"], [seg], inp["scale"], inp["sink"])
        assert bool(torch.isfinite(r.out).all()), c.name
        if c.params["index_rule"] == "any_out_of_range_invalid":
            with pytest.raises(InputError, match="MINUS1_ONLY"):
                sparse_attention(inp["q"], [Segment(inp["kv"], inp["indices"], inp["topk_length"], "minus1_only")],
                                 inp["scale"], inp["sink"])
