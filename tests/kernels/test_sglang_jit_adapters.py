"""SGLang's JIT-CUDA / TileLang entries (``kernels/sglang/jit.py``) on CPU.

The production ops need nvcc, ninja, tvm-ffi and an sm90+ GPU; here the adapters run against a
stand-in that enforces the ops' host checks and re-derives the V4 store arithmetic from the CUDA
source (``tests/kernels/fake_sglang_jit.py``), judged by the matrix's own runner under each
entry's declared policies. That pins the plumbing (page repacking to ``kv_page_bytes``, dropped
negative slots, the SGLang layout names, RoPE lane views and directions) and the declarations
(``nonfinite=sglang_jit``, ``scale_rule=scale_clamp`` for the V4.1 MXFP8 store, FMA forward /
FMA_TRITON inverse). The probes must name the missing step."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import tests.kernels.fake_sglang_jit as FAKE
from dsv4_numerics.kernels import probe as P
from dsv4_numerics.kernels import registry
from dsv4_numerics.kernels.sglang import jit as sglang_jit
from dsv4_numerics.oracles import matrix
from dsv4_numerics.reference.caches import model1 as cache_model1
from dsv4_numerics.reference.cases import Case, default_cases
from dsv4_numerics.reference.errors import UnsupportedCase


@pytest.fixture
def fake(monkeypatch):
    FAKE.CALLS.clear()
    monkeypatch.setattr(sglang_jit, "jit_module", lambda name: FAKE)
    return FAKE


def _runnable(name: str):
    return dataclasses.replace(registry.get(name), probe=lambda: None)


def _verdicts(name: str, cases=None) -> dict[str, str]:
    return {r.case: r.verdict for r in matrix.run_entry(_runnable(name), cases=cases)}


def test_entries_registered_with_family_and_distinct_names():
    mine = [e for e in registry.all_entries() if e.name.startswith("sglang.") and e.family == "sglang"]
    assert {e.name for e in mine} >= {"sglang.store_jit", "sglang.store_jit.v41_footer",
                                      "sglang.store_jit.v41_interleaved", "sglang.rope_jit",
                                      "sglang.rope_jit.inverse", "sglang.tilelang_decode"}
    assert all(registry.validate_entry(e) == [] for e in mine)


def test_v4_store_passes_power_of_two_cases_and_skips_the_others(fake):
    v = _verdicts("sglang.store_jit")
    bs = {c.name: c.inputs["block_size"] for c in default_cases("swa_write")}
    assert {n for n, b in bs.items() if b & (b - 1) == 0} == {n for n, r in v.items() if r == "pass"}
    assert {n for n, b in bs.items() if b & (b - 1)} == {n for n, r in v.items() if r == "skip"}
    strides = {c["stride"] for c in fake.CALLS}
    assert strides == {(37440, 1), (9792, 1)}  # kv_page_bytes(64) = 65*576; (16) = 17*576, repacked


def _nonfinite_case() -> Case:
    g = torch.Generator().manual_seed(7)
    k = (torch.randn(4, 512, generator=g) * 3).to(torch.bfloat16)
    k[0, 3], k[0, 70], k[1, 5] = float("inf"), float("-inf"), float("nan")
    k[2, 130:140] = float("nan")
    k[0, 10], k[0, 11] = 0.0, -0.0
    cache = cache_model1.empty_cache(2, 4, page_stride=4 * 584, fill=0x5A)
    slots = torch.tensor([5, -1, 2, 0])
    return Case("nonfinite", "swa_write", {"k": k, "slot_mapping": slots, "cache": cache, "block_size": 4}, {})


def test_v4_store_nonfinite_bytes_are_the_sglang_policy(fake):
    case = _nonfinite_case()
    assert _verdicts("sglang.store_jit", [case]) == {"nonfinite": "pass"}
    # the vLLM CUDA writer's policy does not explain the same bytes (the policy is needed)
    other = dataclasses.replace(_runnable("sglang.store_jit"),
                                policies=dict(registry.get("sglang.store_jit").policies, nonfinite="cuda_satfinite"))
    assert [r.verdict for r in matrix.run_entry(other, cases=[case])] == ["fail"]
    assert fake.CALLS[-1]["n"] == 3  # the -1 token was dropped, not handed to the kernel


@pytest.mark.parametrize("name", ["sglang.store_jit.v41_footer", "sglang.store_jit.v41_interleaved"])
def test_v41_stores_pass_under_their_declared_order_and_rules(fake, name):
    assert set(_verdicts(name).values()) == {"pass"}
    layouts = {c["layout"] for c in fake.CALLS}
    assert layouts == ({"v41_new", "v41_fp4_new"} if name.endswith("interleaved") else {"v41", "v41_fp4"})


def test_v41_footer_fails_under_vllm_mxfp8_rule(fake):
    e = dataclasses.replace(_runnable("sglang.store_jit.v41_footer"),
                            policies=dict(registry.get("sglang.store_jit.v41_footer").policies, scale_rule="amax_clamp"))
    mx = [c for c in default_cases("v41_write") if c.inputs["record"] == "mxfp8_528"]
    assert "fail" in {r.verdict for r in matrix.run_entry(e, cases=mx)}


def test_rope_entries_split_the_directions(fake):
    fwd, inv = _verdicts("sglang.rope_jit"), _verdicts("sglang.rope_jit.inverse")
    inverse = {c.name for c in default_cases("rope") if c.inputs.get("inverse")}
    assert inverse and {n for n, v in fwd.items() if v == "skip"} == inverse
    assert {n for n, v in fwd.items() if v == "pass"} == set(fwd) - inverse
    assert {n for n, v in inv.items() if v == "pass"} == inverse
    assert {n for n, v in inv.items() if v == "skip"} == set(inv) - inverse


def test_store_args_refuse_odd_pages_and_keep_the_case_untouched():
    case = next(c for c in default_cases("swa_write") if c.inputs["block_size"] == 53)
    with pytest.raises(UnsupportedCase, match="power of two"):
        sglang_jit.store_args(case.inputs, "v4")
    case = default_cases("swa_write")[0]
    before = case.inputs["cache"].clone()
    a = sglang_jit.store_args(case.inputs, "v4")
    a["cache"].fill_(0xEE)
    assert torch.equal(case.inputs["cache"], before)
    assert sglang_jit.kv_page_bytes("v4", 64) == 37440 and sglang_jit.kv_page_bytes("v41_new", 2) == 1056
    assert sglang_jit.kv_page_bytes("v41", 2) == 1536 and sglang_jit.kv_page_bytes("v41_fp4", 2) == 768


def test_probes_name_the_missing_step(monkeypatch):
    monkeypatch.setattr(sglang_jit.P, "module_reason", lambda module, dist=None, min_version=None: f"{module} missing")
    assert "stage-sglang" in sglang_jit.staged_reason(sglang_jit.STORE_MODULE)
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setattr(sglang_jit.shutil, "which", lambda name: None)
    assert "nvcc not found" in sglang_jit.nvcc_reason()
    assert "ninja not found" in sglang_jit.ninja_reason()
    assert "--site-wheels" in sglang_jit.wheel_hint("tilelang", "tilelang")()
    monkeypatch.setenv("CUDA_HOME", "/no/such/cuda")
    assert "/no/such/cuda/bin/nvcc does not exist" in sglang_jit.nvcc_reason()
    if P.gpu_info().vendor != "cuda":  # on CPU the arch gate answers first, naming the GPU found
        ok, why = registry.get("sglang.store_jit").available()
        assert not ok and "needs sm90" in why
    if P.gpu_info().vendor != "rocm":  # SGLang's ROCm-only decode: the gate names the gfx targets
        ok, why = registry.get("sglang.tilelang_decode").available()
        assert not ok and "gfx942" in why


def test_tilelang_decode_driven_as_flashmla_with_exp0_codes_read_as_normals(fake):
    want = ("h64-c128a-bs2", "sweep-tiny-kv", "sweep-odd-pages-53-69")
    cases = [c for c in default_cases("decode") if c.name in want]
    assert _verdicts("sglang.tilelang_decode", cases) == {"h64-c128a-bs2": "pass", "sweep-tiny-kv": "pass",
                                                          "sweep-odd-pages-53-69": "skip"}
    # without the declared reading the tiny-cache case fails: the policy is what explains the kernel
    exact = dataclasses.replace(_runnable("sglang.tilelang_decode"),
                                policies=dict(registry.get("sglang.tilelang_decode").policies, fp8_decode="exact"))
    tiny = [c for c in cases if c.name == "sweep-tiny-kv"]
    assert [r.verdict for r in matrix.run_entry(exact, cases=tiny)] == ["fail"]
