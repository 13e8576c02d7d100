"""kernels/vllm/v41.py on CPU: the registry entries, their probes' reasons, the argument conversions
(views, copies, record dispatch, the V4.1 index-builder contract differences), and each call path
end to end through stand-in production modules that apply the reference to exactly the arguments
the adapter hands over (so a wrong view, stride, slot or record fails the stage's judge). The real
kernels run on a GPU with ``DSV4_STAGED`` (``stage-vllm --parts v41``)."""

from __future__ import annotations

import dataclasses
import sys
import types

import pytest
import torch

from dsv4_numerics.kernels import probe as P
from dsv4_numerics.kernels.vllm import triton as VT
from dsv4_numerics.kernels.vllm import v41 as V
from dsv4_numerics.kernels.registry import validate_entry
from dsv4_numerics.oracles import matrix
from dsv4_numerics.reference.caches import model1 as cache_model1
from dsv4_numerics.reference.caches import v41 as cache_v41
from dsv4_numerics.reference.cases import Case, default_cases
from dsv4_numerics.reference.errors import InputError, UnsupportedCase
from dsv4_numerics.reference.policies import RopeArithmetic
from dsv4_numerics.reference.pipeline.rope import rope_pairs

from ..mutants import reference_entry, v41_nonfinite_entry, v41_nvfp4_nan_as_zero, v41_nvfp4_poisoned


def test_entries_validate_and_probe_with_reasons_on_cpu():
    names = [e.name for e in V.ENTRIES]
    assert len(names) == len(set(names)) and all(n.startswith("vllm_v41.") for n in names)
    for e in V.ENTRIES:
        assert validate_entry(e) == [], e.name
        if not torch.cuda.is_available():
            ok, reason = e.available()
            assert not ok and reason and "probe raised" not in reason, (e.name, reason)


def test_nvfp4_writer_is_unavailable_on_sm90(monkeypatch):
    """The e2m1x2 conversion is Blackwell-only PTX: on an H200 the probe names the archs it needs."""
    monkeypatch.setattr(P, "gpu_info", lambda: P.GpuInfo(True, "cuda", "NVIDIA H200", (9, 0), "sm90"))
    reason = P.needs_arch(*V.NVFP4_WRITER_ARCHS)()
    assert reason and "sm100" in reason and "sm90" in reason
    assert V.NVFP4_WRITER_ARCHS == next(e.archs for e in V.ENTRIES if e.name == "vllm_v41.rope_quant_insert.nvfp4")


# --------------------------------------------------------------------------- stand-in production modules


def _fake_cache_utils() -> types.ModuleType:
    m = types.ModuleType(V.V41_CACHE_UTILS)

    def quantize_and_insert_k_cache(k, k_cache, slot_mapping, block_size=64, is_ue8m0=True, use_fnuz=False,
                                    bytes_per_token=584):
        assert k_cache.dim() == 2 and bytes_per_token == 528 and not use_fnuz and is_ue8m0
        new = cache_v41.insert(k_cache, k, slot_mapping, block_size, "mxfp8_528", "interleaved",
                               nonfinite="triton", slot_skip="minus1_only")
        k_cache.copy_(new)

    def dequantize_and_gather_k_cache_triton(out, k_cache, seq_lens, gather_lens, block_table, block_size, offset,
                                             use_fnuz=False, max_gather_len=None):
        assert k_cache.dim() == 3 and k_cache.shape[1] == block_size
        rec = {528: "mxfp8_528", 288: "nvfp4_288"}.get(k_cache.shape[-1])
        if rec is None:
            res, valid = cache_model1.gather(k_cache, block_table, seq_lens, block_size, gather_lens,
                                             consumer="triton", offset=offset)
        else:
            res, valid = cache_v41.gather(k_cache, block_table, seq_lens, block_size, rec, "interleaved",
                                          gather_lens, consumer="triton", offset=offset,
                                          e2m1_zero="positive")  # Triton's -mag is 0 - mag
        w = res.shape[1]
        out[:, :w][valid] = res[valid]

    class _OnePass:
        def __getitem__(self, grid):
            def launch(out, s0, s1, cache, seq_lens, block_table, offset, gather_lens, **kw):
                assert (s0, s1) == out.stride()[:2] and kw["block_stride"] == cache.stride(0)
                dequantize_and_gather_k_cache_triton(out, cache, seq_lens, gather_lens, block_table,
                                                     kw["cache_block_size"], offset)
            return launch

    m.quantize_and_insert_k_cache = quantize_and_insert_k_cache
    m.dequantize_and_gather_k_cache_triton = dequantize_and_gather_k_cache_triton
    m._dequantize_and_gather_k_one_pass_kernel = _OnePass()
    m.gather_num_workers = lambda n: 128
    return m


