"""The DeepSeek-V4.1 attention oracle (``reference.attention.v41``) and its stages: the decoded rows
are exact, the fast oracle stays within its proven bound on V4.1 caches, the cross-producer
byte-order check fails by name, and drawn cases (mixed MXFP8 + NVFP4, E2M1 ties) pass."""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import given, settings

from dsv4_numerics.oracles import matrix
from dsv4_numerics.oracles import stages as st
from dsv4_numerics.oracles.stages.v41_attention import v41_decode_segments
from dsv4_numerics.reference.caches import v41 as cache_v41
from dsv4_numerics.reference.attention.ordered import sparse_attention
from dsv4_numerics.reference.attention.v41 import V41Paged, v41_segments
from dsv4_numerics.reference.cases import default_cases
from dsv4_numerics.reference.cases.v41_attention import v41_decode_case
from dsv4_numerics.reference.errors import InputError
from dsv4_numerics.reference.formats.fp4 import decode_e2m1
from dsv4_numerics.reference.formats.fp8 import decode_e4m3fn, decode_fp8, decode_ue8m0
from dsv4_numerics.reference.policies import Fp8Flavour, V41Record
from dsv4_numerics.strategies.v41 import v41_decode_cases

from tests.mutants import MutantEntry, attn_out


@functools.lru_cache(maxsize=None)
def _cases(stage):
    return tuple(default_cases(stage))


def test_nvfp4_decode_to_bf16_is_exact_for_every_code_and_scale():
    # every (E2M1 code, finite E4M3 scale byte) pair: the bf16 row value equals the exact product
    codes = torch.arange(16, dtype=torch.uint8)
    scales = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
    exact = decode_e2m1(codes).double()[:, None] * decode_e4m3fn(scales).double()[None, :]
    assert torch.equal(exact.to(torch.bfloat16).double(), exact)


def test_mxfp8_decode_to_bf16_is_exact_below_bf16_overflow():
    # every finite E4M3 code times 2**(b - 127) for the bytes the writers produce (105..247): exact in
    # bf16 except products >= 2**128 (bf16 inf), which need code >= 256 at byte 247 (module docstring)
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    vals = decode_fp8(codes, Fp8Flavour.E4M3FN).double()[:, None]
    mult = decode_ue8m0(torch.arange(105, 248, dtype=torch.uint8)).double()[None, :]
    exact = vals * mult
    ok = exact.abs() < 2.0**128
    assert torch.equal(exact.to(torch.bfloat16).double()[ok], exact[ok])
    assert int((~ok).sum()) and bool((vals.abs()[:, 0][(~ok).any(dim=1)] >= 256).all())


def test_nvfp4_is_refused_as_the_main_cache():
    c = cache_v41.empty_cache(1, 2, V41Record.NVFP4)
    seg = V41Paged(c, 2, V41Record.NVFP4, torch.zeros(1, 1, dtype=torch.int32))
    with pytest.raises(InputError, match="main.record.*only as the extra"):
        v41_segments(seg, None, "interleaved")


@pytest.mark.parametrize("stage", ["v41_sparse_decode", "v41_sparse_prefill"])
def test_fast_oracle_within_its_bound_on_the_default_cases(stage):
    spec = st.get(stage)
    for case in _cases(stage):
        ordered = spec.expected(case, spec.policies({}))
        fast = spec.expected(case, spec.policies({"oracle": st.FAST, "oracle_device": "cpu"}))
        assert fast["_oracle"]["mode"] == st.FAST
        for k in ("out", "lse", "max_logits"):
            e, f = ordered[k], fast[k]
            assert torch.equal(torch.isnan(e), torch.isnan(f)), (case.name, k)
            fin = torch.isfinite(e)
            assert torch.equal(e[~fin & ~torch.isnan(e)], f[~fin & ~torch.isnan(e)]), (case.name, k)
            gap = float((e[fin] - f[fin]).abs().max()) if bool(fin.any()) else 0.0
            assert gap <= fast["_oracle"]["bound"][k], (case.name, k, gap, fast["_oracle"]["bound"][k])


