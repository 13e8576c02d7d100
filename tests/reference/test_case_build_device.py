"""The device case builder (``reference.cases.attention_device``): the same bytes on every device
for every stage the GPU fuzz uses, the contract of the pipeline builder's decode cases, and the
judge on the device (``matrix.run_entry(judge_device=True)``, compact decode segments) giving
the verdict and figures of the host judge.

On the CPU every stage is built twice (deterministic) and checked for its contract; where CUDA is
present every stage is also built there and compared with the CPU's byte for byte."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dsv4_numerics.reference.attention.ordered import sparse_attention
from dsv4_numerics.reference.caches.model1 import dequantize_all
from dsv4_numerics.reference.cases.attention import decode_case, prefill_case
from dsv4_numerics.reference.cases.attention_device import (PREFILL_STAGES, STAGES, decode_stages, device_decode_case,
                                                            device_prefill_case, prefill_stages)

# (layer, heads, seq_lens, options): every layer, page size and index option the fuzz draws, small
DRAWS = [
    ("swa", 64, [5, 300, 129, 1], {"swa_bs": 64}),
    ("swa", 128, [1, 255, 257], {"swa_bs": 256, "invalid_tokens": (1,), "stale_past_len": True}),
    ("c4a", 64, [700, 9, 1500, 4], {"topk": 512, "rope_table": True, "q_scale_log2": -6}),
    ("c4a", 128, [2051, 600], {"topk": 1024, "stale_past_len": True, "invalid_tokens": (0,), "q_scale_log2": 6}),
    ("c4a", 64, [3, 2], {"topk": 2048}),  # nothing visible yet: every compressed row empty
    ("c128a", 64, [130, 520, 1000], {"comp_bs": 2, "rope_table": True}),
    ("c128a", 128, [300, 129, 64], {"comp_bs": 64, "stale_past_len": True, "invalid_tokens": (2,)}),
]


def _bytes(t):
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def _same_bytes(a: dict, b: dict, stages=STAGES) -> list[str]:
    bad = []
    for k in stages:
        x, y = a[k], b[k]
        if (x is None) != (y is None):
            bad.append(k)
        elif x is not None and (x.dtype != y.dtype or tuple(x.shape) != tuple(y.shape)
                                or not torch.equal(_bytes(x), _bytes(y))):
            bad.append(k)
    return bad


@pytest.mark.parametrize("layer,heads,seq,opts", DRAWS)
def test_every_stage_same_bytes_on_every_device(layer, heads, seq, opts):
    ref = decode_stages(layer, heads, seq, seed=11, **opts)
    assert _same_bytes(ref, decode_stages(layer, heads, seq, seed=11, **opts)) == []  # deterministic
    assert _same_bytes(ref, decode_stages(layer, heads, seq, seed=12, **opts)) != []  # the seed matters
    if torch.cuda.is_available():
        got = decode_stages(layer, heads, seq, seed=11, device="cuda", **opts)
        assert all(v is None or v.device.type == "cuda" for v in got.values())
        assert _same_bytes(ref, got) == []


def assert_same_inputs_contract(c, ref) -> None:
    """The device-built case ``c`` has the pipeline-built ``ref``'s input names, tensor dtypes and
    shapes, and its non-tensor inputs."""
    assert set(c.inputs) == set(ref.inputs)
    for k, v in ref.inputs.items():
        if isinstance(v, torch.Tensor):
            assert (c.inputs[k].dtype, tuple(c.inputs[k].shape)) == (v.dtype, tuple(v.shape)), k
        else:
            assert c.inputs[k] == v, k


@pytest.mark.parametrize("layer,heads,seq,opts", DRAWS)
def test_case_contract_matches_the_pipeline_builder(layer, heads, seq, opts):
    c = device_decode_case("d", layer, heads, seq, seed=5, **opts)
    ref = decode_case("p", layer, heads, seq, seed=5, **{k: v for k, v in opts.items() if k != "q_scale_log2"})
    assert_same_inputs_contract(c, ref)
    for k in ("swa_lens", "extra_lens", "positions"):  # lengths follow the layer's rules, not the content
        if k in ref.inputs:
            assert torch.equal(c.inputs[k], ref.inputs[k]), k
    if "extra_indices" in ref.inputs and layer == "c128a":  # every visible entry
        assert torch.equal(c.inputs["extra_indices"] >= 0, ref.inputs["extra_indices"] >= 0)


@pytest.mark.parametrize("layer,heads,seq,opts", DRAWS)
def test_valid_indices_read_written_rows_and_nothing_else_is_written(layer, heads, seq, opts):
    c = device_decode_case("d", layer, heads, seq, seed=7, **opts)
    inp = c.inputs
    for cache, bs, idx, ln in (("swa_cache", "swa_block_size", "swa_indices", "swa_lens"),
                               ("extra_cache", "extra_block_size", "extra_indices", "extra_lens")):
        if cache not in inp:
            continue
        rows = dequantize_all(inp[cache], inp[bs])
        i = inp[idx].to(torch.int64)
        valid = (torch.arange(i.shape[1])[None, :] < inp[ln][:, None]) & (i >= 0)
        read = torch.unique(i[valid])
        assert bool(torch.isfinite(rows[read].float()).all())
        written = torch.isfinite(rows.float()).all(dim=1).nonzero().reshape(-1)
        assert set(read.tolist()) <= set(written.tolist())
        if not opts.get("invalid_tokens"):  # every written row is read by its token
            assert set(written.tolist()) == set(read.tolist())
        # past the lengths: -1, or (stale_past_len) a slot some valid column reads
        past = (torch.arange(i.shape[1])[None, :] >= inp[ln][:, None])
        if opts.get("stale_past_len") and read.numel():
            assert set(i[past].tolist()) <= set(read.tolist())
        else:
            assert bool((i[past] == -1).all())


def test_q_scale_is_exact_and_sinks_follow_the_builders():
    a = device_decode_case("a", "swa", 64, [10, 20], seed=3)
    b = device_decode_case("b", "swa", 64, [10, 20], seed=3, q_scale_log2=5)
    assert torch.equal(b.inputs["q"].float(), a.inputs["q"].float() * 32.0)
    s = a.inputs["sink"]
    assert s.dtype == torch.float32 and s[1] == float("inf") and s[2] == float("-inf")
    assert bool(torch.isfinite(s[3:]).all())
    assert a.params["builder"] == "device" and b.params["q_scale_log2"] == 5


def _exact_entry():
    """A decode "kernel" returning the ordered oracle's outputs (out rounded to bfloat16, lse to
    float32), judged under FlashMLA's tolerance records."""
    from dsv4_numerics.kernels.registry import KernelEntry
    from dsv4_numerics.oracles.stages.attention import decode_segments

    def call(case):
        segs = decode_segments(case, {})
        r = sparse_attention(case.inputs["q"], segs, case.inputs["scale"], case.inputs["sink"])
        return {"out": r.out.to(torch.bfloat16), "lse": r.lse.to(torch.float32)}

    return KernelEntry(name="exact.decode", stage="decode", family="reference", source="test", archs=("sm90",),
                       dtypes=("bfloat16",), policies={}, tolerance_scope="flashmla.sparse_decode.sm90",
                       probe=lambda: None, call=call)


