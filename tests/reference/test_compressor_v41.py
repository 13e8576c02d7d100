"""DeepSeek-V4.1 fused compressor reference (``reference.pipeline.compressor_v41``) and its stage
``v41_compress_insert``. Expected ring rows and pooled groups are named from the case layout by
hand in the comments; pooled values are checked against an independent float64 formula."""

from __future__ import annotations

import pytest
import torch

from dsv4_numerics.oracles import stages as st
from dsv4_numerics.oracles.stages import v41_compress as sc
from dsv4_numerics.oracles.matrix import run_entry
from dsv4_numerics.reference.cases import default_cases
from dsv4_numerics.reference.errors import InputError
from dsv4_numerics.reference.pipeline import compressor_v41 as cv41
from dsv4_numerics.reference.pipeline.rope import apply_rope

from ..mutants import reference_entry


def _case(prefix: str):
    return next(c for c in default_cases("v41_compress_insert") if c.name.startswith(prefix))


def _run(inp: dict) -> cv41.V41Compressed:
    return cv41.v41_save_compress(inp["kv_score"], inp["positions"], inp["state_cache"], inp["state_slots"],
                                  inp["query_start_loc"], inp["token_to_req_indices"], inp["norm_weight"],
                                  inp["eps"], inp["compress_ratio"])


