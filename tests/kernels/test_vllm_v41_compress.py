"""The ``vllm_v41.fused_save_compress_norm.*`` adapters, on CPU through stand-in production
modules that write in place with the reference (the plumbing: argument forms, in-place ring and
cache copies, which record each entry takes). On a GPU the real Triton ops run instead."""

from __future__ import annotations

import dataclasses
import sys
import types

import pytest
import torch

from dsv4_numerics.kernels.vllm import v41 as V
from dsv4_numerics.oracles import matrix
from dsv4_numerics.reference.caches import model1 as cache_model1
from dsv4_numerics.reference.cases import default_cases
from dsv4_numerics.reference.pipeline import compressor_v41 as cv41

_ENTRIES = [e for e in V.ENTRIES if e.stage == "v41_compress_insert"]


def _fake_compress() -> types.ModuleType:
    m = types.ModuleType(V.V41_COMPRESS)

    def fused_save_compress_norm(kv_score, positions, state_cache, slot_mapping, query_start_loc,
                                 token_to_req_indices, rms_norm_weight, rms_norm_eps, compress_ratio, latent_out,
                                 prev_rows=None, prev_row_indices=None):
        assert kv_score.dtype == torch.float32 and latent_out.dtype == torch.bfloat16 and prev_rows is None
        assert positions.dtype == slot_mapping.dtype == torch.int64
        res = cv41.v41_save_compress(kv_score, positions, state_cache, slot_mapping, query_start_loc,
                                     token_to_req_indices, rms_norm_weight, rms_norm_eps, compress_ratio)
        latent_out[res.tokens] = res.latent
        if res.state is not None:
            state_cache.copy_(res.state)

    def rope_quant_insert(latent, positions, cos_sin_cache, kv_cache, slot_mapping, compress_ratio, fp8_scale=None):
        if kv_cache.dtype == torch.uint8:
            rec = {528: "mxfp8_528", 288: "nvfp4_288", 584: "model1_584"}[kv_cache.shape[-1]]
        else:
            rec = "plain_bf16" if kv_cache.dtype == torch.bfloat16 else "plain_fp8"
        cache = kv_cache.view(torch.uint8) if rec == "plain_fp8" else kv_cache
        if rec == "model1_584":  # the reference takes the page form
            cache = torch.as_strided(kv_cache, (kv_cache.shape[0], kv_cache.stride(0)), (kv_cache.stride(0), 1))
        new = cv41.v41_rope_quant_insert(cache, latent, positions, cos_sin_cache, slot_mapping, compress_ratio, rec,
                                         kv_cache.shape[1], None if fp8_scale is None else float(fp8_scale))
        cache.copy_(new)

    m.fused_save_compress_norm = fused_save_compress_norm
    m.rope_quant_insert = rope_quant_insert
    return m


def test_one_entry_per_record_and_the_nvfp4_one_needs_blackwell():
    assert sorted(e.name.rsplit(".", 1)[1] for e in _ENTRIES) == ["fp8_584", "mxfp8", "nvfp4", "plain"]
    assert next(e for e in _ENTRIES if e.name.endswith("nvfp4")).archs == V.NVFP4_WRITER_ARCHS
    assert all(e.policies["rope_arith"] == "fma_triton" and e.policies["scale_rule"] == "amax_clamp"
               for e in _ENTRIES)


@pytest.mark.parametrize("name", [e.name for e in _ENTRIES])
def test_call_paths_through_stand_in_modules(name, monkeypatch):
    monkeypatch.setitem(sys.modules, V.V41_COMPRESS, _fake_compress())
    entry = dataclasses.replace(next(e for e in _ENTRIES if e.name == name), probe=lambda: None)
    cases = default_cases("v41_compress_insert")
    before = {c.name: (c.inputs["cache"].clone(), None if c.inputs["state_cache"] is None
                       else c.inputs["state_cache"].clone()) for c in cases}
    results = matrix.run_entry(entry, cases=cases)
    verdicts = [r.verdict for r in results]
    assert "fail" not in verdicts and "error" not in verdicts, results
    assert "pass" in verdicts
    for r in results:
        if r.verdict == "skip":
            assert "records; this entry writes" in r.message, r.message
    for c in cases:  # in-place kernels wrote copies
        assert torch.equal(c.inputs["cache"], before[c.name][0])
        if before[c.name][1] is not None:
            assert torch.equal(c.inputs["state_cache"], before[c.name][1])


def test_584_view_is_the_model1_kernel_view():
    case = next(c for c in default_cases("v41_compress_insert") if c.inputs["record"] == "model1_584")
    a = V.compress_insert_args("t", case.inputs)
    view = a["insert"]["kv_cache"]
    assert view.shape == cache_model1.kernel_view(case.inputs["cache"], case.inputs["block_size"]).shape
    assert a["save"]["state_cache"] is None and a["save"]["query_start_loc"] is None


# --------------------------------------------------------------------------- indexer K store

def _fake_indexer() -> types.ModuleType:
    from dsv4_numerics.reference.caches.indexer_v41 import insert_indexer_k

    m = types.ModuleType(V.V41_INDEXER)

    def indexer_k_norm_rope_store(k_pre, positions, cos_sin_cache, rms_norm_weight, rms_norm_eps, k_cache,
                                  kv_slot_mapping, compress_ratio, use_fp4_cache):
        assert k_pre.dtype == torch.bfloat16 and k_cache.dtype == torch.uint8 and k_cache.dim() == 3
        rec = "mxfp4" if use_fp4_cache else "fp8"
        k_cache.copy_(insert_indexer_k(k_cache, k_pre, positions, cos_sin_cache, rms_norm_weight, rms_norm_eps,
                                       kv_slot_mapping, compress_ratio, rec))

    m.indexer_k_norm_rope_store = indexer_k_norm_rope_store
    return m


@pytest.mark.parametrize("name", ["vllm_v41.indexer_k_norm_rope_store.fp8", "vllm_v41.indexer_k_norm_rope_store.mxfp4"])
def test_indexer_call_paths_through_a_stand_in(name, monkeypatch):
    monkeypatch.setitem(sys.modules, V.V41_INDEXER, _fake_indexer())
    entry = dataclasses.replace(next(e for e in V.ENTRIES if e.name == name), probe=lambda: None)
    cases = default_cases("v41_indexer_k_store")
    before = [c.inputs["cache"].clone() for c in cases]
    results = matrix.run_entry(entry, cases=cases)
    assert [r.verdict for r in results].count("pass") == 2 and [r.verdict for r in results].count("skip") == 2, results
    assert all(torch.equal(c.inputs["cache"], b) for c, b in zip(cases, before))


def test_fp8_indexer_is_unavailable_where_mx_scales_are_on(monkeypatch):
    dg = types.ModuleType("vllm.utils.deep_gemm")
    dg.mqa_logits_use_mx_scales = lambda: True
    monkeypatch.setitem(sys.modules, "vllm.utils.deep_gemm", dg)
    reason = V.no_mx_scales()
    assert reason and "ue8m0_x4" in reason
    dg.mqa_logits_use_mx_scales = lambda: False
    assert V.no_mx_scales() is None