def _fake_compress() -> types.ModuleType:
    m = types.ModuleType(V.V41_COMPRESS)

    def rope_quant_insert(latent, positions, cos_sin_cache, kv_cache, slot_mapping, compress_ratio, fp8_scale=None):
        assert compress_ratio == 1 and kv_cache.dim() == 3 and positions.numel() >= slot_mapping.numel()
        rec = {528: "mxfp8_528", 288: "nvfp4_288"}[kv_cache.shape[-1]]
        cs = cos_sin_cache[positions].to(torch.float64)  # [N, 64]; NoPE pairs load (1, 0)
        n = latent.shape[0]
        cos = torch.cat([torch.ones(n, 224, dtype=torch.float64), cs[:, :32]], dim=1)
        sin = torch.cat([torch.zeros(n, 224, dtype=torch.float64), cs[:, 32:]], dim=1)
        x = latent.to(torch.float64)
        e, o = rope_pairs(x[:, 0::2], x[:, 1::2], cos, sin, False, RopeArithmetic.FMA_TRITON)
        rows = torch.stack((e, o), dim=-1).reshape(n, 512).to(torch.float32)
        new = cache_v41.insert(kv_cache, rows, slot_mapping, kv_cache.shape[1], rec, "interleaved", nonfinite="triton")
        kv_cache.copy_(new)

    m.rope_quant_insert = rope_quant_insert
    return m


@pytest.fixture()
def fake_vllm(monkeypatch):
    monkeypatch.setitem(sys.modules, V.V41_CACHE_UTILS, _fake_cache_utils())
    monkeypatch.setitem(sys.modules, V.V41_COMPRESS, _fake_compress())


_STAGED = ("quantize_and_insert", "rope_quant_insert", "dequantize_and_gather")


@pytest.mark.parametrize("name", [e.name for e in V.ENTRIES if any(s in e.name for s in _STAGED)])
def test_call_paths_through_stand_in_modules(name, fake_vllm):
    entry = dataclasses.replace(next(e for e in V.ENTRIES if e.name == name), probe=lambda: None)
    results = matrix.run_entry(entry, cases=default_cases(entry.stage))
    verdicts = {r.case: r.verdict for r in results}
    assert "fail" not in verdicts.values() and "error" not in verdicts.values(), results
    assert "pass" in verdicts.values()  # at least one case of its own record ran
    for r in results:
        if r.verdict == "skip":
            assert "handles" in r.message, r.message  # only the other record's cases are skipped


def test_the_writer_copy_never_touches_the_case_cache(fake_vllm):
    case = default_cases("v41_write")[0]
    before = case.inputs["cache"].clone()
    entry = next(e for e in V.ENTRIES if e.name == "vllm_v41.quantize_and_insert_k_cache.mxfp8")
    out = entry.call(case)["cache"]
    assert torch.equal(case.inputs["cache"], before) and not torch.equal(out, before)
    bad = Case("neg", "v41_write", dict(case.inputs, slot_mapping=torch.tensor([0, -2])), {})
    with pytest.raises(UnsupportedCase, match="other than -1"):
        entry.call(bad)
    with pytest.raises(InputError, match="'slot_mapping'"):
        entry.call(Case("oob", "v41_write", dict(case.inputs, slot_mapping=torch.tensor([10**6])), {}))


# --------------------------------------------------------------------------- vLLM's NVFP4 non-finite rule


