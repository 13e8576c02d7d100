"""MLA-family kernel entries (kernels/flashmla/mla_family.py, flashinfer/mla_dense.py, tokenspeed/mla.py) on CPU: declarations, probes, pure conversion
helpers, and the whole judge chain (oracles.matrix + oracles.stages) on the MLA cases with a
reference positive control and mutants that must be caught."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from dsv4_numerics.kernels import convert
from dsv4_numerics.kernels.flashinfer import mla_dense
from dsv4_numerics.kernels.flashmla import mla_family as mf
from dsv4_numerics.kernels.tokenspeed import mla as tokenspeed_mla
from dsv4_numerics.kernels import registry
from dsv4_numerics.oracles import stages as st
from dsv4_numerics.oracles.matrix import run_entry
from dsv4_numerics.oracles.stages.mla import mla_tolerance_records, v32_policy_fit
from dsv4_numerics.oracles.tolerances import Tolerances
from dsv4_numerics.reference.caches.v32 import v32_page_view
from dsv4_numerics.reference.cases import default_cases
from dsv4_numerics.reference.errors import InputError, UnsupportedCase
from dsv4_numerics.reference.policies import AttentionMode

# the MLA family's entries: FlashMLA's, then FlashInfer's and TokenSpeed's (registry order)
MLA_FAMILY = mf.ENTRIES + mla_dense.ENTRIES + tokenspeed_mla.ENTRIES

MLA_ENTRIES = {
    "flashmla.v32_sparse_decode.sm90", "flashmla.v32_sparse_decode.sm100", "flashmla.dense_decode.sm90",
    "flashmla.dense_decode_fp8.sm90", "flashinfer.mla_decode.trtllm_gen", "flashinfer.mla_decode.cute_dsl",
    "tokenspeed_mla.decode", "tokenspeed_mla.prefill",
}


@pytest.fixture(scope="module")
def cases():
    return {s: default_cases(s) for s in ("v32_decode", "dense_mla_decode", "dense_mla_prefill")}


# --------------------------------------------------------------------------- declarations and probes


def test_entries_registered_and_valid():
    names = {e.name for e in registry.all_entries()}
    assert MLA_ENTRIES <= names
    for e in MLA_FAMILY:
        assert registry.validate_entry(e) == []
        assert e.stage in ("v32_decode", "dense_mla_decode", "dense_mla_prefill")


def test_probes_name_every_missing_piece_without_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("checks the no-GPU reasons")
    for e in MLA_FAMILY:
        ok, why = e.available()
        assert not ok
        want = "needs sm90" if e.archs == ("sm90",) else "needs sm100/sm103"
        assert want in why, why
    fi = registry.get("flashinfer.mla_decode.trtllm_gen").available()[1]
    ts = registry.get("tokenspeed_mla.decode").available()[1]
    import importlib.util

    if importlib.util.find_spec("flashinfer") is None:
        assert "flashinfer-python not installed" in fi
    if importlib.util.find_spec("tokenspeed_mla") is None:
        assert "tokenspeed-mla not installed" in ts


def test_sm100_v32_entry_declares_the_rz_policy():
    assert registry.get("flashmla.v32_sparse_decode.sm100").policies["v32_scale_decode"] == "sm100_rz_e8m0"
    assert registry.get("flashmla.v32_sparse_decode.sm90").policies["v32_scale_decode"] == "bf16_rne"


# --------------------------------------------------------------------------- pure conversions


def test_flashmla_lse_to_canonical():
    # FlashMLA returns [b, h, s_q] with +inf for a lonely query -> canonical [b, s_q, h], -inf
    lse = torch.tensor([[[1.0, math.inf], [2.0, 3.0]]])  # b=1, h=2, s_q=2
    out = mf.flashmla_lse_to_canonical(lse)
    assert out.tolist() == [[[1.0, 2.0], [-math.inf, 3.0]]]


def test_base2_lse_to_natural():
    # log2-sum-exp2 of logits*log2e = lse / ln 2: 1.0 (base 2) = ln 2 (natural)
    out = convert.base2_lse_to_natural(torch.tensor([1.0, 0.0, -math.inf, 2.0]))
    assert out[0].item() == pytest.approx(math.log(2.0), rel=1e-7)
    assert out[1].item() == 0.0 and out[2].item() == -math.inf
    assert out[3].item() == pytest.approx(2 * math.log(2.0), rel=1e-7)


def test_pad_block_table():
    bt = torch.tensor([[4, 2, 7], [1, 0, 3]], dtype=torch.int64)
    out = convert.pad_block_table(bt, 4, fill=torch.tensor([[4], [1]]))
    assert out.dtype == torch.int32 and out.is_contiguous()
    assert out.tolist() == [[4, 2, 7, 4], [1, 0, 3, 1]]
    assert convert.pad_block_table(bt, 3).tolist() == bt.tolist()  # already a multiple
    assert convert.pad_block_table(bt, 2, fill=9).tolist() == [[4, 2, 7, 9], [1, 0, 3, 9]]


def test_v32_kernel_cache_view(cases):
    c = cases["v32_decode"][0]
    kv = mf.v32_kernel_cache(c.inputs["kv_cache"], 64)
    assert kv.shape == (c.params["num_blocks"], 64, 1, 656)
    assert kv.stride(1) == 656 and kv.stride(3) == 1 and kv.stride(0) == 65 * 656  # FlashMLA's checks
    assert kv.data_ptr() == c.inputs["kv_cache"].data_ptr()  # no copy
    assert torch.equal(kv[:, :, 0], v32_page_view(c.inputs["kv_cache"], 64))


def test_adapters_reject_out_of_contract_cases_before_launching(cases):
    bs32 = next(c for c in cases["dense_mla_decode"] if c.inputs["block_size"] == 32)
    fp8 = next(c for c in cases["dense_mla_decode"] if c.inputs["q"].dtype == torch.float8_e4m3fn)
    bf16 = next(c for c in cases["dense_mla_decode"] if c.inputs["q"].dtype == torch.bfloat16)
    with pytest.raises(UnsupportedCase, match="page_block_size 64"):
        registry.get("flashmla.dense_decode.sm90").call(bs32)
    with pytest.raises(UnsupportedCase, match="bf16 caches"):
        registry.get("flashmla.dense_decode.sm90").call(fp8)
    with pytest.raises(UnsupportedCase, match="float8_e4m3fn q and cache"):
        registry.get("flashmla.dense_decode_fp8.sm90").call(bf16)
    h16 = next(c for c in cases["dense_mla_decode"] if c.inputs["q"].shape[2] == 16)
    tiny = SimpleNamespace(inputs=dict(h16.inputs, block_size=16), params=h16.params)
    with pytest.raises(UnsupportedCase, match="page size 32 or 64"):
        registry.get("flashinfer.mla_decode.trtllm_gen").call(tiny)
    with pytest.raises(UnsupportedCase, match="page size 32 or 64"):
        registry.get("tokenspeed_mla.decode").call(tiny)
    pc = cases["dense_mla_prefill"][0]
    odd = SimpleNamespace(inputs=dict(pc.inputs, cu_seqlens_kv=pc.inputs["cu_seqlens_kv"] + 0 * 1), params={})
    odd.inputs["cu_seqlens_kv"] = torch.tensor([0, 40, 104, 106], dtype=torch.int32)
    with pytest.raises(UnsupportedCase, match="new-token prefill"):
        registry.get("tokenspeed_mla.prefill").call(odd)


# --------------------------------------------------------------------------- the judge chain


def _oracle_entry(name, stage, policies, produce):
    """An entry-like object whose ``call`` returns ``produce(case)`` (CPU)."""
    return SimpleNamespace(name=name, stage=stage, policies=policies, tolerance_scope=name, family="reference",
                           probe=lambda: None, call=produce)


def _as_kernel(res: dict) -> dict:
    out = {"out": res["out"].to(torch.bfloat16)}
    if "lse" in res:
        out["lse"] = res["lse"].to(torch.float32)
    return out


def _bf16_kernel(stage, policies):
    spec = st.get(stage)

    def produce(case):
        p = spec.policies(dict(policies, attention_mode=AttentionMode.BF16_P.value))
        e = spec.expected(case, p)
        return _as_kernel({"out": e["_same_precision"], "lse": e["lse"]})

    return produce


V32_POL = {"index_rule": "minus1_only", "nan": "propagate", "attention_mode": "bf16_p", "v32_scale_decode": "bf16_rne"}
DENSE_POL = {"nan": "propagate", "attention_mode": "bf16_p"}


@pytest.mark.parametrize("stage,pol", [("v32_decode", V32_POL), ("dense_mla_decode", DENSE_POL),
                                       ("dense_mla_prefill", DENSE_POL)])
def test_reference_positive_control_passes(stage, pol, cases):
    ent = _oracle_entry(f"ref.{stage}", stage, pol, _bf16_kernel(stage, pol))
    res = run_entry(ent, cases[stage])
    assert [r.verdict for r in res] == ["pass"] * len(cases[stage]), [(r.case, r.rule, r.message) for r in res]


def test_mutant_wrong_v32_scale_decoding_is_caught(cases):
    # a kernel that truncates the scales through E8M0 (the SM100 bug) but is declared bf16_rne:
    # identical on power-of-two scales, caught on the non-power-of-two case only
    ent = _oracle_entry("mutant.v32_rz", "v32_decode", V32_POL,
                        _bf16_kernel("v32_decode", dict(V32_POL, v32_scale_decode="sm100_rz_e8m0")))
    sub = [cases["v32_decode"][0]] + [c for c in cases["v32_decode"] if c.params["nonpow2_scales"]]
    assert {c.params["nonpow2_scales"] for c in sub} == {True, False}
    res = {r.case: r.verdict for r in run_entry(ent, sub)}
    for c in sub:
        assert res[c.name] == ("fail" if c.params["nonpow2_scales"] else "pass"), (c.name, res)


def test_v32_policy_fit_names_the_policy(cases):
    c = next(c for c in cases["v32_decode"] if c.params["nonpow2_scales"])
    got = _bf16_kernel("v32_decode", dict(V32_POL, v32_scale_decode="sm100_rz_e8m0"))(c)["out"]
    fit = v32_policy_fit(c, got, V32_POL)
    assert fit["sm100_rz_e8m0"] == 0.0
    assert fit["bf16_rne"] > 1e-3 and fit["exact"] > 1e-3


def test_mutant_minus1_read_as_an_address_is_caught(cases):
    # FlashMLA SM90 turns index -1 into page 0, row UINT_MAX % 64 = 63 and masks it; a kernel that
    # forgets the mask reads that (NaN-poisoned when unreferenced) row
    spec = st.get("v32_decode")

    def produce(case):
        idx = case.inputs["indices"]
        leaky = dict(case.inputs, indices=torch.where(idx == -1, torch.full_like(idx, 63), idx))
        e = spec.expected(SimpleNamespace(inputs=leaky, params=case.params, name=case.name, stage=case.stage),
                          spec.policies(V32_POL))
        return _as_kernel(e)

    sub = [c for c in cases["v32_decode"] if c.params["h_q"] == 64]
    res = run_entry(_oracle_entry("mutant.v32_minus1", "v32_decode", V32_POL, produce), sub)
    assert all(r.verdict == "fail" for r in res), [(r.case, r.verdict, r.rule) for r in res]


def test_mutant_non_causal_dense_is_caught(cases):
    spec = st.get("dense_mla_decode")

    def produce(case):
        e = spec.expected(SimpleNamespace(inputs=dict(case.inputs, causal=False), params=case.params,
                                          name=case.name, stage=case.stage), spec.policies(DENSE_POL))
        return _as_kernel(e)

    sub = [c for c in cases["dense_mla_decode"] if c.params["h_q"] <= 64]
    assert {c.params["s_q"] > 1 for c in sub} == {True, False}
    res = {r.case: r.verdict for r in run_entry(_oracle_entry("mutant.noncausal", "dense_mla_decode", DENSE_POL,
                                                              produce), sub)}
    for c in sub:
        assert res[c.name] == ("fail" if c.params["s_q"] > 1 else "pass"), (c.name, res)


def test_mutant_dropping_the_fp8_output_scale_is_caught(cases):
    spec = st.get("dense_mla_decode")

    def produce(case):
        e = spec.expected(case, spec.policies(DENSE_POL))
        return _as_kernel({"out": e["out"] / float(case.inputs["kv_scale"]), "lse": e["lse"]})

    sub = [c for c in cases["dense_mla_decode"] if c.params["h_q"] <= 64]
    assert {c.inputs["kv_scale"] != 1.0 for c in sub} == {True, False}
    res = {r.case: r.verdict for r in run_entry(_oracle_entry("mutant.nobmm2", "dense_mla_decode", DENSE_POL,
                                                              produce), sub)}
    for c in sub:
        assert res[c.name] == ("fail" if c.inputs["kv_scale"] != 1.0 else "pass"), (c.name, res)


# --------------------------------------------------------------------------- tolerance records


def test_mla_tolerance_records_load_and_apply():
    import json

    from dsv4_numerics.oracles.stages.mla import MLA_TOLERANCES_PATH
    from dsv4_numerics.oracles.tolerances import DEFAULT_PATH

    recs = mla_tolerance_records()
    shipped = [json.loads(s) for s in MLA_TOLERANCES_PATH.read_text().splitlines() if s.strip() and not s.startswith("#")]
    assert shipped == json.loads(json.dumps(recs))  # the shipped file is what the derivation gives
    base = [json.loads(s) for s in DEFAULT_PATH.read_text().splitlines() if s.strip() and not s.startswith("#")]
    tols = Tolerances.from_dicts(base + recs)
    t = tols.lookup("flashmla.dense_decode_fp8", "lse", "float8_e4m3fn")
    assert t.kind == "override" and t.tier == "B" and t.atol > 0
    assert tols.tier_of("flashmla.dense_decode_fp8") == "B"
    assert tols.tier_of("flashinfer.mla_decode.trtllm_gen", dtype="bfloat16") == "A"
    assert tols.tier_of("flashinfer.mla_decode.trtllm_gen", dtype="float8_e4m3fn") == "B"
    with pytest.raises(InputError, match="must contain at least one FP8"):
        mla_tolerance_records([])
