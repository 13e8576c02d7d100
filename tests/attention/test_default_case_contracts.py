"""Contracts of the default attention / compressor cases that the kernel adapters rely on:
stale valid ids past the lengths (vLLM#36616), the RoPE table for inverse-roping decode
consumers (attention 3.3), and the production compressor's paged input contract (datapath 5.1)."""

from __future__ import annotations

import functools

import pytest
import torch

from dsv4_numerics.oracles import matrix
from dsv4_numerics.oracles import stages as st
from dsv4_numerics.reference.cases import default_cases


@functools.lru_cache(maxsize=None)
def _cases(stage):
    return {c.name: c for c in default_cases(stage)}


def _stale_columns(idx, length):
    col = torch.arange(idx.shape[1])[None, :]
    return col >= length.to(torch.int64)[:, None]


def test_decode_stale_past_len_case():
    c = _cases("decode")["h64-c4a-stale-past-len"]
    inp = c.inputs
    for key, ln_key in (("swa_indices", "swa_lens"), ("extra_indices", "extra_lens")):
        idx, ln = inp[key], inp[ln_key]
        past = _stale_columns(idx, ln)
        assert bool(past.any()) and bool((idx[past] >= 0).all()), key  # stale ids are valid slots
        assert (ln == 0).sum() == 1 and len(set(ln.tolist())) >= 4, key  # one empty row, varied lengths
    # the stale ids point at written rows with ordinary (finite) values
    segs = st.decode_segments(c, {})
    for s in segs:
        past = _stale_columns(s.idx, s.length)
        rows = s.rows.index_select(0, s.idx[past].to(torch.int64))
        assert bool(torch.isfinite(rows).all())
    # validity = column < length: ignoring the lengths changes the output
    from dsv4_numerics.reference.attention.ordered import Segment, sparse_attention

    ref = sparse_attention(inp["q"], segs, inp["scale"], inp["sink"])
    bad = sparse_attention(inp["q"], [Segment(s.rows, s.idx, None, s.rule) for s in segs], inp["scale"], inp["sink"])
    assert ref.n_valid[3].item() == 0 and bool((ref.out[3] == 0).all())
    assert not torch.allclose(ref.out[0], bad.out[0])


def test_prefill_stale_past_len_case():
    c = _cases("prefill")["h64-c4a-stale-past-len"]
    idx, ln, kv = c.inputs["indices"], c.inputs["topk_length"], c.inputs["kv"]
    past = _stale_columns(idx, ln)
    assert bool(past.any()) and bool(((idx[past] >= 0) & (idx[past] < kv.shape[0])).all())
    assert bool(torch.isfinite(kv.index_select(0, idx[past].to(torch.int64))).all())
    assert (ln == 0).sum() == 1 and len(set(ln.tolist())) >= 4


@pytest.mark.parametrize("name", ["h128-c4a-top512-bs64-permuted", "h128-swa-bs256", "h64-c4a-stale-past-len"])
def test_decode_cases_carry_rope_table_for_inverse_roped_outputs(name):
    from dsv4_numerics.kernels.vllm import rocm_triton as RT
    from dsv4_numerics.reference.attention.epilogue import inverse_rope_output

    c = _cases("decode")[name]
    cs, pos = c.inputs["cos_sin"], c.inputs["positions"]
    assert cs.dtype == torch.float32 and cs.shape[1] == 64 and cs.shape[0] == int(pos.max()) + 1
    a = RT.decode_args(c, ragged=False, inv_rope=True)
    assert torch.equal(a["inv_rope_cos_sin_cache"], cs) and torch.equal(a["inv_rope_positions"], pos)
    if name != "h128-c4a-top512-bs64-permuted":
        return  # the expectation check below costs a full oracle run: once is enough
    spec = st.get("decode")
    plain = spec.expected(c, spec.policies({}))
    rot = spec.expected(c, spec.policies({"output_inv_roped": "true"}))
    want = inverse_rope_output(plain["out"].to(torch.float32), pos, cs).to(torch.float64)
    assert torch.equal(rot["out"], want)
    assert not torch.equal(rot["out"][..., 448:], plain["out"][..., 448:])
    assert torch.equal(rot["out"][..., :448], plain["out"].to(torch.float32).to(torch.float64)[..., :448])


def test_rope_quant_contract_swa_len_matches_position():
    # FlashInfer RopeQuant derives the position from seq_lens: swa_len = min(position + 1, 128), H = 128
    for name in ("h128-c4a-top512-bs64-permuted", "h128-swa-bs256"):
        inp = _cases("decode")[name].inputs
        assert inp["q"].shape[1] == 128
        assert torch.equal(inp["swa_lens"].to(torch.int64), torch.clamp(inp["positions"] + 1, max=128))