@pytest.mark.parametrize("layer,heads,seq,opts", [DRAWS[1], DRAWS[3], DRAWS[6]])
def test_compact_segments_give_the_ordered_oracle_bit_for_bit(layer, heads, seq, opts):
    from dsv4_numerics.oracles.stages.attention import decode_segments

    c = device_decode_case("d", layer, heads, seq, seed=9, **opts)
    full, small = decode_segments(c, {}), decode_segments(c, {}, compact=True)
    assert sum(s.rows.shape[0] for s in small) < sum(s.rows.shape[0] for s in full)
    a = sparse_attention(c.inputs["q"], full, c.inputs["scale"], c.inputs["sink"])
    b = sparse_attention(c.inputs["q"], small, c.inputs["scale"], c.inputs["sink"])
    for k in ("out", "lse", "lse_with_sink", "max_logits", "n_valid"):
        x, y = getattr(a, k), getattr(b, k)
        assert torch.equal(_bytes(x), _bytes(y)), k


@pytest.mark.parametrize("layer,heads,seq,opts", [DRAWS[3], DRAWS[5]])
def test_judge_on_the_device_gives_the_host_judges_verdict(layer, heads, seq, opts):
    from dsv4_numerics.oracles.matrix import run_entry

    c = device_decode_case("d", layer, heads, seq, seed=2, **opts)
    entry = _exact_entry()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    (host,) = run_entry(entry, cases=[c], device=dev, arch="sm90", oracle_mode="fast")
    (here,) = run_entry(entry, cases=[c], device=dev, arch="sm90", oracle_mode="fast", judge_device=True)
    assert (host.verdict, here.verdict) == ("pass", "pass"), (host.line(), host.message, here.line(), here.message)
    assert host.rule == here.rule
    diff = []
    for name in ("out", "lse", "max_logits"):
        h, d = host.details.get(name), here.details.get(name)
        assert (h is None) == (d is None), name
        if h is not None:
            for k in ("max_abs", "max_rel", "max_ulps", "mismatch_count", "anomaly_mismatch", "max_abs_index"):
                if h[k] != d[k]:
                    diff.append((name, k, h[k], d[k]))
    assert diff == []
    bad = dataclasses.replace(entry, call=lambda case: {k: v * 1.01 for k, v in entry.call(case).items()})
    (fail,) = run_entry(bad, cases=[c], device=dev, arch="sm90", oracle_mode="fast", judge_device=True)
    assert fail.verdict == "fail"