def _pool_f64(kv: torch.Tensor, score: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Independent form: torch.softmax over the group rows, RMSNorm, all in float64."""
    p = torch.softmax(score.to(torch.float64), dim=0)
    x = (p * kv.to(torch.float64)).sum(0)
    return x / torch.sqrt((x * x).mean() + eps) * w.to(torch.float64)


def test_ring_keeps_each_chunks_last_capacity_rows():
    inp = _case("cr2-mxfp8").inputs  # chunks (5, 6), (0, 4), (9, 1), capacity 2, 2 padding tokens
    res = _run(inp)
    old, raw, slots = inp["state_cache"], inp["kv_score"], inp["state_slots"]
    want = old.clone()
    # chunk 0 = tokens 0..5 (positions 5..10): tokens 4, 5 -> rows 9 % 2 = 1, 10 % 2 = 0 of its block;
    # chunk 1 = tokens 6..9 (positions 0..3): tokens 8, 9 -> rows 0, 1; chunk 2 = token 10 (position 9) -> row 1
    for t in (4, 5, 8, 9, 10):
        s = int(slots[t])
        want[s // 2, s % 2] = raw[t]
    assert torch.equal(res.state, want)
    assert torch.equal(inp["state_cache"], old)  # the input ring is not modified


def test_first_group_of_a_chunk_pools_the_ring_predecessor():
    inp = _case("cr2-mxfp8").inputs
    res = _run(inp)
    old, raw, slots = inp["state_cache"], inp["kv_score"], inp["state_slots"]
    # group ends (odd positions): tokens 0 (p 5), 2 (p 7), 4 (p 9), 7 (p 1), 9 (p 3), 10 (p 9)
    assert res.tokens.tolist() == [0, 2, 4, 7, 9, 10]
    for i, t in enumerate(res.tokens.tolist()):
        if t in (0, 10):  # a chunk's first token: predecessor = ring row (p - 1) % 2 as it was before the call
            s = int(slots[t])
            prev = old[s // 2, (int(inp["positions"][t]) - 1) % 2]
        else:
            prev = raw[t - 1]
        rows = torch.stack((prev, raw[t]))
        want = _pool_f64(rows[:, :512], rows[:, 512:], inp["norm_weight"], inp["eps"])
        got = res.normed[i].to(torch.float64)
        assert bool(((got - want).abs() <= 2.0**-23 * want.abs() + 1e-30).all()), t
        assert torch.equal(res.latent[i], res.normed[i].to(torch.bfloat16))


def test_ratio1_pools_nothing_and_skips_negative_slots():
    inp = _case("cr1-fp8-584").inputs  # chunks (0, 5), (12, 3), one padding token with slot -1
    res = _run(inp)
    assert res.tokens.tolist() == list(range(8)) and res.state is None
    for i, t in enumerate(res.tokens.tolist()):
        x = inp["kv_score"][t].to(torch.float64)
        want = x / torch.sqrt((x * x).mean() + inp["eps"]) * inp["norm_weight"].to(torch.float64)
        assert bool(((res.normed[i].to(torch.float64) - want).abs() <= 2.0**-23 * want.abs() + 1e-30).all())


def test_publish_rows_rotate_at_the_group_start():
    inp = _case("cr2-plain-fp8").inputs
    res = _run(inp)
    latent = torch.zeros(inp["kv_score"].shape[0], 512, dtype=torch.bfloat16)
    latent[res.tokens] = res.latent
    rows, slots = cv41.v41_publish_rows(latent, inp["positions"], inp["cos_sin"], inp["cache_slots"], 2, "model1_584")
    take = res.tokens  # every group end has a cache slot in this case
    assert torch.equal(slots, inp["cache_slots"][take])
    rope_pos = inp["positions"][take] - 1  # p // 2 * 2 = p - 1 for an odd group end
    want = apply_rope(latent[take].to(torch.float32), rope_pos, inp["cos_sin"], arithmetic="fma_triton")
    assert torch.equal(rows[:, 448:], want[:, 448:].to(torch.bfloat16))
    assert torch.equal(rows[:, :448], latent[take, :448])
    v41_rows, _ = cv41.v41_publish_rows(latent, inp["positions"], inp["cos_sin"], inp["cache_slots"], 2, "mxfp8_528")
    nz = latent[take, :448] != 0  # NoPE pairs rotate by (1, 0): values kept, only zero signs may change
    assert torch.equal(v41_rows[:, :448][nz], latent[take, :448].to(torch.float32)[nz])
    assert torch.equal(v41_rows[:, 448:], want[:, 448:])


def test_bad_inputs_name_the_argument():
    inp = dict(_case("cr2-mxfp8").inputs)
    with pytest.raises(InputError, match="compress_ratio"):
        _run(dict(inp, compress_ratio=4))
    with pytest.raises(InputError, match="kv_score"):
        _run(dict(inp, kv_score=inp["kv_score"][:, :512].contiguous()))
    with pytest.raises(InputError, match="state_cache"):
        _run(dict(inp, state_cache=None))
    with pytest.raises(InputError, match="state_slots"):
        _run(dict(inp, state_slots=torch.full_like(inp["state_slots"], 99)))
    with pytest.raises(InputError, match="record"):
        cv41.v41_publish_rows(torch.zeros(2, 512, dtype=torch.bfloat16), torch.ones(2, dtype=torch.int64),
                              inp["cos_sin"], torch.zeros(2, dtype=torch.int64), 2, "fp16")


def test_reference_passes_every_default_case():
    results = run_entry(reference_entry("v41_compress_insert"), default_cases("v41_compress_insert"))
    assert len(results) == 5 and all(r.verdict == "pass" for r in results), results


def test_cache_is_judged_from_the_kernels_own_latent():
    """A latent one bf16 ulp off in one element is inside the tier: the cache written from THAT
    latent passes, the reference latent's cache (not what the kernel would write) fails."""
    case = _case("cr1-plain-bf16")
    spec = st.get("v41_compress_insert")
    pol = spec.policies({})
    e = spec.expected(case, pol)
    t = int(e["_tokens"][0])
    lat = e["latent"].clone()
    bits = lat.view(torch.int16).clone()
    # the other bf16 neighbour of the fp32 reference (a rounding that went the other way), on a NoPE
    # dim (stored verbatim in a plain bf16 row)
    r, b = float(e["_normed"][0, 10]), float(lat[t, 10])
    up = r >= b
    bits[t, 10] += 1 if up == (b > 0) else -1
    lat = bits.view(torch.bfloat16)
    scope = st.JudgeScope("test", policies=pol)
    good = {"latent": lat, "cache": sc.v41_compress_expected_cache(case, lat, pol)}
    assert spec.judge(case, e, good, scope).passed
    stale = {"latent": lat, "cache": e["cache"]}
    v = spec.judge(case, e, stale, scope)
    assert not v.passed and v.rule == "cache:bit_exact_from_latent"
    far = e["latent"].clone()
    far[t] = (e["_normed"][0] + 3 * e["_bound"][0].to(torch.float32) + 0.05 * e["_normed"][0].abs()).to(torch.bfloat16)
    v = spec.judge(case, e, {"latent": far, "cache": sc.v41_compress_expected_cache(case, far, pol)}, scope)
    assert not v.passed and v.rule == "latent:compressor_tier"
