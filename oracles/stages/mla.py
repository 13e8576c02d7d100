"""MLA-family stages and oracle helpers: the three MLA stage specs, the V3.2 scale-policy explainer and
the MLA tolerance records.

The three MLA stage specs (``v32_decode``, ``dense_mla_decode``, ``dense_mla_prefill``) are
registered here (``_expected_v32``, ``_expected_dense_decode``, ``_expected_dense_prefill`` +
``core.judge_attention``); they call ``reference.caches.v32`` and ``reference.attention.mla_dense``.
This module also holds what is specific to the MLA family:

* ``v32_policy_fit(case, got_out, policies)``: the distance of a kernel's V3.2 output to the
  oracle under every ``V32ScaleDecode`` consumer policy (bf16-kernel emulation), so a failing
  ``v32_decode`` result says *which* scale decoding the kernel actually does (datapath 1.5,
  attention.md 6: SM100 head64 round-toward-zero through E8M0 vs SM90 bf16 rounding).
* ``mla_tolerance_records()``: the records of ``oracles/tolerances_mla.jsonl`` -- tier
  assignments of the FP8 dense-decode routes and one derived LSE override -- computed from the
  reference only (``python -m dsv4_numerics.oracles.stages.mla --out PATH`` regenerates them).

FP8 LSE override, derivation. The FP8 dense-decode kernels multiply e4m3 ``q`` and ``k`` on the
tensor cores. Hopper's FP8 MMA keeps only about 14 significand bits while accumulating
(DeepSeek-V3 technical report, section 3.3.2 "Increasing Accumulation Precision"), so a logit
``s_j = bmm1 * sum_i q_i k_ji`` can be off by about ``2**-14 * bmm1 * sum_i |q_i k_ji|`` (one
rounding at that precision of the magnitude of the dot product). The LSE is 1-Lipschitz in the
logits (sup norm), so ``|dLSE| <= max_j |ds_j|``. The record's ``atol`` is
``margin * 2**-14 * max_{case, token, head, visible j} bmm1 * sum_i |q_i k_ji|`` over the default
FP8 ``dense_mla_decode`` cases, evaluated on the reference inputs, and its ``cos_tol`` the cosine
diff that elementwise error implies, ``N atol**2 / sum lse_ref**2``; the tier-B default
(``tolerances.jsonl``) models exact fp32 logits and cannot hold for such a kernel.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import torch

from dsv4_numerics.reference.attention.ordered import scaled_logits
from dsv4_numerics.reference.cases import Case, default_cases
from dsv4_numerics.reference.errors import check_tensor, fail
from dsv4_numerics.reference.attention.mla_dense import dense_kv_rows, dense_token_indices
from dsv4_numerics.reference.policies import AttentionMode, NanPolicy, V32ScaleDecode

from .core import ATTN_DEFAULTS, StageSpec, policy_value, zero_rows, judge_attention, register, v_rms

__all__ = ["v32_policy_fit", "fp8_logit_magnitude", "mla_tolerance_records", "MLA_TOLERANCES_PATH",
           "FP8_ACCUM_BITS", "FP8_LSE_MARGIN"]

MLA_TOLERANCES_PATH = Path(__file__).parent.parent / "tolerances_mla.jsonl"
FP8_ACCUM_BITS = 14  # Hopper FP8 MMA accumulation precision (DeepSeek-V3 report, section 3.3.2)
FP8_LSE_MARGIN = 2.0
FP8_DENSE_KERNELS = ("flashmla.dense_decode_fp8", "flashinfer.mla_decode.*", "tokenspeed_mla.decode")


def v32_policy_fit(case: Case, got_out: torch.Tensor, policies: dict | None = None) -> dict[str, float]:
    """``{policy: max |got - oracle_bf16_p(policy)|}`` over every ``V32ScaleDecode`` policy for a
    ``v32_decode`` case (outputs of lonely / sink=+inf rows included; NaN-free finite outputs
    expected). The policy with the smallest distance is the one the kernel implements: on the
    H200 the FlashMLA SM90 kernel gave 0.0 under ``bf16_rne`` and 1.45e-2 under
    ``sm100_rz_e8m0`` on the ``nonpow2-scales`` case."""
    from .core import get

    fn = "v32_policy_fit"
    check_tensor(fn, "got_out", got_out)
    if case.stage != "v32_decode":
        fail(fn, "case", "must be a v32_decode case", case.stage)
    spec = get("v32_decode")
    g = got_out.detach().to("cpu", torch.float64)
    fit = {}
    for pol in V32ScaleDecode:
        p = spec.policies(dict(policies or {}, v32_scale_decode=pol.value,
                               attention_mode=AttentionMode.BF16_P.value))
        ref = spec.expected(case, p)["_same_precision"]
        if tuple(ref.shape) != tuple(g.shape):
            fail(fn, "got_out", f"must have the reference shape {tuple(ref.shape)}", tuple(g.shape))
        fit[pol.value] = float((g - ref).abs().max()) if g.numel() else 0.0
    return fit


def fp8_logit_magnitude(case: Case) -> float:
    """``max bmm1 * sum_i |q_i k_ji|`` over the visible (token, head, key) triples of a
    ``dense_mla_decode`` case, in float64 (``bmm1 = softmax_scale * q_scale * kv_scale``, ``q`` and
    ``k`` the exact values of the case's tensors)."""
    fn = "fp8_logit_magnitude"
    if case.stage != "dense_mla_decode":
        fail(fn, "case", "must be a dense_mla_decode case", case.stage)
    inp = case.inputs
    q = inp["q"].to(torch.float64)
    b, s, h, d = q.shape
    bs = int(inp["block_size"])
    rows = dense_kv_rows(inp["kv_cache"], bs).abs()
    idx, length = dense_token_indices(inp["block_table"], inp["seq_lens"], s, bs, causal=bool(inp["causal"]))
    bmm1 = float(inp["softmax_scale"]) * float(inp["q_scale"]) * float(inp["kv_scale"])
    qa = q.abs().reshape(b * s, h, d)
    worst = 0.0
    for t in range(b * s):
        n = int(length[t])
        if n == 0:
            continue
        k = rows[idx[t, :n].long()]  # [n, d], all finite (visible positions are never poisoned)
        # sum_i |q_i k_ji| accumulated over i = 0..d-1 in order (fixed order: no matmul)
        worst = max(worst, float(scaled_logits(qa[t][None], k[None], 1.0).max()) * bmm1)
    return worst


def mla_tolerance_records(cases: list[Case] | None = None) -> list[dict[str, Any]]:
    """The MLA-family tolerance records (``tolerances.py`` line format), derived from the
    reference inputs only (module docstring)."""
    cases = default_cases("dense_mla_decode") if cases is None else cases
    fp8 = [c for c in cases if c.inputs["q"].dtype == torch.float8_e4m3fn]
    if not fp8:
        fail("mla_tolerance_records", "cases", "must contain at least one FP8 dense_mla_decode case")
    mags = {c.name: fp8_logit_magnitude(c) for c in fp8}
    worst = max(mags.values())
    atol = float(f"{FP8_LSE_MARGIN * math.ldexp(worst, -FP8_ACCUM_BITS):.3g}")
    # cos_diff = sum (a - r)^2 / sum (a^2 + r^2) <= N atol^2 / sum r^2 with r the reference LSE
    # (finite entries; lonely rows are matched as anomalies, not compared)
    cos_tol = 0.0
    from .core import get

    spec = get("dense_mla_decode")
    for c in fp8:
        lse = spec.expected(c, spec.policies({}))["lse"]
        fin = lse[torch.isfinite(lse)]
        cos_tol = max(cos_tol, fin.numel() * atol * atol / float((fin * fin).sum()))
    cos_tol = float(f"{cos_tol:.3g}")
    recs: list[dict[str, Any]] = [
        {"kind": "assign", "tier": "B", "scope": {"kernel": "flashmla.dense_decode_fp8"},
         "reason": "FP8 q and cache on SM90: e4m3 QK and P.V wgmma (P must be e4m3 to meet the e4m3 V "
                   "operand), per-tensor descales (attention 4.1 FP8-compute class, tier B)"},
        {"kind": "assign", "tier": "B", "scope": {"kernel": "flashinfer.mla_decode.*", "dtype": "float8_e4m3fn"},
         "reason": "trtllm-gen / cute-dsl MLA decode with FP8 q and cache: FP8 MMAs [inferred] (attention 4.1)"},
        {"kind": "assign", "tier": "B", "scope": {"kernel": "tokenspeed_mla.decode", "dtype": "float8_e4m3fn"},
         "reason": "TokenSpeed MLA decode with FP8 q and cache (vLLM's only mode): FP8 MMAs [inferred]"},
    ]
    for kern in FP8_DENSE_KERNELS:
        scope = {"kernel": kern, "output": "lse"}
        if kern != "flashmla.dense_decode_fp8":
            scope["dtype"] = "float8_e4m3fn"
        recs.append({
            "kind": "override", "tier": "B", "scope": scope, "metric": "kernelkit",
            "atol": atol, "rtol_ulps": 0.0, "rtol_format": "fp32", "cos_tol": cos_tol, "margin": FP8_LSE_MARGIN,
            "derived": (f"FP8 MMA accumulation bound: |dLSE| <= max_j |ds_j| <= 2**-{FP8_ACCUM_BITS} * max bmm1 * "
                        f"sum_i |q_i k_ji| over visible keys of the default FP8 dense_mla_decode cases (reference "
                        f"inputs; stages.mla.fp8_logit_magnitude), times margin {FP8_LSE_MARGIN}; cos_tol = max over "
                        f"those cases of N atol**2 / sum(lse_ref**2) (bound of the cosine diff given |a - r| <= atol)"),
            "measured": {"max_logit_magnitude": float(f"{worst:.4g}"),
                         "per_case": {k: float(f"{v:.4g}") for k, v in mags.items()}},
            "authors": "none published for MLA FP8 decode LSE",
            "reason": "Hopper FP8 MMA keeps ~14 accumulation bits (DeepSeek-V3 report 3.3.2): logits are not "
                      "exact fp32, which the tier-B default (exact fp32 statistics) assumes",
        })
    return recs


# --------------------------------------------------------------------------- MLA-family stages


def _expected_v32(case: Case, policies: dict) -> dict:
    from dsv4_numerics.reference.attention.ordered import Segment, sparse_attention
    from dsv4_numerics.reference.caches.v32 import dequantize_v32_cache
    from dsv4_numerics.reference.policies import IndexRule, V32ScaleDecode

    inp = case.inputs
    q = inp["q"]
    b, s, h, d = q.shape
    rows = dequantize_v32_cache(inp["kv_cache"], inp["block_size"],
                                policy_value(policies, "v32_scale_decode", V32ScaleDecode.EXACT.value))
    idx = inp["indices"].reshape(b * s, -1)
    rule = policy_value(policies, "index_rule", IndexRule.ANY_OUT_OF_RANGE_INVALID.value)
    seg = [Segment(rows, idx, None, IndexRule(rule))]
    nan = policy_value(policies, "nan", NanPolicy.PROPAGATE.value)
    qf = q.reshape(b * s, h, d)
    ex = sparse_attention(qf, seg, inp["scale"], inp.get("sink"), d_v=inp["d_v"], nan_policy=nan)
    out = {"out": ex.out.reshape(b, s, h, -1), "lse": ex.lse.reshape(b, s, h),
           "_zero": zero_rows(ex.n_valid, inp.get("sink"), h).reshape(b, s, h),
           "_vrms": torch.tensor(v_rms(seg, b * s, inp["d_v"]))}
    if policy_value(policies, "attention_mode", AttentionMode.EXACT.value) == AttentionMode.BF16_P.value:
        bp = sparse_attention(qf, seg, inp["scale"], inp.get("sink"), d_v=inp["d_v"], nan_policy=nan,
                              mode=AttentionMode.BF16_P)
        out["_same_precision"] = bp.out.reshape(b, s, h, -1)
    return out


def _expected_dense_decode(case: Case, policies: dict) -> dict:
    from dsv4_numerics.reference.attention.mla_dense import dense_mla_decode

    inp = case.inputs
    qs, ks = float(inp.get("q_scale", 1.0)), float(inp.get("kv_scale", 1.0))
    q = inp["q"].to(torch.float64) * qs
    kv = inp["kv_cache"]
    kvf = kv.to(torch.float64) * ks if kv.dtype != torch.bfloat16 else kv
    kw = dict(d_v=512, causal=bool(inp.get("causal", True)))
    ex = dense_mla_decode(q, kvf, inp["block_table"], inp["seq_lens"], inp["block_size"], inp["softmax_scale"], **kw)
    from dsv4_numerics.reference.attention.ordered import Segment
    from dsv4_numerics.reference.attention.mla_dense import dense_kv_rows, dense_token_indices

    b, s, h, _ = q.shape
    rows = dense_kv_rows(kvf, inp["block_size"])
    idx, length = dense_token_indices(inp["block_table"], inp["seq_lens"], s, inp["block_size"],
                                      causal=kw["causal"], num_blocks=rows.shape[0] // inp["block_size"])
    out = {"out": ex.out, "lse": ex.lse, "_zero": (ex.n_valid == 0).reshape(b, s, 1).expand(b, s, h).clone(),
           "_vrms": torch.tensor(v_rms([Segment(rows, idx, length)], b * s, kw["d_v"]))}
    if policy_value(policies, "attention_mode", AttentionMode.EXACT.value) == AttentionMode.BF16_P.value:
        out["_same_precision"] = dense_mla_decode(q, kvf, inp["block_table"], inp["seq_lens"], inp["block_size"],
                                                  inp["softmax_scale"], mode=AttentionMode.BF16_P, **kw).out
    return out


def _expected_dense_prefill(case: Case, policies: dict) -> dict:
    from dsv4_numerics.reference.attention.mla_dense import dense_mha_prefill

    inp = case.inputs
    cq, ck = inp["cu_seqlens_q"], inp["cu_seqlens_kv"]
    ex = dense_mha_prefill(inp["q"], inp["k"], inp["v"], cq, ck, inp["scale"], causal=bool(inp.get("causal", True)))
    T, h, _ = inp["q"].shape
    v = inp["v"].to(torch.float64)
    out = {"out": ex.out, "lse": ex.lse, "_zero": (ex.n_valid == 0).reshape(T, 1).expand(T, h).clone(),
           "_vrms": torch.tensor(math.sqrt(float((v * v).mean())))}
    if policy_value(policies, "attention_mode", AttentionMode.EXACT.value) == AttentionMode.BF16_P.value:
        out["_same_precision"] = dense_mha_prefill(inp["q"], inp["k"], inp["v"], cq, ck, inp["scale"],
                                                   causal=bool(inp.get("causal", True)), mode=AttentionMode.BF16_P).out
    return out


register(StageSpec(
    name="v32_decode",
    kind="numeric",
    outputs=("out", "lse"),
    defaults=dict(ATTN_DEFAULTS),
    expected=_expected_v32,
    judge=lambda c, e, g, s: judge_attention(c, e, g, s, ("out", "lse")),
    doc="DeepSeek V3.2 sparse decode over the 656-byte cache (attention 1.3, datapath 1.5)"))
register(StageSpec(
    name="dense_mla_decode",
    kind="numeric",
    outputs=("out", "lse"),
    defaults=dict(ATTN_DEFAULTS),
    expected=_expected_dense_decode,
    judge=lambda c, e, g, s: judge_attention(c, e, g, s, ("out", "lse")),
    doc="dense paged MLA decode"))
register(StageSpec(
    name="dense_mla_prefill",
    kind="numeric",
    outputs=("out", "lse"),
    defaults=dict(ATTN_DEFAULTS),
    expected=_expected_dense_prefill,
    judge=lambda c, e, g, s: judge_attention(c, e, g, s, ("out", "lse")),
    doc="dense ragged MHA prefill (R1)"))


def _main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="write the MLA-family tolerance records (derived from the reference)")
    ap.add_argument("--out", default=str(MLA_TOLERANCES_PATH))
    a = ap.parse_args(argv)
    lines = ["# MLA-family tolerance records (format: oracles/tolerances.py). Generated by:",
             "#   python -m dsv4_numerics.oracles.stages.mla --out tolerances_mla.jsonl",
             "# Derived from the reference inputs only (oracles/stages/mla.py docstring); never edit by hand."]
    lines += [json.dumps(r, sort_keys=False) for r in mla_tolerance_records()]
    Path(a.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