# (layer, heads, seq_lens, query_lens, options): the prefill draws' layers and options, small
PREFILL_DRAWS = [
    ("swa", 64, [300, 20, 1000], [3, 2, 30], {"empty_tokens": (1,), "stale_past_len": True}),
    ("c4a", 128, [700, 16], [32, 16], {"topk": 512, "q_scale_log2": 6}),
    ("c4a", 64, [4096, 300], [5, 1], {"topk": 2048, "stale_past_len": True, "empty_tokens": (0, 3)}),
    ("c128a", 64, [130, 520, 1000], [1, 7, 2], {"q_scale_log2": -6}),
]


@pytest.mark.parametrize("layer,heads,seq,ql,opts", PREFILL_DRAWS)
def test_prefill_every_stage_same_bytes_on_every_device(layer, heads, seq, ql, opts):
    ref = prefill_stages(layer, heads, seq, ql, seed=11, **opts)
    assert _same_bytes(ref, prefill_stages(layer, heads, seq, ql, seed=11, **opts), PREFILL_STAGES) == []
    assert _same_bytes(ref, prefill_stages(layer, heads, seq, ql, seed=12, **opts), PREFILL_STAGES) != []
    if torch.cuda.is_available():
        got = prefill_stages(layer, heads, seq, ql, seed=11, device="cuda", **opts)
        assert _same_bytes(ref, got, PREFILL_STAGES) == []


@pytest.mark.parametrize("layer,heads,seq,ql,opts", PREFILL_DRAWS)
def test_prefill_contract_matches_the_pipeline_builder(layer, heads, seq, ql, opts):
    c = device_prefill_case("d", layer, heads, seq, ql, seed=5, **opts)
    ref = prefill_case("p", layer, heads, seq, ql, seed=5, **{k: v for k, v in opts.items() if k != "q_scale_log2"})
    assert_same_inputs_contract(c, ref)
    for k in ("topk_length", "positions"):
        assert torch.equal(c.inputs[k], ref.inputs[k]), k
    # the same rows are poisoned (NaN: no valid entry reads them), every valid entry reads a finite row
    nan_c = torch.isnan(c.inputs["kv"].float()).all(dim=1)
    assert torch.equal(nan_c, torch.isnan(ref.inputs["kv"].float()).all(dim=1))
    i = c.inputs["indices"].to(torch.int64)
    valid = (torch.arange(i.shape[1])[None, :] < c.inputs["topk_length"][:, None]) & (i >= 0)
    assert not bool(nan_c[i[valid]].any())
    assert bool(torch.isfinite(c.inputs["kv"][~nan_c].float()).all())