def _nonfinite_case() -> Case:
    g = torch.Generator().manual_seed(5)
    k = torch.randn(4, 512, generator=g).to(torch.bfloat16)
    k[0, 3] = float("nan")
    k[1, 17] = float("inf")
    k[2, 40:56] = float("-inf")
    k[3, 100] = float("nan")
    k[3, 101] = float("-inf")
    cache = torch.randint(0, 256, (2, 2 * 288), generator=g, dtype=torch.int64).to(torch.uint8)
    inputs = {"k": k, "slot_mapping": torch.tensor([3, 0, 2, 1]), "block_size": 2, "num_blocks": 2,
              "page_stride": 576, "record": "nvfp4_288", "cache": cache}
    return Case("nvfp4-nonfinite", "v41_write", inputs, {})


def test_nonfinite_rule_separates_the_producers():
    """Declared ``nonfinite = triton``, the reference passes and the two other readings of a NaN /
    Inf group (NaN codes 0; FlashInfer's poison) fail."""
    case = _nonfinite_case()
    ok = matrix.run_entry(reference_entry("v41_write", {"nonfinite": "triton"}), cases=[case])[0]
    assert ok.verdict == "pass", ok
    for name, fn in (("nan_as_zero", v41_nvfp4_nan_as_zero), ("poisoned", v41_nvfp4_poisoned)):
        r = matrix.run_entry(v41_nonfinite_entry(name, fn), cases=[case])[0]
        assert r.verdict == "fail", (name, r)


# --------------------------------------------------------------------------- index-builder contracts


def _index_case(stage: str, name: str) -> Case:
    return next(c for c in default_cases(stage) if c.name == name)


def test_flashinfer_mixed_v41_adds_replay_start_and_refuses_other_contracts():
    case = _index_case("flashinfer_mixed", "c4-local-decode-prefill-permuted-padding")
    a = V.flashinfer_mixed_v41_args(case.inputs)
    assert torch.equal(a["replay_start"], torch.zeros_like(a["seq_lens"])) and a["replay_start"].dtype == torch.int32
    assert not set(a) & {"prefill_left_visible", "prefill_right_visible", "max_image_tokens", "num_rows"}
    with pytest.raises(UnsupportedCase, match="non-causal"):
        V.flashinfer_mixed_v41_args(_index_case("flashinfer_mixed", "dspark-noncausal-decode").inputs)
    with pytest.raises(UnsupportedCase, match="num_rows"):
        V.flashinfer_mixed_v41_args(dict(case.inputs, num_rows=99))
    replay = _index_case("flashinfer_mixed", "v41-replay-start-c4")
    a = V.flashinfer_mixed_v41_args(replay.inputs)
    assert a["replay_start"].tolist() == [0, 14, 3, 5] and a["replay_start"].dtype == torch.int32
    with pytest.raises(UnsupportedCase, match="replay_start"):
        VT.flashinfer_mixed_args(replay.inputs)  # the V4 builder has no replay


def test_combine_v41_refuses_image_spans():
    case = _index_case("combine_prefill", "c4-common-base5-interior-minus1")
    assert "left_visible" not in V.combine_v41_args(case.inputs)
    with pytest.raises(UnsupportedCase, match="vision"):
        V.combine_v41_args(dict(case.inputs, left_visible=torch.zeros(1, dtype=torch.int32)))


def test_gather_args_view_the_case_bytes_and_size_the_workspace():
    case = default_cases("v41_gather")[1]  # bs 2, page tail 40, offset 3
    a = V.v41_gather_args("t", case.inputs, V.V41Record.MXFP8)
    v = a["k_cache"]
    assert v.shape == (case.inputs["num_blocks"], 2, 528) and v.stride() == (case.inputs["page_stride"], 528, 1)
    assert v.data_ptr() == case.inputs["cache"].data_ptr()  # read in place, no copy
    assert a["out"].shape == (3, 3 + 6, 512) and not bool(a["out"].any())
    with pytest.raises(InputError, match="'cache'"):  # pages of two 288-byte records read as 528-byte ones
        V.v41_gather_args("t", dict(case.inputs, cache=torch.zeros(2, 576, dtype=torch.uint8)), V.V41Record.MXFP8)