def _reader(layout: str) -> MutantEntry:
    """A V4.1 decode that reads both caches in ``layout`` and declares it (a reader of that byte order)."""

    def call(case):
        segs = v41_decode_segments(case, {}, layout=layout)
        return attn_out(sparse_attention(case.inputs["q"], segs, case.inputs["scale"], case.inputs["sink"]))

    return MutantEntry(f"reader.{layout}", "v41_sparse_decode", "cross-producer check", call, {"v41_layout": layout})


@pytest.mark.dsv4_unreported
def test_cross_producer_layout_disagreement_fails_naming_the_layout_policy():
    # FlashInfer 0.7.2 writes page-footer caches; FlashMLA / vLLM 0.33.0 read interleaved ones
    case = next(c for c in _cases("v41_sparse_decode") if c.inputs["v41_layout"] == "page_footer")
    bad = matrix.run_entry(_reader("interleaved"), cases=[case])[0]
    assert bad.verdict == "fail" and bad.rule == "v41_layout_mismatch"
    assert "v41_layout=page_footer" in bad.message and "v41_layout=interleaved" in bad.message
    assert "the kernel's out is the misread one" in bad.message
    good = matrix.run_entry(_reader("page_footer"), cases=[case])[0]
    assert good.verdict == "pass", good.message
    same = matrix.run_entry(_reader("interleaved"), cases=[_cases("v41_sparse_decode")[0]])[0]
    assert same.verdict == "pass" and "v41_layout" not in same.message


def test_default_cases_cover_the_v41_pairings():
    seen = {(c.inputs.get("extra_record"), c.inputs["v41_layout"]) for c in _cases("v41_sparse_decode")}
    assert {(None, "interleaved"), ("nvfp4_288", "interleaved"), ("mxfp8_528", "interleaved"),
            ("nvfp4_288", "page_footer")} <= seen
    for c in _cases("v41_sparse_decode"):  # unwritten slots are NaN-poisoned, referenced ones finite
        segs = v41_decode_segments(c, {})
        assert all(bool(torch.isnan(s.rows).any()) for s in segs), c.name


@settings(max_examples=5, deadline=None)  # ~1 s per drawn case on one CPU core
@given(case=v41_decode_cases())
def test_drawn_v41_decode_cases_pass_and_the_fast_bound_holds(case):
    spec = st.get("v41_sparse_decode")
    ordered = spec.expected(case, spec.policies({}))
    fast = spec.expected(case, spec.policies({"oracle": st.FAST, "oracle_device": "cpu"}))
    fin = torch.isfinite(ordered["out"])
    assert torch.equal(fin, torch.isfinite(fast["out"]))
    if bool(fin.any()):
        assert float((ordered["out"][fin] - fast["out"][fin]).abs().max()) <= fast["_oracle"]["bound"]["out"]
    # the reader that follows the writer's byte order passes; the other order is named when it fails
    layout = case.inputs["v41_layout"]
    assert matrix.run_entry(_reader(layout), cases=[case])[0].verdict == "pass"


def test_a_case_whose_every_token_attends_to_nothing_is_judged_exactly():
    # found by the `dev` hypothesis profile: one lonely token, so lse and max_logits are -inf
    # everywhere; that was failed as a reference that "cannot discriminate"
    case = v41_decode_case("all-lonely", 0, t=1, heads=3, main_bs=16, main_nb=1, main_k=64, extra=None,
                           producer="vllm_0.33.0", lonely=(0,), empty_extra=(), stale_past_len=False, tail=0,
                           edge="every token lonely")
    good = matrix.run_entry(_reader("interleaved"), cases=[case])[0]
    assert good.verdict == "pass", good.message
    assert "all_non_finite" in str(good.details), good.details.keys()
    reader = _reader("interleaved")

    def finite_lse(c):  # a kernel that writes 0 where no token was attended
        out = reader.call(c)
        out["lse"] = torch.where(torch.isinf(out["lse"]), torch.zeros_like(out["lse"]), out["lse"])
        return out

    bad = matrix.run_entry(MutantEntry("reader.finite_lse", "v41_sparse_decode", "lonely lse as 0", finite_lse,
                                       {"v41_layout": "interleaved"}), cases=[case])[0]
    assert bad.verdict == "fail" and "anomaly_positions" in bad.rule, (bad.rule, bad.message)


def test_case_builder_names_an_unknown_producer():
    with pytest.raises(InputError, match="producer.*flashinfer_0.7.2"):
        v41_decode_case("x", 1, producer="no-such-producer")