def test_compressor_cases_carry_the_production_contract():
    from dsv4_numerics.kernels.vllm.triton import compressor_args
    from dsv4_numerics.reference.pipeline.compressor import state_windows

    for c in _cases("compressor").values():
        inp = c.inputs
        a = compressor_args(inp)
        assert a["compress_ratio"] == inp["ratio"] and a["overlap"] == (inp["ratio"] == 4)
        # the paged state holds the dense state rows of every position the windows read
        sbs, bt = inp["block_size"], inp["block_table"][0].to(torch.int64)
        u = torch.arange(inp["state"].shape[0])
        assert torch.equal(inp["state_cache"][bt[u // sbs], u % sbs], inp["state"])
        _, _, valid = state_windows(inp["state"], inp["positions"], inp["ratio"])
        assert bool(valid.any())
        assert torch.equal(a["slot_mapping"], bt[inp["positions"] // sbs] * sbs + inp["positions"] % sbs)
        assert bool((inp["compressed_slot_mapping"] >= 0).all())
        assert inp["compressed_slot_mapping"].unique().numel() == inp["positions"].numel()


def test_triton_compressor_adapter_on_default_cases_with_reference_fake(monkeypatch):
    """The Triton entry (its real adapter, a reference fake kernel) passes every default case
    through the matrix runner; a corrupted record or a stray byte fails the compressor tier."""
    from dsv4_numerics.kernels import registry
    from tests.kernels.test_adapters_vllm import fake_compressor

    fake_compressor(monkeypatch)
    import dataclasses

    entry = dataclasses.replace(registry.get("vllm_triton.compress_norm_rope_store"), probe=lambda: None)
    cases = list(_cases("compressor").values())
    res = matrix.run_entry(entry, cases=cases)
    assert [r.verdict for r in res] == ["pass"] * len(cases), [r.line() for r in res]
    assert all(r.rule == "cache:bit_exact" for r in res)

    spec = st.get("compressor")
    c = cases[0]
    pol = spec.policies(entry.policies)
    want = spec.expected(c, pol)
    scope = st.JudgeScope(entry.tolerance_scope, policies=pol)
    got = entry.call(c)["cache"]
    bs = c.inputs["kv_block_size"]
    slot = int(want["_slots"][0])
    page, ent = divmod(slot, bs)
    stride = got.stride(0)
    flat = got.view(-1)
    g1 = got.clone()
    g1.view(-1)[page * stride + ent * 576 + 449] ^= 0x80  # sign of RoPE lane 0 (high byte)
    v = spec.judge(c, want, {"cache": g1}, scope)
    assert not v.passed and v.rule == "cache:rope_tier", v
    g2 = got.clone()
    scale_at = page * stride + bs * 576 + ent * 8
    g2.view(-1)[scale_at] = int(flat[scale_at]) + 2
    v = spec.judge(c, want, {"cache": g2}, scope)
    assert not v.passed and v.rule == "cache:scale_bytes", v
    free = [s for s in range(got.shape[0] * bs) if s not in want["_slots"].tolist()][0]
    g3 = got.clone()
    p3, e3 = divmod(free, bs)
    g3.view(-1)[p3 * stride + e3 * 576] ^= 1
    v = spec.judge(c, want, {"cache": g3}, scope)
    assert not v.passed and v.rule == "cache:clobber", v


def test_compressor_tier_is_the_fuzz_tests_tier(monkeypatch):
    """oracles.compressor_tier is test_fuzz_writers' model and the fuzz test judges with it,
    not with a copy: its bound ``A`` is ``compressor_error_bound``'s rows and its assertion is
    ``judge_compressed_records``' verdict."""
    import tests.kernels.test_fuzz_writers as fw
    from dsv4_numerics.oracles import compressor_tier as ct
    from dsv4_numerics.oracles.compressor_tier import compressor_error_bound
    from dsv4_numerics.reference.pipeline.compressor import compressor_boundary
    from tests.kernels.test_fuzz_writers import C4_PROD, compressor_expected

    assert fw.compressor_error_bound is ct.compressor_error_bound
    assert fw.judge_compressed_records is ct.judge_compressed_records
    calls = []

    def recorded(*args, **kwargs):
        calls.append(ct.compressor_error_bound(*args, **kwargs))
        return calls[-1]

    with monkeypatch.context() as m:
        m.setattr(fw, "compressor_error_bound", recorded)
        want, slots, A = compressor_expected(C4_PROD)
    assert calls and torch.equal(torch.cat(calls), A)
    init = C4_PROD.case().inputs["cache"]
    rep = ct.judge_compressed_records(want, want, init, slots, C4_PROD.kv_block_size, A)
    assert rep.passed and fw.assert_compressor_within_tier(want, want, init, slots, C4_PROD.kv_block_size, A) == \
        rep.details["bit_identical_records"] == slots.numel()
    with monkeypatch.context() as m:
        m.setattr(fw, "judge_compressed_records", lambda *a: ct.TierReport(False, "cache:sentinel", "judge says no"))
        with pytest.raises(AssertionError, match="cache:sentinel: judge says no"):
            fw.assert_compressor_within_tier(want, want, init, slots, C4_PROD.kv_block_size, A)

    # and the bound is the model recomputed independently from the reference's boundary rows
    inp, dense = C4_PROD.build()
    pos, req = inp["positions"], inp["token_to_req_indices"].long()
    fires = (inp["slot_mapping"] >= 0) & ((pos + 1) % 4 == 0) & (inp["compressed_slot_mapping"] >= 0)
    parts = []
    for r in range(len(C4_PROD.seq_lens)):
        sel = fires & (req == r)
        if bool(sel.any()):
            b = compressor_boundary(dense[r], pos[sel], 4, inp["rms_norm_weight"], 1e-6, inp["cos_sin_cache"])
            parts.append(compressor_error_bound(dense[r], pos[sel], 4, inp["rms_norm_weight"], 1e-6, b.normed))
    assert torch.equal(torch.cat(parts), A)
